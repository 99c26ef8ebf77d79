// The planner on the meta backend: its workspace model against the H200's measurements,
// the search (the longest length fits and one granule more does not), the recommended U
// and bad requests.
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "model/model_step.hpp"
#include "plan/planner.hpp"

namespace upipe {
namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

TEST(planner, cudnn_workspace_model_matches_the_h200_measurements) {
  // bench-attention on the H200, H = 32, K = 8, d = 128, C = 4, S = 16K (workspace tag
  // minus cuBLASLt's 32 MiB): ulysses 128.5 MiB, upipe U = 4 8.0625, U = 8 32.125,
  // U = 16 64.25, ring 64.5; S = 64K: ulysses 514, upipe U = 4 32.25.
  model_config m = preset("llama3-8b");
  auto ws = [&](strategy_kind kind, int u, std::int64_t s) {
    return static_cast<double>(estimate_overheads(m, {kind, 4, u}, s).cudnn_workspace) / mib;
  };
  EXPECT_DOUBLE_EQ(ws(strategy_kind::ulysses, 32, 16384), 128.5);
  EXPECT_DOUBLE_EQ(ws(strategy_kind::upipe, 4, 16384), 8.0625);
  EXPECT_DOUBLE_EQ(ws(strategy_kind::upipe, 8, 16384), 32.125);
  EXPECT_DOUBLE_EQ(ws(strategy_kind::upipe, 16, 16384), 64.25);
  EXPECT_DOUBLE_EQ(ws(strategy_kind::ring, 0, 16384), 64.5);
  EXPECT_DOUBLE_EQ(ws(strategy_kind::ulysses, 32, 65536), 514.0);
  EXPECT_DOUBLE_EQ(ws(strategy_kind::upipe, 4, 65536), 32.25);
  EXPECT_EQ(estimate_overheads(m, {strategy_kind::upipe, 4, 4}, 16384).cublaslt_workspace, 32 * mib);
}

plan_request small_request() {
  plan_request r;
  r.model = preset("llama3.2-1b");
  r.model.num_layers = 2;
  r.gpus = 4;
  r.gpu_memory = std::size_t{6} << 30;
  r.host_memory = std::size_t{64} << 30;
  return r;
}

TEST(planner, the_longest_length_fits_and_one_granule_more_does_not) {
  plan_request r = small_request();
  r.seq_len = 65536;
  const plan_result plan = make_plan(r);
  // ulysses, upipe at every valid U, ring.
  ASSERT_EQ(plan.entries.size(), 2 + valid_head_chunks(r.model.num_heads, r.gpus).size());
  std::int64_t ulysses = 0, upipe_c = 0;
  for (const plan_entry& e : plan.entries) {
    SCOPED_TRACE(std::string(strategy_name(e.strategy)) + " U=" + std::to_string(e.head_chunk));
    ASSERT_TRUE(e.longest.has_value());
    EXPECT_TRUE(e.longest->fits);
    EXPECT_LE(e.longest->gpu_bytes, static_cast<std::size_t>(0.95 * static_cast<double>(r.gpu_memory)));
    EXPECT_GT(e.longest->memory.peak_bytes.at("weights"), 0u);
    const cp_settings cp{e.strategy, r.gpus, e.head_chunk};
    const std::int64_t next = e.longest->seq_len + layout_unit(cp) * 1024;
    for (const checkpoint_policy& p : candidate_policies()) EXPECT_FALSE(evaluate(r, cp, next, p).fits) << p.str();
    // At the requested length: it fits exactly when the longest is at least as long.
    ASSERT_TRUE(e.at_request.has_value());
    EXPECT_EQ(e.at_request->fits, e.longest->seq_len >= *r.seq_len);
    if (e.strategy == strategy_kind::ulysses) ulysses = e.longest->seq_len;
    if (e.strategy == strategy_kind::upipe && e.head_chunk == r.gpus) upipe_c = e.longest->seq_len;
  }
  // UPipe with U = C holds the fewest heads at once, so it reaches furthest.
  EXPECT_GT(upipe_c, ulysses);
  // The recommended U is the largest upipe U whose longest length reaches the plan's.
  ASSERT_TRUE(plan.recommended_head_chunk.has_value());
  EXPECT_EQ(plan.planned_seq_len, 65536);
  for (const plan_entry& e : plan.entries)
    if (e.strategy == strategy_kind::upipe && e.head_chunk > *plan.recommended_head_chunk)
      EXPECT_LT(e.longest->seq_len, plan.planned_seq_len) << e.head_chunk;
}

TEST(planner, host_memory_limits_offloaded_checkpoints) {
  plan_request r = small_request();
  r.strategies = {strategy_kind::upipe};
  const plan_result roomy = make_plan(r);
  r.host_memory = std::size_t{1} << 30;
  const plan_result tight = make_plan(r);
  ASSERT_EQ(roomy.entries.size(), tight.entries.size());
  for (std::size_t i = 0; i < roomy.entries.size(); ++i) {
    EXPECT_LE(tight.entries[i].longest->seq_len, roomy.entries[i].longest->seq_len);
    EXPECT_LE(tight.entries[i].longest->host_bytes, static_cast<std::size_t>(0.95 * (1 << 30)));
  }
}

TEST(planner, bad_requests_are_refused) {
  plan_request r = small_request();
  r.gpus = 0;
  EXPECT_THROW(validate(r), config_error);
  r = small_request();
  r.seq_len = 1004;  // a multiple of C = 4, not of ring's 2C = 8
  try {
    validate(r);
    ADD_FAILURE() << "no config_error";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("use --seq-len 1008"), std::string::npos) << e.what();
  }
  r = small_request();
  r.margin = 1.0;
  EXPECT_THROW(validate(r), config_error);
  r = small_request();
  r.gpus = 3;  // 32 heads over 3 GPUs
  EXPECT_THROW(validate(r), config_error);
}

}  // namespace
}  // namespace upipe
