// AdamW's lean state formats in training, on the cpu backend: every placement of a format
// (the master, the moments, the weights on the device or in host memory) takes the steps
// of the same format kept on the device, bit for bit, under both ZeRO stages and with a
// later micro-batch; streamed gradients (no clipping, one sequence a step) give the bits
// of kept ones; a run saved in a format resumes in it bit for bit (also at another rank
// count for q8, whose blocks are the unit's), and in another format only when asked to
// convert; the ledger holds what each format says it holds.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "model/parameter_store.hpp"
#include "train/trainer.hpp"

namespace upipe {
namespace {

const adamw_state_format q8_kahan{moment_format::q8, master_format::bf16_kahan};
const adamw_state_format bf16_moments{moment_format::bf16, master_format::f32};

train_options base(zero_stage zero, std::int64_t batch, const adamw_state_format& format, dtype grads) {
  train_options o;
  o.model = preset("tiny-llama");
  o.seq_len = 64;
  o.cp = {strategy_kind::upipe, 2, 0};
  o.zero = zero;
  o.batch = batch;
  o.optim.lr = 3e-3;
  o.optim.total_steps = 4;
  o.optim.warmup_steps = 1;
  o.seed = 7;
  o.eval_samples = 0;
  o.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
  o.state_format = format;
  o.grad_type = grads;
  return o;
}

train_options placed(train_options o, const offload_options& where) {
  o.offload_optimizer = where.optimizer;
  o.offload_params = where.params;
  o.offload_master = where.master;
  return o;
}

std::string where_text(const offload_options& w) {
  return std::string(w.optimizer ? "optimizer" : w.master ? "master" : "none") + (w.params ? ",params" : "");
}

void expect_same_steps(const train_summary& got, const train_summary& want) {
  ASSERT_EQ(got.steps.size(), want.steps.size());
  for (std::size_t i = 0; i < got.steps.size(); ++i) {
    EXPECT_EQ(got.steps[i].loss, want.steps[i].loss) << "step " << i + 1;
    EXPECT_EQ(got.steps[i].grad_norm, want.steps[i].grad_norm) << "step " << i + 1;
  }
}

const offload_options every_placement[] = {{false, false, true}, {true, false}, {false, true, true}, {true, true}};

TEST(lean_state, every_placement_takes_the_device_steps_bit_for_bit) {
  struct format_case {
    adamw_state_format format;
    dtype grads;
  };
  const format_case formats[] = {{{}, dtype::bf16}, {bf16_moments, dtype::bf16}, {q8_kahan, dtype::bf16}};
  for (const format_case& f : formats) {
    const train_options o = base(zero_stage::three, 1, f.format, f.grads);
    const train_summary reference = train(o, nullptr);
    ASSERT_EQ(reference.steps.size(), 4u);
    EXPECT_LT(reference.steps.back().loss, reference.steps.front().loss);
    for (const offload_options& where : every_placement) {
      SCOPED_TRACE(where_text(where) + " moments " + std::to_string(static_cast<int>(f.format.moments)));
      const train_summary got = train(placed(o, where), nullptr);
      expect_same_steps(got, reference);
      // The moments stay on the device with the master alone in host memory.
      const auto& peaks = got.peak_bytes[0];
      const std::size_t on_device = peaks.count("optimizer") ? peaks.at("optimizer") : 0;
      EXPECT_EQ(on_device > 0, where.master) << on_device;
      EXPECT_GT(peaks.at("optimizer_host"), 0u);
    }
  }
}

TEST(lean_state, zero_two_and_a_later_micro_batch_in_every_placement) {
  const train_options o = base(zero_stage::two, 2, q8_kahan, dtype::bf16);
  const train_summary reference = train(o, nullptr);
  for (const offload_options& where : every_placement) {
    SCOPED_TRACE(where_text(where));
    expect_same_steps(train(placed(o, where), nullptr), reference);
  }
}

// No clipping at one sequence a step: no gradient shard is kept, each unit is updated from
// its reduced gradients as they arrive (on the device, or on the host). A clipping bound
// no norm reaches scales nothing, so the kept path gives the same steps.
TEST(lean_state, streamed_gradients_give_the_kept_bits) {
  for (const adamw_state_format& format : {adamw_state_format{}, q8_kahan}) {
    train_options kept = base(zero_stage::three, 1, format, dtype::f32);
    kept.optim.max_grad_norm = 1e30;
    train_options streamed = kept;
    streamed.optim.max_grad_norm = 0;
    ASSERT_EQ(state_options_of(streamed).grads, grad_keeping::streamed);
    ASSERT_EQ(state_options_of(kept).grads, grad_keeping::kept);
    const train_summary reference = train(kept, nullptr);
    const train_summary on_device = train(streamed, nullptr);
    expect_same_steps(on_device, reference);
    EXPECT_LT(on_device.peak_bytes[0].at("grads"), reference.peak_bytes[0].at("grads"));  // no shard kept
    for (const offload_options& where : every_placement) {
      SCOPED_TRACE(where_text(where));
      expect_same_steps(train(placed(streamed, where), nullptr), reference);
    }
  }
}

std::filesystem::path temp_dir(const char* name) {
  return std::filesystem::temp_directory_path() / (std::string(name) + std::to_string(::getpid()));
}

// Saved after step 3, resumed to step 6: the steps of the run that never stopped.
TEST(lean_state, each_format_resumes_bit_for_bit) {
  const auto dir = temp_dir("upipe_lean_resume_");
  for (const adamw_state_format& format : {bf16_moments, q8_kahan}) {
    train_options whole = base(zero_stage::three, 1, format, dtype::bf16);
    whole.optim.total_steps = 6;
    const train_summary reference = train(whole, nullptr);
    std::filesystem::remove_all(dir);
    train_options first = whole;
    first.stop_after = 3;
    first.save_dir = dir.string();
    train(first, nullptr);
    train_options second = placed(whole, {true, true});  // any placement resumes any other
    second.resume_dir = dir.string();
    const train_summary resumed = train(second, nullptr);
    ASSERT_EQ(resumed.steps.size(), 3u);
    for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(resumed.steps[i].loss, reference.steps[3 + i].loss) << "step " << 4 + i;
  }
  std::filesystem::remove_all(dir);
}

// q8's blocks are the unit's, not a rank's: a shard of two ranks splits at a block, and
// the state saved by two ranks loads into one as the same codes and absmax.
TEST(lean_state, q8_state_reshards_to_another_rank_count) {
  const auto dir = temp_dir("upipe_lean_reshard_");
  std::filesystem::remove_all(dir);
  train_options two = base(zero_stage::three, 1, q8_kahan, dtype::bf16);
  two.optim.total_steps = 4;
  two.stop_after = 2;
  two.save_dir = dir.string();
  train(two, nullptr);
  train_options one = base(zero_stage::two, 1, q8_kahan, dtype::bf16);
  one.optim.total_steps = 4;
  one.cp = {strategy_kind::upipe, 1, 0};
  one.resume_dir = dir.string();
  const train_summary resumed = train(one, nullptr);
  ASSERT_EQ(resumed.steps.size(), 2u);
  // The reference at C = 2 differs only in the order the two ranks' partial sums were added.
  train_options whole = base(zero_stage::three, 1, q8_kahan, dtype::bf16);
  const train_summary reference = train(whole, nullptr);
  EXPECT_NEAR(resumed.steps[0].loss, reference.steps[2].loss, 1e-4 * reference.steps[2].loss);
  std::filesystem::remove_all(dir);
}

TEST(lean_state, another_format_resumes_only_when_asked_to_convert) {
  const auto dir = temp_dir("upipe_lean_convert_");
  std::filesystem::remove_all(dir);
  train_options first = base(zero_stage::three, 1, q8_kahan, dtype::bf16);
  first.optim.total_steps = 4;
  first.stop_after = 2;
  first.save_dir = dir.string();
  const train_summary saved = train(first, nullptr);
  train_options second = base(zero_stage::three, 1, adamw_state_format{}, dtype::f32);
  second.optim.total_steps = 4;
  second.resume_dir = dir.string();
  try {
    train(second, nullptr);
    ADD_FAILURE() << "a q8 state resumed as fp32 without --convert-optimizer-state";
  } catch (const config_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("--optimizer-state 8bit --master-weights bf16-kahan"), std::string::npos) << what;
    EXPECT_NE(what.find("--convert-optimizer-state"), std::string::npos) << what;
  }
  second.convert_state = true;
  const train_summary converted = train(second, nullptr);
  ASSERT_EQ(converted.steps.size(), 2u);
  // The same weights and (decoded) moments: the next loss is the q8 run's own next loss to
  // within what the encodings lose.
  train_options continued = first;
  continued.stop_after = 0;
  continued.save_dir.clear();
  continued.resume_dir = dir.string();
  const train_summary same = train(continued, nullptr);
  EXPECT_NEAR(converted.steps[0].loss, same.steps[0].loss, 1e-3 * same.steps[0].loss);
  EXPECT_LT(converted.steps.back().loss, saved.steps.front().loss);
  std::filesystem::remove_all(dir);
}

// The meta backend (bf16 working dtype, as the GPU) holds what each format says: per
// element the master's and the moments' bytes (bf16-kahan: the compensation alone beside
// the working weights), the kept gradient shard's.
TEST(lean_state, the_ledger_holds_what_each_format_says) {
  const auto elements = [](const model_config& m, int ranks, const optimizer_state_options& s) {
    double n = 0;
    for (const auto& unit : parameter_units(m)) {
      std::int64_t numel = 0;
      for (const unit_parameter& p : unit) numel += p.numel;
      n += static_cast<double>(padded_unit(numel, ranks, s) / ranks);
    }
    return n;
  };
  for (const adamw_state_format& format : {adamw_state_format{}, bf16_moments, q8_kahan}) {
    train_options o = base(zero_stage::three, 1, format, dtype::bf16);
    o.backend = backend_kind::meta;
    o.optim.total_steps = 1;
    const optimizer_state_options s = state_options_of(o);
    const state_element_bytes per = state_bytes_per_element(s, dtype::bf16);
    const step_memory m = measure_step_memory(o);
    EXPECT_EQ(static_cast<double>(m.peak_bytes.at("optimizer")), elements(o.model, 2, s) * (per.master + per.moments))
        << static_cast<int>(format.moments);
    // With the state in host memory the pool holds it all, the working copy on its way included.
    train_options host = placed(o, {true, false});
    const step_memory h = measure_step_memory(host);
    EXPECT_EQ(h.peak_bytes.count("optimizer") ? h.peak_bytes.at("optimizer") : 0u, 0u);
    EXPECT_EQ(h.peak_bytes.at("optimizer_host"),
              offloaded_bytes(o.model, 2, dtype::bf16, zero_stage::three, {true, false}, 1, s));
  }
}

}  // namespace
}  // namespace upipe
