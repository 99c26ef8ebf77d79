// What a plan costs: the meta probes it runs stay bounded (counted in plan_result::stats,
// never timed), a repeat is answered by the plan's cache, and the state sweep's pruning
// (a leaner format bounds a more precise one) loses no longer length.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>

#include "model/model_step.hpp"
#include "plan/planner.hpp"

namespace upipe {
namespace {

// A two-layer llama3.2-1b on one GPU of 8 GiB: every placement and state format tried, as
// `upipe plan` does on one GPU, and the one-mesh sweep.
plan_request one_gpu_request() {
  plan_request r;
  r.model = preset("llama3.2-1b");
  r.model.num_layers = 2;
  r.gpus = 1;
  r.gpu_memory = std::size_t{8} << 30;
  r.host_memory = std::size_t{48} << 30;
  r.try_offload = r.try_state = true;
  r.dps = {1};
  r.eval = false;
  return r;
}

std::int64_t longest(const plan_entry& e) { return e.longest ? e.longest->seq_len : 0; }

TEST(plan_cost, probes_stay_bounded_and_a_repeat_is_answered_by_the_cache) {
  plan_request r = one_gpu_request();
  r.cache = make_probe_cache();
  const plan_result plan = make_plan(r);
  ASSERT_FALSE(plan.entries.empty());
  ASSERT_FALSE(plan.state_entries.empty());
  // Every configuration searched (the sweep's and the state sweep's) tries each policy: a
  // probe one granule past the best so far, and a search from there predicted from the
  // probes' needs (a secant), a few probes where doubling then bisection took about
  // 2 log2(S / granule), over 30 at these lengths. The meshes add a probe per policy and
  // chunk count. Two and a half probes a policy on average bound them all (about two here).
  const long policies = static_cast<long>(candidate_policies().size());
  const long searched = static_cast<long>(plan.entries.size() + plan.state_entries.size() + plan.meshes.size());
  EXPECT_GT(plan.stats.step_probes, 0);
  EXPECT_EQ(plan.stats.eval_probes, 0);
  EXPECT_LE(2 * plan.stats.step_probes, 5 * policies * searched)
      << plan.stats.step_probes << " probes for " << searched << " configurations";
  EXPECT_GT(plan.stats.longest_probed, 0);
  // The same request again on the same cache runs no meta step and plans the same.
  const plan_result again = make_plan(r);
  EXPECT_EQ(again.stats.step_probes, plan.stats.step_probes);
  EXPECT_GT(again.stats.cache_hits, plan.stats.cache_hits);
  ASSERT_EQ(again.state_entries.size(), plan.state_entries.size());
  for (std::size_t i = 0; i < plan.state_entries.size(); ++i)
    EXPECT_EQ(longest(again.state_entries[i]), longest(plan.state_entries[i])) << i;
  EXPECT_EQ(again.recommended_state, plan.recommended_state);
}

TEST(plan_cost, every_state_formats_longest_is_the_longest_any_policy_fits) {
  const plan_request r = one_gpu_request();
  const plan_result plan = make_plan(r);
  ASSERT_FALSE(plan.state_entries.empty());
  bool any = false;
  for (const plan_entry& e : plan.state_entries) {
    plan_request with = r;
    with.state = e.state;
    with.offload_optimizer = e.offload_optimizer;
    with.offload_params = e.offload_params;
    with.offload_master = e.offload_master;
    const cp_settings cp{e.strategy, r.gpus, e.head_chunk, e.ring, e.seq_chunks};
    const std::int64_t next = longest(e) + layout_unit(cp) * 1024;
    SCOPED_TRACE("state entry at S = " + std::to_string(longest(e)));
    if (e.longest) {
      any = true;
      EXPECT_TRUE(e.longest->fits);
    }
    // No policy fits one granule further, the pruned ones included.
    for (const checkpoint_policy& p : candidate_policies()) EXPECT_FALSE(evaluate(with, cp, next, p).fits) << p.str();
  }
  EXPECT_TRUE(any);
}

}  // namespace
}  // namespace upipe
