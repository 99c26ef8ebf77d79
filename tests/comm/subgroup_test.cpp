// Sub-groups of a threads group (a 2-D mesh's all-to-all groups and rings): each
// collective moves exactly the right values between the members, by their parent ranks,
// while the other sub-groups run theirs at once; counters count each group's own traffic.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "comm/subgroup.hpp"
#include "core/error.hpp"
#include "comm_support.hpp"

namespace upipe {
namespace {

using cpu_group = testing::cpu_ranks;
using testing::at;
using testing::floats;
using testing::value;

class mesh : public ::testing::TestWithParam<std::pair<int, int>> {};  // (C, R)

TEST_P(mesh, every_collective_moves_the_members_values) {
  const auto [C, R] = GetParam();
  const int A = C / R;
  constexpr int n = 3;
  cpu_group group(C);
  std::vector<long> wrong(static_cast<std::size_t>(C), 0);
  run_threads(group.ranks, [&](int world, communicator& comm) {
    backend& be = *group.ranks[static_cast<std::size_t>(world)];
    mesh_groups m = split_mesh(comm, be, R);
    ASSERT_EQ(m.all_to_all->size(), A);
    ASSERT_EQ(m.ring->size(), R);
    EXPECT_EQ(m.all_to_all->rank(), world % A);
    EXPECT_EQ(m.ring->rank(), world / A);
    // The parent rank of member j of each group.
    const auto group_member = [&](int j) { return world / A * A + j; };
    const auto ring_member = [&](int j) { return j * A + world % A; };
    long& bad = wrong[static_cast<std::size_t>(world)];
    for (int round = 0; round < 20; ++round)
      for (communicator* sub : {m.all_to_all.get(), m.ring.get()}) {
        const int size = sub->size(), me = sub->rank();
        const auto member = [&](int j) { return sub == m.all_to_all.get() ? group_member(j) : ring_member(j); };
        tensor send = floats(be, size * n), recv = floats(be, size * n);
        for (int j = 0; j < size; ++j)
          for (int i = 0; i < n; ++i) at(send)[j * n + i] = value(world, j, i);
        sub->all_to_all(send.data(), recv.data(), n * sizeof(float), "a2a");
        for (int j = 0; j < size; ++j)
          for (int i = 0; i < n; ++i) bad += at(recv)[j * n + i] != value(member(j), me, i);
        sub->all_gather(send.data(), recv.data(), n * sizeof(float), "gather");
        for (int j = 0; j < size; ++j)
          for (int i = 0; i < n; ++i) bad += at(recv)[j * n + i] != value(member(j), 0, i);
        tensor one = floats(be, n);
        for (int i = 0; i < n; ++i) at(one)[i] = value(world, 0, i);
        sub->all_reduce_sum(at(one), n, "sum");
        for (int i = 0; i < n; ++i) {
          float want = 0;
          for (int j = 0; j < size; ++j) want += value(member(j), 0, i);
          bad += at(one)[i] != want;
        }
        sub->reduce_scatter_sum(at(send), at(one), n, "scatter");
        for (int i = 0; i < n; ++i) {
          float want = 0;
          for (int j = 0; j < size; ++j) want += value(member(j), me, i);
          bad += at(one)[i] != want;
        }
        sub->send_recv(at(send), n * sizeof(float), (me + 1) % size, at(recv), n * sizeof(float),
                       (me - 1 + size) % size, "ring");
        for (int i = 0; i < n; ++i) bad += at(recv)[i] != value(member((me - 1 + size) % size), 0, i);
      }
    const std::uint64_t chunk = n * sizeof(float);
    EXPECT_EQ(m.all_to_all->counters().label_bytes("a2a"), 20 * A * chunk);
    EXPECT_EQ(m.ring->counters().label_bytes("ring"), 20 * chunk);
  });
  for (int r = 0; r < C; ++r) EXPECT_EQ(wrong[static_cast<std::size_t>(r)], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(sizes, mesh,
                         ::testing::Values(std::pair{2, 1}, std::pair{2, 2}, std::pair{4, 2}, std::pair{6, 3},
                                           std::pair{6, 2}, std::pair{8, 4}, std::pair{8, 2}),
                         [](const auto& info) {
                           return "C" + std::to_string(info.param.first) + "_R" + std::to_string(info.param.second);
                         });

TEST(mesh_split, a_ring_that_does_not_divide_the_group_is_refused) {
  cpu_group group(4);
  EXPECT_THROW(run_threads(group.ranks, [&](int rank, communicator& comm) {
                 split_mesh(comm, *group.ranks[static_cast<std::size_t>(rank)], 3);
               }),
               config_error);
}

TEST(mesh_split, a_loopback_splits_into_loopbacks) {
  auto be = make_meta_backend({std::size_t{1} << 20, std::size_t{1} << 20});
  auto world = make_loopback_communicator(*be, 8);
  const mesh_groups m = split_mesh(*world, *be, 2);
  EXPECT_TRUE(m.all_to_all->is_loopback());
  EXPECT_EQ(m.all_to_all->size(), 4);
  EXPECT_EQ(m.ring->size(), 2);
}

}  // namespace
}  // namespace upipe
