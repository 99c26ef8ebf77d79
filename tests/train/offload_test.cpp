// --offload on the cpu backend: with AdamW's state in host memory (optimizer), and with the
// working weights there too (optimizer,params), training takes the very steps of training
// with everything on the device, bit for bit, under every strategy, ZeRO stage and batch,
// with and without gradient clipping (without it AdamW runs beside the backward), and a
// run saved under one offload resumes under another. What moved shows in the ledger.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>
#include <utility>

#include "core/error.hpp"
#include "model/parameter_store.hpp"
#include "train/trainer.hpp"
#include "train_support.hpp"

namespace upipe {
namespace {

train_options base(const cp_settings& cp, zero_stage zero, std::int64_t batch) {
  return four_tiny_steps(cp, zero, batch);
}

train_options offloaded(train_options o, bool params) {
  o.offload_optimizer = true;
  o.offload_params = params;
  return o;
}

std::string name_of(const train_options& o) {
  return std::string(strategy_name(o.cp.strategy)) + " C=" + std::to_string(o.cp.cp) +
         " zero=" + (o.zero == zero_stage::three ? "3" : "2") + " batch=" + std::to_string(o.batch) +
         (o.offload_params ? " optimizer,params" : o.offload_optimizer ? " optimizer" : "");
}

void expect_same_steps(const train_summary& got, const train_summary& want) {
  ASSERT_EQ(got.steps.size(), want.steps.size());
  for (std::size_t i = 0; i < got.steps.size(); ++i) {
    EXPECT_EQ(got.steps[i].loss, want.steps[i].loss) << "step " << i + 1;
    EXPECT_EQ(got.steps[i].grad_norm, want.steps[i].grad_norm) << "step " << i + 1;
  }
}

// The working weights in host memory (f32 on the cpu backend): this rank's shard of every
// unit under ZeRO-3, every unit whole under ZeRO-2.
std::size_t host_weight_bytes(const model_config& model, int ranks, zero_stage z) {
  std::int64_t elements = 0;
  for (const auto& unit : parameter_units(model)) {
    std::int64_t numel = 0;
    for (const unit_parameter& p : unit) numel += p.numel;
    const std::int64_t shard = (numel + ranks - 1) / ranks;
    elements += z == zero_stage::three ? shard : shard * ranks;
  }
  return static_cast<std::size_t>(elements) * sizeof(float);
}

std::size_t peak(const train_summary& s, const char* tag) {
  const auto& by_tag = s.peak_bytes[0];
  return by_tag.count(tag) ? by_tag.at(tag) : 0;
}

TEST(offload, every_strategy_zero_stage_and_batch_takes_the_device_steps_bit_for_bit) {
  const cp_settings layouts[] = {{strategy_kind::ulysses, 2, 0}, {strategy_kind::upipe, 2, 0},
                                 {strategy_kind::ring, 2, 0}, {strategy_kind::hybrid, 4, 0, 2}};
  for (const cp_settings& cp : layouts)
    for (zero_stage z : {zero_stage::two, zero_stage::three})
      for (std::int64_t batch : {1, 2}) {
        const train_options o = base(cp, z, batch);
        const train_summary reference = train(o, nullptr);
        ASSERT_EQ(reference.steps.size(), 4u);
        EXPECT_GT(peak(reference, "optimizer"), 0u);
        for (const bool params : {false, true}) {
          const train_options off = offloaded(o, params);
          SCOPED_TRACE(name_of(off));
          const train_summary got = train(off, nullptr);
          expect_same_steps(got, reference);
          EXPECT_EQ(peak(got, "optimizer"), 0u);
          // Master, moments and gradients (16 bytes an element), and AdamW's working copy on its
          // way (4 more) unless the weights themselves are on the host.
          EXPECT_GE(peak(got, "optimizer_host"), offloaded_optimizer_bytes(o.model, cp.cp, dtype::f32) / 5 * (params ? 4 : 5));
          if (!params) continue;
          // The weights live on the host; the device holds the units in use (and one ahead).
          EXPECT_GE(peak(got, "weights_host"), host_weight_bytes(o.model, cp.cp, z));
          if (z == zero_stage::two) EXPECT_LT(peak(got, "weights"), peak(reference, "weights"));
        }
      }
}

// Without clipping no unit's update waits for the global norm: each runs on the host as
// soon as the unit's last gradients land, beside the rest of the backward.
TEST(offload, without_clipping_units_update_beside_the_backward_bit_for_bit) {
  for (zero_stage z : {zero_stage::two, zero_stage::three}) {
    train_options o = base({strategy_kind::upipe, 2, 0}, z, 2);
    o.optim.max_grad_norm = 0;
    const train_summary reference = train(o, nullptr);
    for (const bool params : {false, true}) {
      SCOPED_TRACE(name_of(offloaded(o, params)));
      const train_summary got = train(offloaded(o, params), nullptr);
      expect_same_steps(got, reference);
      EXPECT_GT(got.steps.back().grad_norm, 0.0);  // still measured, for the log
    }
  }
}

TEST(offload, a_run_saved_under_one_offload_resumes_under_another_bit_for_bit) {
  const auto dir = std::filesystem::temp_directory_path() / ("upipe_offload_" + std::to_string(::getpid()));
  train_options whole = base({strategy_kind::upipe, 2, 0}, zero_stage::three, 2);
  whole.optim.total_steps = 6;
  const train_summary reference = train(whole, nullptr);
  const offload_options none{}, optimizer{true, false}, params{true, true};
  const std::pair<offload_options, offload_options> pairs[] = {{params, none}, {none, params}, {optimizer, params}};
  for (const auto& [saved_with, resumed_with] : pairs) {
    std::filesystem::remove_all(dir);
    train_options first = whole;
    first.offload_optimizer = saved_with.optimizer;
    first.offload_params = saved_with.params;
    first.stop_after = 3;
    first.save_dir = dir.string();
    train(first, nullptr);
    train_options second = whole;
    second.offload_optimizer = resumed_with.optimizer;
    second.offload_params = resumed_with.params;
    second.zero = zero_stage::two;  // the shards are the same under either stage
    second.resume_dir = dir.string();
    const train_summary resumed = train(second, nullptr);
    ASSERT_EQ(resumed.steps.size(), 3u);
    for (std::size_t i = 0; i < 3; ++i)
      EXPECT_EQ(resumed.steps[i].loss, reference.steps[3 + i].loss)
          << "step " << 4 + i << ", saved " << saved_with.params << saved_with.optimizer << " resumed "
          << resumed_with.params << resumed_with.optimizer;
  }
  std::filesystem::remove_all(dir);
}

TEST(offload, the_weights_offloaded_alone_are_refused) {
  train_options o = base({strategy_kind::upipe, 2, 0}, zero_stage::two, 1);
  o.offload_params = true;
  try {
    train(o, nullptr);
    ADD_FAILURE() << "weights offloaded without the optimizer";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("--offload optimizer,params"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace upipe
