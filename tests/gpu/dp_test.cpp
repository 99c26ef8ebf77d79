// Data parallelism beside context parallelism on the GPU (docs/design.md section 11):
// D = 2 replicas of C = 2 virtual ranks sharing one GPU (threads communicator, device
// copies) train the steps one rank of the cpu backend trains with the replicas' sequences
// as one batch, under every strategy and both ZeRO stages; the same over NCCL with a GPU
// per rank where there are enough (D x C GPUs in this process, or the job's ranks under
// mpirun/srun), skipped otherwise; and an emulated mesh (rank 0 of D x C) runs.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "comm/launch.hpp"
#include "comm/nccl.hpp"
#include "train/trainer.hpp"

#include "gpu_support.hpp"

namespace upipe {
namespace {

train_options mesh_run(int dp, const cp_settings& cp, zero_stage zero) {
  train_options o;
  o.model = preset("tiny-llama");
  o.seq_len = 256;
  o.dp = dp;
  o.cp = cp;
  o.zero = zero;
  o.optim.total_steps = 3;
  o.optim.lr = 1e-2;
  o.eval_samples = 0;
  o.backend = backend_kind::cuda;
  o.limits = {std::size_t{512} << 20, std::size_t{64} << 20};
  o.comm = {comm_kind::threads, 60};
  return o;
}

// One rank of the cpu backend with the mesh's global batch: the same sequences (time_steps
// gives step i's global batch to the replicas in order).
step_timing one_cpu_rank(const train_options& o) {
  train_options one = o;
  one.dp = 1;
  one.batch = global_batch(o);
  one.cp = {strategy_kind::ulysses, 1, 0};
  one.backend = backend_kind::cpu;
  one.comm = {comm_kind::threads, 60};
  one.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
  return time_steps(one, 0, 3, group_run::every_rank);
}

std::string name_of(const train_options& o) {
  return std::string(strategy_name(o.cp.strategy)) + " D=" + std::to_string(o.dp) + " C=" + std::to_string(o.cp.cp) +
         " zero=" + (o.zero == zero_stage::three ? "3" : "2") + " comm=" + std::string(comm_kind_name(o.comm.kind));
}

// Losses within bf16's tolerance of the cpu rank's, and the gradient norms too (AdamW's
// step hardly depends on the gradients' scale, so a reduction off by a factor, a sum for
// a mean or a replica left out, shows in the norm alone).
void expect_steps_match(const step_timing& got, const step_timing& want, const std::string& what) {
  if (got.losses.empty()) return;  // a rank other than 0 under a launcher keeps no results
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  for (std::size_t i = 0; i < got.losses.size(); ++i) {
    std::printf("%s step %zu: loss %.6f, one cpu rank %.6f; |g| %.6f, one cpu rank %.6f\n", what.c_str(), i + 1,
                got.losses[i], want.losses[i], got.grad_norms[i], want.grad_norms[i]);
    EXPECT_LT(std::abs(got.losses[i] - want.losses[i]) / want.losses[i], bf16_tolerance) << what << " step " << i + 1;
    EXPECT_LT(std::abs(got.grad_norms[i] - want.grad_norms[i]) / want.grad_norms[i], bf16_tolerance)
        << what << " step " << i + 1;
  }
}

TEST(gpu_dp, two_replicas_of_two_virtual_ranks_match_one_cpu_rank) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  if (launcher_environment()) GTEST_SKIP() << "virtual ranks run in one process";
  const std::vector<cp_settings> strategies = {{strategy_kind::ulysses, 2, 0},
                                               {strategy_kind::upipe, 2, 2},
                                               {strategy_kind::ring, 2, 0},
                                               {strategy_kind::fpdt, 2, 0, 1, 2},
                                               {strategy_kind::hybrid, 2, 0, 2}};
  for (zero_stage zero : {zero_stage::two, zero_stage::three})
    for (const cp_settings& cp : strategies) {
      const train_options o = mesh_run(2, cp, zero);
      expect_steps_match(time_steps(o, 0, 3, group_run::every_rank), one_cpu_rank(o), name_of(o));
    }
}

TEST(gpu_dp, offloaded_optimizer_on_the_mesh_matches_one_cpu_rank) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  if (launcher_environment()) GTEST_SKIP() << "virtual ranks run in one process";
  train_options o = mesh_run(2, {strategy_kind::upipe, 2, 2}, zero_stage::three);
  o.offload_optimizer = o.offload_params = true;
  o.limits.host_bytes = std::size_t{256} << 20;
  expect_steps_match(time_steps(o, 0, 3, group_run::every_rank), one_cpu_rank(o), name_of(o) + " offload optimizer,params");
}

// NCCL, a GPU per rank: D = 2 replicas of the rest (and D = W replicas of one GPU), with
// ZeRO-3 and the weights' gather ahead of use (its first level across the replicas, then
// the CP group's in flight).
TEST(gpu_dp, nccl_meshes_match_one_cpu_rank) {
  const auto env = launcher_environment();
  const int world = env ? env->size : visible_gpus();
  if (!have_gpu() || world < 2) GTEST_SKIP() << "needs 2 GPUs or more (" << world << " here)";
  std::vector<int> meshes = {2};
  if (world > 2) meshes.push_back(world);
  for (const int dp : meshes) {
    if (world % dp != 0) continue;
    for (strategy_kind kind : {strategy_kind::ulysses, strategy_kind::ring}) {
      const int cp = world / dp;
      if (kind == strategy_kind::ring && cp == 1) continue;
      train_options o = mesh_run(dp, {kind, cp, 0}, zero_stage::three);
      o.comm = {comm_kind::nccl, 60};
      o.step.prefetch_weights = true;
      expect_steps_match(time_steps(o, 0, 3, group_run::every_rank), one_cpu_rank(o), name_of(o));
    }
  }
}

// Rank 0 of a 4 x 2 mesh alone (what bench --dp --emulate-cp runs): its ZeRO state is 1/8
// of the model's, its collectives on loopbacks; a step runs and is timed.
TEST(gpu_dp, an_emulated_mesh_times_rank_0) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  train_options o = mesh_run(4, {strategy_kind::upipe, 2, 2}, zero_stage::three);
  const step_timing mesh = time_steps(o, 0, 2, group_run::rank_zero_emulated);
  o.dp = 1;
  const step_timing group = time_steps(o, 0, 2, group_run::rank_zero_emulated);
  ASSERT_EQ(mesh.seconds.size(), 2u);
  EXPECT_GT(mesh.seconds.back(), 0);
  EXPECT_LT(mesh.memory.peak_bytes.at("optimizer"), group.memory.peak_bytes.at("optimizer"));
}

}  // namespace
}  // namespace upipe
