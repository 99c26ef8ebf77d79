// The offloaded update overlapped with the next step's work (--offload-overlap on, the
// default) against the same run without the overlap and against nothing offloaded, on the
// cpu backend: after several steps the saved weights and every tensor of AdamW's state
// hold the same bytes, under ZeRO-2 and ZeRO-3, in each state format and placement, with
// clipping (the update after the global norm, beside the next forward) and without (each
// unit as its gradients arrive). And the step's phase table accounts for the step: its
// stages sum to the stream's span, which the wall time holds, the side copies are the
// weights the step brought in, and the host's AdamW shows where it ran.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <string>

#include "formats/safetensors.hpp"
#include "model/parameter_store.hpp"
#include "train/trainer.hpp"
#include "train_support.hpp"

namespace upipe {
namespace {

namespace fs = std::filesystem;

const adamw_state_format q8_kahan{moment_format::q8, master_format::bf16_kahan};
const adamw_state_format bf16_moments{moment_format::bf16, master_format::f32};

struct format_case {
  adamw_state_format format;
  dtype grads;
  const char* name;
};
const format_case formats[] = {{{}, dtype::f32, "fp32"}, {bf16_moments, dtype::bf16, "bf16 moments"},
                               {q8_kahan, dtype::bf16, "8bit, bf16-kahan"}};

struct placement {
  offload_options where;
  const char* name;
};
const placement placements[] = {{{true, false}, "optimizer"},
                                {{true, true}, "optimizer,params"},
                                {{false, false, true}, "master"},
                                {{false, true, true}, "master,params"}};

train_options base(zero_stage zero, const format_case& f, double clip) {
  train_options o = four_tiny_steps({strategy_kind::upipe, 2, 0}, zero, 1);
  o.optim.total_steps = 3;
  o.optim.max_grad_norm = clip;
  o.state_format = f.format;
  o.grad_type = f.grads;
  o.save_model = {dtype::f32, std::size_t{1} << 30};
  return o;
}

train_options placed(train_options o, const offload_options& where, bool overlap) {
  o.offload_optimizer = where.optimizer;
  o.offload_params = where.params;
  o.offload_master = where.master;
  o.offload_overlap = overlap;
  return o;
}

// Runs `o` and saves its last step into `dir`; returns that checkpoint.
fs::path run_and_save(train_options o, const fs::path& dir) {
  fs::remove_all(dir);
  o.save_dir = dir.string();
  return train(o, nullptr).last_checkpoint;
}

// Every tensor of every safetensors file in a checkpoint (weights, each rank's state), by
// file and name.
std::map<std::string, safetensors_file> tensors_of(const fs::path& checkpoint) {
  std::map<std::string, safetensors_file> out;
  for (const auto& entry : fs::recursive_directory_iterator(checkpoint))
    if (entry.path().extension() == ".safetensors")
      out.emplace(fs::relative(entry.path(), checkpoint).string(), read_safetensors(entry.path().string()));
  return out;
}

// The same files, tensors, dtypes and shapes, and every value the same bits (as stored:
// f32, or bf16 and u8 codes, each read back into f32 one way).
void expect_same_bytes(const fs::path& got, const fs::path& want) {
  const auto a = tensors_of(got), b = tensors_of(want);
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [file, tensors] : b) {
    ASSERT_TRUE(a.count(file)) << file;
    const safetensors_file& mine = a.at(file);
    ASSERT_EQ(mine.tensors.size(), tensors.tensors.size()) << file;
    for (const auto& [name, t] : tensors.tensors) {
      ASSERT_TRUE(mine.tensors.count(name)) << file << " " << name;
      const safetensors_entry& e = mine.tensors.at(name);
      EXPECT_EQ(e.dtype, t.dtype) << name;
      ASSERT_EQ(e.shape, t.shape) << name;
      EXPECT_EQ(std::memcmp(e.values.data(), t.values.data(), t.values.size() * sizeof(float)), 0) << file << " " << name;
    }
  }
}

fs::path temp_dir(const std::string& name) {
  return fs::temp_directory_path() / ("upipe_overlap_" + name + "_" + std::to_string(::getpid()));
}

TEST(offload_overlap, every_format_and_placement_saves_the_bytes_of_the_run_without_overlap) {
  const fs::path root = temp_dir("bytes");
  for (const zero_stage zero : {zero_stage::two, zero_stage::three})
    for (const format_case& f : formats) {
      const train_options o = base(zero, f, 1.0);
      const fs::path reference = run_and_save(o, root / "device");
      for (const placement& p : placements) {
        SCOPED_TRACE(std::string(f.name) + ", " + p.name + (zero == zero_stage::three ? ", ZeRO-3" : ", ZeRO-2"));
        const fs::path before = run_and_save(placed(o, p.where, false), root / "off");
        expect_same_bytes(before, reference);
        expect_same_bytes(run_and_save(placed(o, p.where, true), root / "on"), before);
      }
    }
  fs::remove_all(root);
}

// Without clipping nothing waits for the norm: each unit is updated as its gradients
// arrive (streamed, one sequence a step), overlapped or not.
TEST(offload_overlap, without_clipping_the_streamed_update_saves_the_same_bytes) {
  const fs::path root = temp_dir("streamed");
  for (const zero_stage zero : {zero_stage::two, zero_stage::three}) {
    const train_options o = base(zero, formats[2], 0.0);
    ASSERT_EQ(state_options_of(o).grads, grad_keeping::streamed);
    const fs::path reference = run_and_save(o, root / "device");
    for (const placement& p : placements) {
      SCOPED_TRACE(std::string(p.name) + (zero == zero_stage::three ? ", ZeRO-3" : ", ZeRO-2"));
      expect_same_bytes(run_and_save(placed(o, p.where, true), root / "on"), reference);
      expect_same_bytes(run_and_save(placed(o, p.where, false), root / "off"), reference);
    }
  }
  fs::remove_all(root);
}

// A later micro-batch adds into the kept shard, and the master alone on the host leaves
// each unit's update to the next forward: the pending update must read the shard before
// the next step's first micro-batch overwrites it.
TEST(offload_overlap, micro_batches_and_a_resume_keep_the_bytes) {
  const fs::path root = temp_dir("batches");
  train_options o = base(zero_stage::three, formats[2], 1.0);
  o.batch = 2;
  const fs::path reference = run_and_save(o, root / "device");
  for (const placement& p : placements) {
    SCOPED_TRACE(p.name);
    expect_same_bytes(run_and_save(placed(o, p.where, true), root / "on"), reference);
  }
  fs::remove_all(root);
}

double sum_of(const std::map<std::string, double>& m) {
  double s = 0;
  for (const auto& [name, ms] : m) s += ms;
  return s;
}

// The weights the step brings in under ZeRO-3 (rank 0's f32 shard of each padded unit): every
// layer in the forward and in the backward, the embedding in the forward and for layer 0's
// recompute (tiny-llama ties it to the head, so the head takes it again), the head once.
double weights_in_bytes(const train_options& o) {
  const model_config& m = o.model;
  const int ranks = o.cp.cp;
  const auto units = parameter_units(m);
  double bytes = 0;
  for (std::size_t u = 0; u < units.size(); ++u) {
    std::int64_t numel = 0;
    for (const unit_parameter& p : units[u]) numel += p.numel;
    const double shard = static_cast<double>(padded_unit(numel, ranks, state_options_of(o)) / ranks * 4);
    const bool embedding = u == 0, head = u + 1 == units.size();
    bytes += shard * (head ? 1 : 2) + (embedding && m.tie_embeddings ? shard : 0);
  }
  return bytes;
}

TEST(offload_overlap, the_phase_table_accounts_for_the_step) {
  for (const placement& p : placements) {
    SCOPED_TRACE(p.name);
    const train_options o = placed(base(zero_stage::three, formats[2], 1.0), p.where, true);
    // One timed step after a warm-up whose update is done before it: its own update runs
    // within its clock (a run's last step waits for its own), so every piece of it is in the
    // step's take. (With more steps, a step's update goes on beside the next one, and the
    // pieces that end after a step's take are the next step's: which step holds them is
    // the host's race.)
    const step_timing t = time_steps(o, 32, 1, group_run::rank_zero_emulated, phase_timing::by_phase);
    const step_phases& s = t.step;
    ASSERT_FALSE(s.empty());
    // The stream cut into intervals: by stage they sum to its span, which the step's clock holds.
    EXPECT_NEAR(sum_of(s.stages_ms), s.span_ms, 1e-9 * s.span_ms);
    EXPECT_GE(s.rest_ms(), 0.0);
    EXPECT_LE(s.span_ms, s.wall_ms);
    for (const char* stage : {"forward", "loss", "backward", "update"}) EXPECT_GT(s.stages_ms.count(stage), 0u) << stage;
    for (const auto& [stage, ms] : s.stages_ms) EXPECT_GE(ms, 0.0) << stage;
    EXPECT_LE(s.gpu_ms(), s.span_ms);
    // The host's work: AdamW whole, or the master's half, on the host's threads.
    const char* adamw = p.where.optimizer ? "host_adamw" : "host_adamw_master";
    ASSERT_TRUE(s.host.count(adamw)) << adamw;
    EXPECT_GT(s.host.at(adamw).pieces, 0);
    EXPECT_GE(s.host.at(adamw).cpu_ms, s.host.at(adamw).busy_ms * (1 - 1e-9));
    EXPECT_GE(s.host.at("host").busy_ms, s.host.at(adamw).busy_ms * (1 - 1e-9));
    // Gradient shards (or the master's steps) leave on the step's stream.
    EXPECT_GT(s.stages_ms.count("copy_out"), 0u);
    if (p.where.params) {
      ASSERT_TRUE(s.side_copies.count("weights_in"));
      EXPECT_DOUBLE_EQ(s.side_copies.at("weights_in").bytes, weights_in_bytes(o));
    } else {
      EXPECT_EQ(s.side_copies.count("weights_in"), 0u);
    }
  }
}

// train --phases: a table per step, its stages within the step's clock; the run's values
// are those of a run without it.
TEST(offload_overlap, train_phases_leave_the_steps_alone) {
  train_options o = placed(base(zero_stage::three, formats[0], 1.0), placements[3].where, true);
  const train_summary plain = train(o, nullptr);
  o.phases = true;
  const train_summary timed = train(o, nullptr);
  ASSERT_EQ(timed.steps.size(), plain.steps.size());
  for (std::size_t i = 0; i < timed.steps.size(); ++i) {
    const step_record& r = timed.steps[i];
    EXPECT_EQ(r.loss, plain.steps[i].loss);
    EXPECT_TRUE(plain.steps[i].phases.empty());
    ASSERT_FALSE(r.phases.empty()) << "step " << r.step;
    EXPECT_NEAR(sum_of(r.phases.stages_ms), r.phases.span_ms, 1e-9 * r.phases.span_ms);
    EXPECT_LE(r.phases.span_ms, r.phases.wall_ms) << "step " << r.step;
    EXPECT_GT(r.phases.stages_ms.count("forward"), 0u);
  }
}

}  // namespace
}  // namespace upipe
