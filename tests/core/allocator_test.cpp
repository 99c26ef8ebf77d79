#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "core/allocator.hpp"
#include "core/error.hpp"

namespace upipe {
namespace {

constexpr std::size_t g = arena_allocator::granularity;

TEST(arena_allocator, rounds_and_aligns) {
  arena_allocator a(64 * g);
  const auto x = a.allocate(1);
  const auto y = a.allocate(g + 1);
  ASSERT_TRUE(x && y);
  EXPECT_EQ(*x % g, 0u);
  EXPECT_EQ(*y % g, 0u);
  EXPECT_EQ(a.block_size(*x), g);
  EXPECT_EQ(a.block_size(*y), 2 * g);
  EXPECT_EQ(a.in_use(), 3 * g);
}

TEST(arena_allocator, best_fit_prefers_the_smallest_hole) {
  arena_allocator a(100 * g);
  auto b0 = a.allocate(4 * g), s0 = a.allocate(g), b1 = a.allocate(2 * g), s1 = a.allocate(g), rest = a.allocate(g);
  ASSERT_TRUE(b0 && s0 && b1 && s1 && rest);
  a.free(*b0);  // a 4g hole at 0
  a.free(*b1);  // a 2g hole
  const auto fit = a.allocate(2 * g);
  EXPECT_EQ(*fit, *b1);  // the 2g hole, not the first one
  const auto next = a.allocate(3 * g);
  EXPECT_EQ(*next, *b0);
}

TEST(arena_allocator, coalesces_neighbours) {
  arena_allocator a(8 * g);
  std::vector<std::size_t> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(*a.allocate(g));
  EXPECT_FALSE(a.allocate(g).has_value());
  for (int i : {1, 3, 2, 0, 6, 5, 7, 4}) a.free(blocks[i]);
  EXPECT_EQ(a.in_use(), 0u);
  EXPECT_EQ(a.largest_free(), 8 * g);
  EXPECT_EQ(*a.allocate(8 * g), 0u);
}

TEST(arena_allocator, refuses_what_does_not_fit_and_tracks_high_water) {
  arena_allocator a(10 * g);
  auto x = a.allocate(6 * g);
  EXPECT_FALSE(a.allocate(5 * g).has_value());
  EXPECT_EQ(a.high_water(), 6 * g);
  a.free(*x);
  EXPECT_EQ(a.high_water(), 6 * g);
  EXPECT_THROW(a.free(12345), internal_error);
}

TEST(arena_allocator, random_churn_keeps_invariants) {
  arena_allocator a(1 << 20);
  std::mt19937 rng(3);
  std::vector<std::pair<std::size_t, std::size_t>> live;  // offset, size
  for (int step = 0; step < 20000; ++step) {
    if (!live.empty() && (rng() % 2 == 0 || live.size() > 200)) {
      const std::size_t i = rng() % live.size();
      a.free(live[i].first);
      live.erase(live.begin() + static_cast<long>(i));
    } else if (auto off = a.allocate(1 + rng() % 20000)) {
      live.push_back({*off, a.block_size(*off)});
    }
    std::size_t used = 0;
    for (auto [o, s] : live) used += s;
    ASSERT_EQ(a.in_use(), used);
  }
  // No two live blocks overlap.
  std::sort(live.begin(), live.end());
  for (std::size_t i = 1; i < live.size(); ++i) ASSERT_LE(live[i - 1].first + live[i - 1].second, live[i].first);
  for (auto [o, s] : live) a.free(o);
  EXPECT_EQ(a.largest_free(), a.capacity());
}

}  // namespace
}  // namespace upipe
