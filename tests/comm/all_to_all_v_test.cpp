// all_to_all_v, expert parallelism's exchange of chunks of any size: on the threads
// communicator of 1 to 4 ranks, on the EP groups and expert replicas split_experts makes,
// on ZeRO's shard group of a D x C mesh and on a loopback, chunk j of rank i arrives as chunk
// i of rank j whatever its size (empty ones included), round after round; the counters hold
// the bytes each rank sent; and a receive sized otherwise than its sender's chunk is refused.
#include <gtest/gtest.h>

#include <functional>
#include <stdexcept>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "comm/replica_mesh.hpp"
#include "comm_support.hpp"

namespace upipe {
namespace {

using testing::at;
using testing::cpu_ranks;
using testing::floats;
using testing::value;

// Elements rank `src` sends rank `dst` (world ranks) in round `round`: 0 to 4, so that some
// chunks are empty and no two neighbours agree.
std::size_t count(int src, int dst, int round) { return static_cast<std::size_t>((3 * src + 2 * dst + round) % 5); }

// Rounds of all_to_all_v over `comm`, whose rank j is world rank world_of(j); the values
// name their source, destination and place. Returns the wrong values this rank received.
long exchange_rounds(communicator& comm, backend& be, const std::function<int(int)>& world_of, int rounds = 8) {
  const int n = comm.size(), me = world_of(comm.rank());
  long wrong = 0;
  for (int round = 0; round < rounds; ++round) {
    std::vector<std::size_t> send_bytes, recv_bytes;
    std::size_t sent = 0, received = 0;
    for (int j = 0; j < n; ++j) {
      send_bytes.push_back(count(me, world_of(j), round) * sizeof(float));
      recv_bytes.push_back(count(world_of(j), me, round) * sizeof(float));
      sent += count(me, world_of(j), round);
      received += count(world_of(j), me, round);
    }
    tensor send = floats(be, static_cast<std::int64_t>(sent) + 1), recv = floats(be, static_cast<std::int64_t>(received) + 1);
    std::size_t k = 0;
    for (int j = 0; j < n; ++j)
      for (std::size_t i = 0; i < count(me, world_of(j), round); ++i)
        at(send)[k++] = value(me, world_of(j), static_cast<int>(i) + round);
    comm.all_to_all_v(send.data(), send_bytes, recv.data(), recv_bytes, "a2av");
    k = 0;
    for (int j = 0; j < n; ++j)
      for (std::size_t i = 0; i < count(world_of(j), me, round); ++i)
        wrong += at(recv)[k++] != value(world_of(j), me, static_cast<int>(i) + round);
  }
  return wrong;
}

TEST(all_to_all_v, threads_move_each_chunk_whatever_its_size) {
  for (int n = 1; n <= 4; ++n) {
    cpu_ranks ranks(n);
    std::vector<long> wrong(static_cast<std::size_t>(n), 0);
    std::vector<comm_counters> counters(static_cast<std::size_t>(n));
    run_threads(ranks.ranks, [&](int rank, communicator& comm) {
      wrong[static_cast<std::size_t>(rank)] = exchange_rounds(comm, *ranks.ranks[rank], [](int r) { return r; });
      counters[static_cast<std::size_t>(rank)] = comm.counters();
    });
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(wrong[static_cast<std::size_t>(r)], 0) << n << " ranks, rank " << r;
      std::uint64_t sent = 0;
      for (int round = 0; round < 8; ++round)
        for (int j = 0; j < n; ++j) sent += count(r, j, round) * sizeof(float);
      const comm_counters& c = counters[static_cast<std::size_t>(r)];
      EXPECT_EQ(c.bytes[static_cast<std::size_t>(collective::all_to_all_v)], sent);
      EXPECT_EQ(c.calls[static_cast<std::size_t>(collective::all_to_all_v)], 8u);
      EXPECT_EQ(c.label_bytes("a2av"), sent);
    }
  }
}

TEST(all_to_all_v, expert_groups_and_their_replicas_exchange_inside_themselves) {
  for (const auto [world_size, ep] : {std::pair{4, 2}, std::pair{6, 3}, std::pair{8, 4}, std::pair{4, 4}}) {
    cpu_ranks ranks(world_size);
    std::vector<long> wrong(static_cast<std::size_t>(world_size), 0);
    run_threads(ranks.ranks, [&](int world, communicator& comm) {
      backend& be = *ranks.ranks[world];
      const expert_groups g = split_experts(comm, be, ep);
      long& bad = wrong[static_cast<std::size_t>(world)];
      bad += g.peers->size() != ep || g.peers->rank() != world % ep;
      bad += g.replicas->size() != world_size / ep || g.replicas->rank() != world / ep;
      const int group = world / ep, place = world % ep;
      bad += exchange_rounds(*g.peers, be, [&](int j) { return group * ep + j; });
      bad += exchange_rounds(*g.replicas, be, [&](int j) { return j * ep + place; });
    });
    for (int r = 0; r < world_size; ++r)
      EXPECT_EQ(wrong[static_cast<std::size_t>(r)], 0) << world_size << " ranks, E = " << ep << ", rank " << r;
  }
}

TEST(all_to_all_v, zero_shard_group_of_a_mesh_exchanges_by_shard_rank) {
  const int D = 2, C = 2;
  cpu_ranks ranks(D * C);
  std::vector<long> wrong(static_cast<std::size_t>(D * C), 0);
  run_threads(ranks.ranks, [&](int world, communicator& comm) {
    const replica_groups g = split_replicas(comm, *ranks.ranks[world], C);
    // Shard rank k = c D + d is world rank d C + c.
    wrong[static_cast<std::size_t>(world)] =
        exchange_rounds(*g.shards, *ranks.ranks[world], [&](int k) { return k % D * C + k / D; });
  });
  for (int r = 0; r < D * C; ++r) EXPECT_EQ(wrong[static_cast<std::size_t>(r)], 0) << "rank " << r;
}

TEST(all_to_all_v, a_loopback_receives_its_own_chunks) {
  auto be = make_cpu_backend({std::size_t{16} << 20, std::size_t{1} << 20});
  auto loop = make_loopback_communicator(*be, 3);
  tensor send = floats(*be, 6), recv = floats(*be, 6);
  for (int i = 0; i < 6; ++i) at(send)[i] = static_cast<float>(i + 1);
  const std::vector<std::size_t> sizes{1 * sizeof(float), 0, 5 * sizeof(float)};
  loop->all_to_all_v(send.data(), sizes, recv.data(), sizes, "a2av");
  for (int i = 0; i < 6; ++i) EXPECT_EQ(at(recv)[i], static_cast<float>(i + 1));
  EXPECT_EQ(loop->counters().label_bytes("a2av"), 6 * sizeof(float));
  const std::vector<std::size_t> other{2 * sizeof(float), 0, 4 * sizeof(float)};
  EXPECT_THROW(loop->all_to_all_v(send.data(), sizes, recv.data(), other, "a2av"), std::exception);
}

TEST(all_to_all_v, a_receive_sized_otherwise_than_the_chunk_sent_is_refused) {
  cpu_ranks ranks(2);
  EXPECT_THROW(run_threads(ranks.ranks,
                           [&](int rank, communicator& comm) {
                             tensor send = floats(*ranks.ranks[rank], 4), recv = floats(*ranks.ranks[rank], 4);
                             const std::vector<std::size_t> out{4, 4};
                             const std::vector<std::size_t> in{4, rank == 0 ? std::size_t{8} : std::size_t{4}};
                             comm.all_to_all_v(send.data(), out, recv.data(), in, "a2av");
                           }),
               std::exception);
}

}  // namespace
}  // namespace upipe
