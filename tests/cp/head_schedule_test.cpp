// The UPipe head schedule of docs/design.md section 4.
#include <gtest/gtest.h>

#include <set>

#include "cp/head_schedule.hpp"

namespace upipe {
namespace {

TEST(head_schedule, cycles_at_u_equal_c_follow_the_design) {
  // U = C, K >= C: cycle c holds kv head c*C + r on rank r, and stage t of the cycle gives
  // rank r query head (c*C + r)*G + t.
  const int H = 32, K = 8, C = 4, G = H / K;
  const head_schedule s(H, K, C, C);
  ASSERT_EQ(s.stages(), H / C);
  for (int r = 0; r < C; ++r)
    for (int stage = 0; stage < s.stages(); ++stage) {
      const int cycle = stage / G, t = stage % G;
      ASSERT_EQ(s.stage_heads(r, stage).size(), 1u);
      EXPECT_EQ(s.stage_heads(r, stage)[0], (cycle * C + r) * G + t);
    }
  for (int r = 0; r < C; ++r) {
    ASSERT_EQ(s.blocks(r).size(), static_cast<std::size_t>(K / C));
    for (int cycle = 0; cycle < K / C; ++cycle) {
      const kv_block& b = s.blocks(r)[cycle];
      EXPECT_EQ(b.kv_heads, std::vector<int>{cycle * C + r});
      EXPECT_EQ(b.first_stage, cycle * G);
      EXPECT_EQ(b.last_stage, cycle * G + G - 1);
    }
  }
  EXPECT_EQ(s.max_resident(), 1);
}

TEST(head_schedule, replicated_kv_heads_split_their_group) {
  // K < C: kv head r / R on rank r, which takes the (r mod R)-th slice of its group.
  const int H = 16, K = 2, C = 8, R = C / K, G = H / K;
  const head_schedule s(H, K, C, C);
  for (int r = 0; r < C; ++r) {
    const auto owned = s.owned(r);
    ASSERT_EQ(owned.size(), static_cast<std::size_t>(G / R));
    for (int q = 0; q < G / R; ++q) EXPECT_EQ(owned[q], (r / R) * G + (r % R) * (G / R) + q);
    ASSERT_EQ(s.blocks(r).size(), 1u);
    EXPECT_EQ(s.blocks(r)[0].kv_heads, std::vector<int>{r / R});
  }
}

// Over many shapes: every query head is computed exactly once, each rank's kv heads are
// resident over one contiguous range of stages that covers every use, and every rank
// receives the same number of kv heads at each stage.
TEST(head_schedule, every_head_once_and_kv_once_per_rank) {
  for (int H : {4, 8, 12, 16, 32, 64})
    for (int K : {1, 2, 3, 4, 8, 16})
      for (int C : {1, 2, 3, 4, 8}) {
        if (H % K || H % C || (K % C && C % K)) continue;
        for (int U = C; U <= H; U += C) {
          if (H % U) continue;
          const head_schedule s(H, K, C, U);
          std::multiset<int> seen;
          for (int r = 0; r < C; ++r) {
            std::set<int> kv_seen;
            for (const kv_block& b : s.blocks(r))
              for (int kv : b.kv_heads) EXPECT_TRUE(kv_seen.insert(kv).second) << "kv sent twice to a rank";
            for (int t = 0; t < s.stages(); ++t)
              for (int h : s.stage_heads(r, t)) {
                seen.insert(h);
                bool resident = false;
                for (const kv_block& b : s.blocks(r))
                  for (int kv : b.kv_heads)
                    resident |= kv == s.kv_of(h) && b.first_stage <= t && t <= b.last_stage;
                EXPECT_TRUE(resident) << "H" << H << " K" << K << " C" << C << " U" << U;
              }
          }
          ASSERT_EQ(seen.size(), static_cast<std::size_t>(H));
          for (int h = 0; h < H; ++h) EXPECT_EQ(seen.count(h), 1u);
        }
      }
}

TEST(head_schedule, consecutive_runs_group_neighbours) {
  const std::vector<int> heads = {4, 5, 6, 9, 2, 3};
  const auto runs = consecutive_runs(heads);
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs[0].first, 4);
  EXPECT_EQ(runs[0].count, 3);
  EXPECT_EQ(runs[1].first, 9);
  EXPECT_EQ(runs[1].slot, 3);
  EXPECT_EQ(runs[2].first, 2);
  EXPECT_EQ(runs[2].slot, 4);
  EXPECT_EQ(runs[2].count, 2);
}

}  // namespace
}  // namespace upipe
