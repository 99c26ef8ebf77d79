// The planner's sweep over data-parallel meshes: below the length limit replicas of smaller
// CP groups train more tokens per GPU in the step-time model (ZeRO's collectives are one
// replica's whatever D, so their cost per token falls as 1/D, and across nodes only 1/C of
// them crosses), at the limit only CP over every GPU fits, and the probe shards ZeRO's
// state over every rank of the mesh.
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "plan/planner.hpp"
#include "train/trainer.hpp"

namespace upipe {
namespace {

plan_request small_request() {
  plan_request r;
  r.model = preset("llama3.2-1b");
  r.gpus = 8;
  r.gpu_memory = std::size_t{24} << 30;
  r.host_memory = std::size_t{64} << 30;
  r.strategies = {strategy_kind::ulysses, strategy_kind::upipe};
  r.seq_chunks = {1};
  r.dps = {1, 2, 4, 8};
  return r;
}

const mesh_entry* find(const plan_result& p, int dp, strategy_kind kind) {
  for (const mesh_entry& e : p.meshes)
    if (e.dp == dp && e.cp.strategy == kind) return &e;
  return nullptr;
}

TEST(mesh_plan, below_the_length_limit_more_replicas_train_more_tokens_per_gpu) {
  plan_request r = small_request();
  r.seq_len = 64 << 10;
  const plan_result p = make_plan(r);
  for (int d : r.dps)
    for (strategy_kind kind : r.strategies) {
      const mesh_entry* e = find(p, d, kind);
      ASSERT_NE(e, nullptr) << "D = " << d << " " << strategy_name(kind);
      EXPECT_EQ(e->cp.cp, 8 / d);
      EXPECT_TRUE(e->point.fits);
      EXPECT_EQ(e->point.seq_len, 64 << 10);
      // Each replica trains a sequence on its C GPUs in a modelled step.
      EXPECT_DOUBLE_EQ(e->tokens_per_s_per_gpu(), 65536.0 / e->point.time->total() / e->cp.cp);
    }
  ASSERT_TRUE(p.recommended_mesh && p.best_cp_only);
  const mesh_entry& best = p.meshes[*p.recommended_mesh];
  const mesh_entry& cp_only = p.meshes[*p.best_cp_only];
  EXPECT_GT(best.dp, 1);
  EXPECT_EQ(cp_only.dp, 1);
  EXPECT_GT(best.tokens_per_s_per_gpu(), 1.05 * cp_only.tokens_per_s_per_gpu());
  // A replica's compute per token is the same on any mesh; ZeRO's time per step is the same
  // too (8 ranks in one node: 3/4 in the group of 4, then 1/2 of its quarter across the
  // two replicas, 7/8 as over 8), so per token D = 2 halves it.
  const mesh_entry& one = *find(p, 1, strategy_kind::ulysses);
  const mesh_entry& two = *find(p, 2, strategy_kind::ulysses);
  EXPECT_NEAR(two.point.time->gemm, 2 * one.point.time->gemm, 1e-9 * two.point.time->gemm);
  EXPECT_NEAR(two.point.time->zero + two.point.time->data_parallel, one.point.time->zero, 1e-9 * one.point.time->zero);
  // More replicas of smaller groups hold more activations per GPU, and less ZeRO state:
  // the probe shards it over all 8 ranks whatever D (the optimizer's state is the same).
  EXPECT_GT(find(p, 8, strategy_kind::ulysses)->point.gpu_bytes, one.point.gpu_bytes);
  EXPECT_EQ(find(p, 8, strategy_kind::ulysses)->point.memory.peak_bytes.at("optimizer"),
            one.point.memory.peak_bytes.at("optimizer"));
}

TEST(mesh_plan, at_the_length_limit_only_cp_over_every_gpu_fits) {
  plan_request r = small_request();
  r.strategies = {strategy_kind::upipe};
  r.dps = {1, 2};
  r.policy = checkpoint_policy{checkpoint_content::layer_input, 1, checkpoint_location::device};
  r.eval = false;
  const plan_result p = make_plan(r);  // the length: upipe's longest on all 8 GPUs
  ASSERT_GT(p.planned_seq_len, 0);
  ASSERT_TRUE(p.recommended_mesh);
  EXPECT_EQ(p.meshes[*p.recommended_mesh].dp, 1);
  EXPECT_FALSE(find(p, 2, strategy_kind::upipe)->point.fits);
}

TEST(mesh_plan, across_nodes_replicas_keep_the_cp_group_inside_a_node) {
  plan_request r = small_request();
  r.nodes = 2;  // 4 GPUs a node
  r.strategies = {strategy_kind::upipe, strategy_kind::hybrid};
  r.seq_len = 64 << 10;
  const plan_result p = make_plan(r);
  // Hybrid runs where a CP group spans the nodes (D = 1, a ring of 2), not inside one.
  EXPECT_EQ(find(p, 1, strategy_kind::hybrid)->cp.ring, 2);
  EXPECT_EQ(find(p, 2, strategy_kind::hybrid), nullptr);
  // Two replicas of a node each: the all-to-all stays on NVLink and only 1/4 of ZeRO's
  // traffic crosses the network, so D = 2 beats CP over both nodes by far.
  const mesh_entry& two = *find(p, 2, strategy_kind::upipe);
  const mesh_entry& one = *find(p, 1, strategy_kind::upipe);
  EXPECT_GT(two.tokens_per_s_per_gpu(), 1.3 * one.tokens_per_s_per_gpu());
}

TEST(mesh_plan, bad_replica_counts_are_refused) {
  plan_request r = small_request();
  r.dps = {3};
  EXPECT_THROW(make_plan(r), config_error);
  r.dps = {};
  r.dp = 0;
  EXPECT_THROW(validate(r), config_error);
}

}  // namespace
}  // namespace upipe
