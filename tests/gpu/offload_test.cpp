// --offload on the CUDA backend: the GPU's AdamW kernel and the host optimizer round alike
// (one formula, no fused multiply-add on either side), and whole training steps with the
// optimizer, and with the optimizer and the weights, in pinned host memory follow the
// steps whose state is all on the GPU (within bf16 and cuDNN's nondeterminism, the
// gradients being computed on the GPU either way), while the ledger shows what moved.
// Skipped when no CUDA device is present.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "backend/ops.hpp"
#include "core/dtype.hpp"
#include "model/parameter_store.hpp"
#include "ops/cpu/cpu_ops.hpp"
#include "train/trainer.hpp"
#include "gpu_support.hpp"

namespace upipe {
namespace {

TEST(gpu_offload, the_gpu_kernel_and_the_host_optimizer_give_the_same_bits) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  auto gpu = make_cuda_backend({std::size_t{256} << 20, std::size_t{16} << 20}, 0);
  const std::int64_t n = 4099;  // the vector path and a scalar tail on the GPU, all lanes on the host
  std::mt19937 rng(21);
  std::uniform_real_distribution<float> weight(-2.0f, 2.0f), grad(-1.0f, 1.0f);
  std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f), g(n);
  for (float& x : master) x = weight(rng);
  std::vector<tensor> on_gpu;
  for (const char* label : {"master", "exp_avg", "exp_avg_sq", "grad"})
    on_gpu.push_back(gpu->allocate(mem_tag::optimizer, dtype::f32, {1, n}, label));
  tensor gpu_weights = gpu->allocate(mem_tag::weights, dtype::bf16, {1, n}, "weights");
  gpu->upload_f32(on_gpu[0], master.data());
  gpu->upload_f32(on_gpu[1], m.data());
  gpu->upload_f32(on_gpu[2], v.data());
  std::vector<std::uint16_t> host_weights(n);
  const auto flat = [n](void* data, dtype type) { return mat_view{data, type, 1, n, n}; };
  for (std::int64_t step = 1; step <= 3; ++step) {
    for (float& x : g) x = grad(rng);
    gpu->upload_f32(on_gpu[3], g.data());
    adamw_args a{on_gpu[0].matrix(), on_gpu[1].matrix(), on_gpu[2].matrix(), on_gpu[3].matrix(), gpu_weights.matrix()};
    a.lr = 1e-2f;
    a.beta2 = 0.999f;
    a.weight_decay = 0.1f;
    a.grad_scale = 0.37f;
    a.step = step;
    ops::adamw(*gpu, a);
    a.master = flat(master.data(), dtype::f32);
    a.exp_avg = flat(m.data(), dtype::f32);
    a.exp_avg_sq = flat(v.data(), dtype::f32);
    a.grad = flat(g.data(), dtype::f32);
    a.weights = flat(host_weights.data(), dtype::bf16);
    cpu::run(a);
  }
  std::vector<float> got(n);
  const std::vector<float>* want[] = {&master, &m, &v};
  for (int t = 0; t < 3; ++t) {
    gpu->download_f32(got.data(), on_gpu[t]);
    for (std::int64_t i = 0; i < n; ++i)
      ASSERT_EQ(got[i], (*want[t])[i]) << on_gpu[t].label() << " element " << i;
  }
  std::vector<std::uint16_t> got_weights(n);
  gpu->download_bytes(got_weights.data(), gpu_weights, gpu_weights.bytes());
  EXPECT_EQ(got_weights, host_weights);
}

train_options tiny_run(zero_stage zero, std::int64_t batch) {
  train_options o;
  o.model = preset("tiny-llama");
  o.seq_len = 128;
  o.cp = {strategy_kind::upipe, 2, 0};
  o.zero = zero;
  o.batch = batch;
  o.optim.lr = 3e-3;
  o.optim.total_steps = 8;
  o.eval_samples = 0;
  o.backend = backend_kind::cuda;
  o.limits = {std::size_t{1} << 30, std::size_t{256} << 20};
  return o;
}

// Step by step, the losses of two runs within bf16's tolerance.
void expect_losses_near(const train_summary& got, const train_summary& want) {
  ASSERT_EQ(got.steps.size(), want.steps.size());
  for (std::size_t i = 0; i < got.steps.size(); ++i)
    EXPECT_LT(std::abs(got.steps[i].loss - want.steps[i].loss) / want.steps[i].loss, bf16_tolerance) << "step " << i + 1;
}

std::size_t peak(const train_summary& s, const char* tag) {
  return s.peak_bytes[0].count(tag) ? s.peak_bytes[0].at(tag) : 0;
}

