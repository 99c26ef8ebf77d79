// The lean AdamW state on the CUDA backend against the cpu's arithmetic: every format
// (f32, bf16 and q8 moments; f32 and bf16-kahan masters) over the six steps of the NumPy
// reference (tests/golden/optim), bit for bit, whole, as its two halves on the GPU, and
// with the moments' half on the GPU and the master's on the host (--offload master), with
// f32 and bf16 gradients; then whole training steps of tiny-llama in every format and
// placement, which follow the device placement within bf16 and cuDNN's nondeterminism.
// Skipped when no CUDA device is present.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "../support/adamw_fixture.hpp"
#include "ops/cpu/cpu_ops.hpp"
#include "train/trainer.hpp"
#include "gpu_support.hpp"

namespace upipe {
namespace {

using namespace adamw_fixture;

memory_limits limits() { return {std::size_t{256} << 20, std::size_t{64} << 20}; }

enum class split : std::uint8_t { whole, halves_on_gpu, master_on_host };

// Six steps of `mode` on the GPU, each checked against the reference.
void check_six_steps(const state_mode& mode, split how) {
  const fixture f = load();
  auto gpu = make_cuda_backend(limits(), 0);
  auto cpu = make_cpu_backend(limits());
  mode_state s(*gpu, f, mode);
  // The master's side on the host for master_on_host: the same fresh state.
  mode_state host(*cpu, f, mode);
  for (std::int64_t t = 0; t < f.steps; ++t) {
    put(*gpu, s.grad, f.get("grad." + std::to_string(t)));
    std::vector<adamw_run> runs;
    if (how == split::whole) {
      ops::adamw(*gpu, s.args(f, t, adamw_part::whole, 0, f.n, runs));
    } else {
      ops::adamw(*gpu, s.args(f, t, adamw_part::moments, 0, f.n, runs));
      if (how == split::halves_on_gpu) {
        ops::adamw(*gpu, s.args(f, t, adamw_part::master, 0, f.n, runs));
      } else {
        put(*cpu, host.direction, take(*gpu, s.direction));
        ops::adamw(*cpu, host.args(f, t, adamw_part::master, 0, f.n, runs));
      }
    }
    gpu->synchronize();
    std::map<std::string, std::vector<float>> got = s.values(*gpu);
    if (how == split::master_on_host) {
      got["master"] = take(*cpu, host.master);
      if (!host.comp.empty()) got["master_comp"] = take(*cpu, host.comp);
    }
    for (const auto& [what, values] : got)
      EXPECT_EQ(first_difference(values, f.get(f.name(mode, t, what.c_str()))), "")
          << mode.key() << " step " << t << " " << what;
    if (how != split::master_on_host) {
      // The bf16 working copy is the master rounded (bf16-kahan: the master itself).
      std::vector<float> want = got.at("master");
      for (float& x : want) x = round_to_bf16(x);
      EXPECT_EQ(first_difference(take(*gpu, s.weights), want), "") << mode.key() << " step " << t;
    }
  }
}

TEST(gpu_lean_state, every_format_matches_the_reference_bit_for_bit) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (const state_mode& mode : all_modes()) check_six_steps(mode, split::whole);
}

TEST(gpu_lean_state, the_halves_on_the_gpu_and_across_to_the_host_give_the_whole_bits) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (const state_mode& mode : all_modes()) {
    check_six_steps(mode, split::halves_on_gpu);
    check_six_steps(mode, split::master_on_host);
  }
}

// bf16 gradients on the GPU against the cpu backend given the same bf16 values.
TEST(gpu_lean_state, bf16_gradients_match_the_cpu) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  const fixture f = load();
  for (const state_mode& mode : all_modes()) {
    auto gpu = make_cuda_backend(limits(), 0);
    auto cpu = make_cpu_backend(limits());
    mode_state on_gpu(*gpu, f, mode, dtype::bf16), on_cpu(*cpu, f, mode, dtype::bf16);
    for (std::int64_t t = 0; t < f.steps; ++t) {
      const std::vector<float> g = f.get("grad." + std::to_string(t));
      put(*gpu, on_gpu.grad, g);
      put(*cpu, on_cpu.grad, g);
      std::vector<adamw_run> runs;
      ops::adamw(*gpu, on_gpu.args(f, t, adamw_part::whole, 0, f.n, runs));
      ops::adamw(*cpu, on_cpu.args(f, t, adamw_part::whole, 0, f.n, runs));
      gpu->synchronize();
      const auto want = on_cpu.values(*cpu);
      for (const auto& [what, got] : on_gpu.values(*gpu))
        EXPECT_EQ(first_difference(got, want.at(what)), "") << mode.key() << " step " << t << " " << what;
    }
  }
}

// Whole steps of tiny-llama on the GPU in every format and placement: the placements follow
// the device's (the gradients are the GPU's own in each run, so within its nondeterminism),
// and every format learns.
TEST(gpu_lean_state, training_steps_in_every_format_and_placement) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  const adamw_state_format formats[] = {{}, {moment_format::bf16, master_format::f32},
                                        {moment_format::q8, master_format::bf16_kahan}};
  const offload_options placements[] = {{}, {false, false, true}, {true, false}, {false, true, true}, {true, true}};
  for (const adamw_state_format& format : formats) {
    train_options o;
    o.model = preset("tiny-llama");
    o.seq_len = 256;
    o.cp = {strategy_kind::upipe, 2, 0};
    o.zero = zero_stage::three;
    o.optim.lr = 3e-3;
    o.optim.total_steps = 6;
    o.optim.warmup_steps = 1;
    o.eval_samples = 0;
    o.backend = backend_kind::cuda;
    o.limits = {std::size_t{512} << 20, std::size_t{256} << 20};
    o.state_format = format;
    o.grad_type = dtype::bf16;
    std::vector<double> reference;
    for (const offload_options& where : placements) {
      train_options p = o;
      p.offload_optimizer = where.optimizer;
      p.offload_params = where.params;
      p.offload_master = where.master;
      const train_summary s = train(p, nullptr);
      ASSERT_EQ(s.steps.size(), 6u);
      for (const step_record& r : s.steps) ASSERT_TRUE(std::isfinite(r.loss));
      EXPECT_LT(s.steps.back().loss, s.steps.front().loss) << static_cast<int>(format.moments);
      if (reference.empty()) {
        for (const step_record& r : s.steps) reference.push_back(r.loss);
        continue;
      }
      for (std::size_t i = 0; i < reference.size(); ++i)
        EXPECT_NEAR(s.steps[i].loss, reference[i], 2e-2 * reference[i])
            << "step " << i + 1 << " master " << where.master << " optimizer " << where.optimizer << " params "
            << where.params;
    }
  }
}

}  // namespace
}  // namespace upipe
