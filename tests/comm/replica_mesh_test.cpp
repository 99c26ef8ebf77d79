// The groups of a D x C data-parallel mesh on the threads communicator: each rank's CP
// group is its replica's C consecutive ranks, the groups exchange at once while the world
// sums over everyone between their collectives, hybrid's split nests inside a group, and
// ZeRO's shard group numbers the ranks CP-major and reduces over the CP group first, then
// across the replicas in replica order (the order one rank adds its micro-batches in).
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "comm/replica_mesh.hpp"
#include "comm/subgroup.hpp"
#include "core/error.hpp"
#include "comm_support.hpp"

namespace upipe {
namespace {

using cpu_mesh = testing::cpu_ranks;
using testing::at;
using testing::floats;
using testing::value;

const std::pair<int, int> meshes[] = {{2, 2}, {3, 2}, {2, 4}, {4, 1}, {2, 3}};  // (D, C)

TEST(replica_mesh, each_replica_talks_inside_its_own_cp_group) {
  for (const auto [D, C] : meshes) {
    constexpr int n = 2;
    cpu_mesh mesh(D * C);
    std::vector<long> wrong(static_cast<std::size_t>(D * C), 0);
    run_threads(mesh.ranks, [&](int world, communicator& comm) {
      backend& be = *mesh.ranks[static_cast<std::size_t>(world)];
      const replica_groups groups = split_replicas(comm, be, C);
      communicator& cp = *groups.cp;
      long& bad = wrong[static_cast<std::size_t>(world)];
      bad += cp.size() != C || cp.rank() != world % C;
      const int first = world / C * C;
      for (int round = 0; round < 5; ++round) {
        tensor send = floats(be, C * n), recv = floats(be, C * n);
        for (int j = 0; j < C; ++j)
          for (int i = 0; i < n; ++i) at(send)[j * n + i] = value(world, j, i);
        cp.all_to_all(send.data(), recv.data(), n * sizeof(float), "a2a");
        for (int j = 0; j < C; ++j)
          for (int i = 0; i < n; ++i) bad += at(recv)[j * n + i] != value(first + j, world % C, i);
        // The world's sum over every replica between the groups' own collectives.
        bad += sum_over_ranks(comm, world, "world") != (D * C) * (D * C - 1) / 2.0;
      }
      if (C % 2 == 0) {  // hybrid's 2 x C/2 split of a replica's group
        const mesh_groups m = split_mesh(cp, be, 2);
        bad += m.all_to_all->size() != C / 2 || m.ring->size() != 2;
        bad += sum_over_ranks(*m.ring, world, "ring") != 2.0 * first + C / 2 + 2.0 * (world % (C / 2));
      }
    });
    for (int r = 0; r < D * C; ++r) EXPECT_EQ(wrong[static_cast<std::size_t>(r)], 0) << D << "x" << C << " rank " << r;
  }
}

TEST(replica_mesh, zero_shards_span_every_rank_cp_major_reduced_in_two_levels) {
  for (const auto [D, C] : meshes) {
    if (C == 1) continue;  // the world shards itself
    const int W = D * C;
    constexpr int n = 3;
    cpu_mesh mesh(W);
    std::vector<long> wrong(static_cast<std::size_t>(W), 0);
    run_threads(mesh.ranks, [&](int world, communicator& comm) {
      backend& be = *mesh.ranks[static_cast<std::size_t>(world)];
      const replica_groups groups = split_replicas(comm, be, C);
      communicator& shards = *groups.shards;
      long& bad = wrong[static_cast<std::size_t>(world)];
      const int d = world / C, c = world % C, me = c * D + d;
      bad += shards.rank() != me || shards.size() != W;
      // Values whose float sum depends on the order: the reduce-scatter must add the CP
      // group's first, then the replicas' sums in replica order.
      const auto grad = [](int w, int k, int i) { return (w % 2 ? 1e-8f : 1.0f) * static_cast<float>(1 + w + k + i); };
      tensor send = floats(be, W * n), got = floats(be, n);
      for (int k = 0; k < W; ++k)
        for (int i = 0; i < n; ++i) at(send)[k * n + i] = grad(world, k, i);
      shards.reduce_scatter_sum(at(send), at(got), n, "rs");
      for (int i = 0; i < n; ++i) {
        float total = 0;
        for (int r = 0; r < D; ++r) {
          float replica = grad(r * C, me, i);
          for (int j = 1; j < C; ++j) replica += grad(r * C + j, me, i);
          total = r == 0 ? replica : total + replica;
        }
        bad += at(got)[i] != total;
      }
      // The all-gather puts shard rank k's chunk at k, in place as ZeRO-3 gathers.
      tensor all = floats(be, W * n);
      for (int i = 0; i < n; ++i) at(all)[me * n + i] = value(world, 0, i);
      shards.all_gather(at(all) + me * n, at(all), n * sizeof(float), "ag");
      for (int k = 0; k < W; ++k)
        for (int i = 0; i < n; ++i) bad += at(all)[k * n + i] != value(k % D * C + k / D, 0, i);
      // Point-to-point and all-to-all by shard rank.
      tensor a2a = floats(be, W * n);
      for (int k = 0; k < W; ++k)
        for (int i = 0; i < n; ++i) at(send)[k * n + i] = value(me, k, i);
      shards.all_to_all(at(send), at(a2a), n * sizeof(float), "a2a");
      for (int k = 0; k < W; ++k)
        for (int i = 0; i < n; ++i) bad += at(a2a)[k * n + i] != value(k, me, i);
      EXPECT_EQ(shards.counters().label_bytes("rs"), W * n * sizeof(float));
    });
    for (int r = 0; r < W; ++r) EXPECT_EQ(wrong[static_cast<std::size_t>(r)], 0) << D << "x" << C << " rank " << r;
  }
}

TEST(replica_mesh, one_replica_is_the_world_and_loopbacks_split_into_loopbacks) {
  auto be = make_meta_backend({std::size_t{1} << 20, std::size_t{1} << 20});
  auto world = make_loopback_communicator(*be, 8);
  const replica_groups whole = split_replicas(*world, *be, 8);
  EXPECT_EQ(whole.cp, nullptr);
  EXPECT_EQ(whole.shards, nullptr);
  const replica_groups g = split_replicas(*world, *be, 2);
  EXPECT_TRUE(g.cp->is_loopback());
  EXPECT_EQ(g.cp->size(), 2);
  EXPECT_TRUE(g.shards->is_loopback());
  EXPECT_EQ(g.shards->size(), 8);
  EXPECT_EQ(split_replicas(*world, *be, 1).shards, nullptr);  // C = 1: the world shards itself
  EXPECT_THROW(split_replicas(*world, *be, 3), config_error);
}

}  // namespace
}  // namespace upipe