// The offloaded steps against the device's: ZeRO-2 and 3, one and two sequences a step,
// with clipping (AdamW after the norm, beside the next forward) and without (AdamW beside
// the backward).
TEST(gpu_offload, offloaded_steps_follow_the_device_steps) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (zero_stage z : {zero_stage::two, zero_stage::three})
    for (std::int64_t batch : {1, 2})
      for (const double clip : {1.0, 0.0}) {
        train_options o = tiny_run(z, batch);
        o.optim.max_grad_norm = clip;
        const train_summary device = train(o, nullptr);
        for (const bool params : {false, true}) {
          train_options off = o;
          off.offload_optimizer = true;
          off.offload_params = params;
          SCOPED_TRACE(std::string("zero=") + (z == zero_stage::three ? "3" : "2") + " batch=" +
                       std::to_string(batch) + " clip=" + std::to_string(clip) + (params ? " optimizer,params" : " optimizer"));
          const train_summary host = train(off, nullptr);
          ASSERT_EQ(host.steps.size(), device.steps.size());
          for (std::size_t i = 0; i < host.steps.size(); ++i) {
            EXPECT_LT(std::abs(host.steps[i].loss - device.steps[i].loss) / device.steps[i].loss, bf16_tolerance)
                << "step " << i + 1;
            EXPECT_LT(std::abs(host.steps[i].grad_norm - device.steps[i].grad_norm) / device.steps[i].grad_norm,
                      bf16_tolerance)
                << "step " << i + 1;
          }
          EXPECT_EQ(peak(host, "optimizer"), 0u);
          EXPECT_GT(peak(host, "optimizer_host"), 0u);
          if (!params) continue;
          EXPECT_GT(peak(host, "weights_host"), 0u);
          if (z == zero_stage::two) EXPECT_LT(peak(host, "weights"), peak(device, "weights"));
        }
      }
}

// The update beside the next forward (--offload-overlap on) follows the one within its step
// (off), with the master alone and with the whole optimizer on the host, and the phase table
// on the GPU accounts for the step: its stages (CUDA events on the step's stream) sum to the
// stream's span, which the step's clock holds; the weights brought in are every unit's
// bf16 shard at each acquire; the host's AdamW ran.
TEST(gpu_offload, the_overlapped_update_follows_the_one_within_its_step_and_its_phases_add_up) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  const offload_options placements[] = {{true, true}, {false, true, true}};
  for (const offload_options& where : placements) {
    train_options o = tiny_run(zero_stage::three, 1);
    o.offload_optimizer = where.optimizer;
    o.offload_params = where.params;
    o.offload_master = where.master;
    o.state_format = {moment_format::q8, master_format::bf16_kahan};
    o.grad_type = dtype::bf16;
    SCOPED_TRACE(where.optimizer ? "optimizer,params" : "master,params");
    o.offload_overlap = false;
    const train_summary before = train(o, nullptr);
    o.offload_overlap = true;
    expect_losses_near(train(o, nullptr), before);
    // One timed step: its whole update within its clock (with more, which step's take holds
    // a piece that ends at a step's boundary is the host's race).
    const step_timing t = time_steps(o, 64, 1, group_run::rank_zero_emulated, phase_timing::by_phase);
    const step_phases& p = t.step;
    double sum = 0;
    for (const auto& [stage, ms] : p.stages_ms) {
      EXPECT_GE(ms, 0.0) << stage;
      sum += ms;
    }
    EXPECT_NEAR(sum, p.span_ms, 1e-6 * p.span_ms);
    EXPECT_LE(p.span_ms, p.wall_ms);
    for (const char* stage : {"forward", "loss", "backward", "update", "copy_out"})
      EXPECT_GT(p.stages_ms.count(stage), 0u) << stage;
    const auto units = parameter_units(o.model);
    double bytes = 0;
    for (std::size_t u = 0; u < units.size(); ++u) {
      std::int64_t numel = 0;
      for (const unit_parameter& q : units[u]) numel += q.numel;
      const double shard = static_cast<double>(padded_unit(numel, 2, state_options_of(o)) / 2 * 2);
      const bool embedding = u == 0, head = u + 1 == units.size();
      bytes += shard * (head ? 1 : 2) + (embedding && o.model.tie_embeddings ? shard : 0);
    }
    ASSERT_TRUE(p.side_copies.count("weights_in"));
    EXPECT_DOUBLE_EQ(p.side_copies.at("weights_in").bytes, bytes);
    EXPECT_GT(p.side_copies.at("weights_in").ms, 0.0);
    const char* adamw = where.optimizer ? "host_adamw" : "host_adamw_master";
    ASSERT_TRUE(p.host.count(adamw));
    EXPECT_GT(p.host.at(adamw).busy_ms, 0.0);
  }
}

}  // namespace
}  // namespace upipe
