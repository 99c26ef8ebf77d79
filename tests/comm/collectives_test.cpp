// The threads communicator on cpu backends: every collective moves exactly the right
// values for groups of 1 to 4 ranks, many times over (to shake out races), reductions
// are bit-identical left folds in rank order, and the counters hold the analytic bytes.
// Meta backends run every collective without touching memory.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"

namespace upipe {
namespace {

constexpr int iterations = 200;

// One backend per rank; the vector of pointers is what run_threads takes.
struct backend_group {
  backend_group(int size, backend_kind kind) {
    const memory_limits limits{std::size_t{64} << 20, std::size_t{16} << 20};
    for (int r = 0; r < size; ++r) {
      owned.push_back(kind == backend_kind::meta ? make_meta_backend(limits) : make_cpu_backend(limits));
      ranks.push_back(owned.back().get());
    }
  }
  std::vector<std::unique_ptr<backend>> owned;
  std::vector<backend*> ranks;
};

tensor f32_buffer(backend& be, std::size_t count, const char* label) {
  return be.allocate(mem_tag::comm, dtype::f32, shape{static_cast<std::int64_t>(count)}, label);
}

// Unique per (iteration, source rank, chunk, element) and exact in f32 (below 2^24).
float tag_value(int iter, int src, int chunk, std::size_t i) {
  return static_cast<float>(iter * 10000 + src * 1000 + chunk * 100 + static_cast<int>(i));
}

// Values whose f32 sum depends on the order of addition, so a reordered sum shows up.
float rough_value(int iter, int rank, std::size_t i) {
  return 0.1f * static_cast<float>(rank + 1) + 1.37e-3f * static_cast<float>(i) + 3.1e3f * static_cast<float>(iter % 7) /
                                                                                    static_cast<float>(rank + 3);
}

// The reference sum: a left fold over ranks in rank order.
float rank_order_sum(int size, int iter, std::size_t i) {
  float sum = rough_value(iter, 0, i);
  for (int r = 1; r < size; ++r) sum += rough_value(iter, r, i);
  return sum;
}

bool same_bits(float a, float b) { return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b); }

void expect_no_wrong(const std::vector<long>& wrong) {
  for (std::size_t r = 0; r < wrong.size(); ++r) EXPECT_EQ(wrong[r], 0) << "wrong values on rank " << r;
}

class collectives : public ::testing::TestWithParam<int> {};

TEST_P(collectives, all_to_all_moves_chunk_j_of_rank_i_to_chunk_i_of_rank_j) {
  const int n = GetParam();
  backend_group group(n, backend_kind::cpu);
  constexpr std::size_t chunk = 37;  // odd, so chunks are not aligned to anything
  std::vector<long> wrong(static_cast<std::size_t>(n), 0);
  run_threads(group.ranks, [&](int rank, communicator& comm) {
    backend& be = *group.ranks[rank];
    tensor send = f32_buffer(be, chunk * n, "a2a_send"), recv = f32_buffer(be, chunk * n, "a2a_recv");
    for (int it = 0; it < iterations; ++it) {
      for (int j = 0; j < n; ++j)
        for (std::size_t i = 0; i < chunk; ++i) send.as<float>()[j * chunk + i] = tag_value(it, rank, j, i);
      comm.all_to_all(send.data(), recv.data(), chunk * sizeof(float), "a2a_q");
      for (int j = 0; j < n; ++j)
        for (std::size_t i = 0; i < chunk; ++i)
          if (recv.as<float>()[j * chunk + i] != tag_value(it, j, rank, i)) ++wrong[rank];
    }
  });
  expect_no_wrong(wrong);
}

TEST_P(collectives, all_reduce_sum_is_the_rank_order_sum_bit_for_bit) {
  const int n = GetParam();
  backend_group group(n, backend_kind::cpu);
  std::vector<long> wrong(static_cast<std::size_t>(n), 0);
  run_threads(group.ranks, [&](int rank, communicator& comm) {
    backend& be = *group.ranks[rank];
    // 3 is fewer elements than ranks at n = 4, so some ranks own an empty segment.
    for (std::size_t count : {std::size_t{1}, std::size_t{3}, std::size_t{1001}}) {
      tensor data = f32_buffer(be, count, "grad");
      for (int it = 0; it < iterations; ++it) {
        for (std::size_t i = 0; i < count; ++i) data.as<float>()[i] = rough_value(it, rank, i);
        comm.all_reduce_sum(data.as<float>(), count, "grad");
        for (std::size_t i = 0; i < count; ++i)
          if (!same_bits(data.as<float>()[i], rank_order_sum(n, it, i))) ++wrong[rank];
      }
    }
  });
  expect_no_wrong(wrong);
}

TEST_P(collectives, reduce_scatter_sum_gives_rank_r_the_sum_of_chunk_r) {
  const int n = GetParam();
  backend_group group(n, backend_kind::cpu);
  constexpr std::size_t chunk = 129;
  std::vector<long> wrong(static_cast<std::size_t>(n), 0);
  run_threads(group.ranks, [&](int rank, communicator& comm) {
    backend& be = *group.ranks[rank];
    tensor send = f32_buffer(be, chunk * n, "rs_send"), recv = f32_buffer(be, chunk, "rs_recv");
    for (int it = 0; it < iterations; ++it) {
      // Element i of chunk j carries index j * chunk + i, so chunks differ.
      for (std::size_t k = 0; k < chunk * n; ++k) send.as<float>()[k] = rough_value(it, rank, k);
      comm.reduce_scatter_sum(send.as<float>(), recv.as<float>(), chunk, "grad");
      for (std::size_t i = 0; i < chunk; ++i)
        if (!same_bits(recv.as<float>()[i], rank_order_sum(n, it, rank * chunk + i))) ++wrong[rank];
    }
  });
  expect_no_wrong(wrong);
}

TEST_P(collectives, all_gather_puts_rank_j_send_in_chunk_j_also_in_place) {
  const int n = GetParam();
  backend_group group(n, backend_kind::cpu);
  constexpr std::size_t chunk = 41;
  std::vector<long> wrong(static_cast<std::size_t>(n), 0);
  run_threads(group.ranks, [&](int rank, communicator& comm) {
    backend& be = *group.ranks[rank];
    tensor send = f32_buffer(be, chunk, "ag_send"), recv = f32_buffer(be, chunk * n, "ag_recv");
    for (int it = 0; it < iterations; ++it) {
      const bool in_place = it % 2 == 1;
      float* mine = in_place ? recv.as<float>() + rank * chunk : send.as<float>();
      for (std::size_t i = 0; i < chunk; ++i) mine[i] = tag_value(it, rank, 0, i);
      comm.all_gather(mine, recv.data(), chunk * sizeof(float), "params");
      for (int j = 0; j < n; ++j)
        for (std::size_t i = 0; i < chunk; ++i)
          if (recv.as<float>()[j * chunk + i] != tag_value(it, j, 0, i)) ++wrong[rank];
    }
  });
  expect_no_wrong(wrong);
}

// Every rank sends to dst_of(rank) and receives from src_of(rank), all at once; the
// message length changes with the iteration so a stale mailbox would show.
template <class dst_fn, class src_fn>
std::vector<long> exchange_many(int n, dst_fn dst_of, src_fn src_of) {
  backend_group group(n, backend_kind::cpu);
  constexpr std::size_t max_count = 80;
  std::vector<long> wrong(static_cast<std::size_t>(n), 0);
  run_threads(group.ranks, [&](int rank, communicator& comm) {
    backend& be = *group.ranks[rank];
    tensor send = f32_buffer(be, max_count, "kv_send"), recv = f32_buffer(be, max_count, "kv_recv");
    const int dst = dst_of(rank), src = src_of(rank);
    for (int it = 0; it < iterations; ++it) {
      const std::size_t count = 16 * (1 + it % 5);
      for (std::size_t i = 0; i < count; ++i) send.as<float>()[i] = tag_value(it, rank, 0, i);
      comm.send_recv(send.data(), count * sizeof(float), dst, recv.data(), count * sizeof(float), src, "ring_kv");
      for (std::size_t i = 0; i < count; ++i)
        if (recv.as<float>()[i] != tag_value(it, src, 0, i)) ++wrong[rank];
    }
  });
  return wrong;
}

TEST_P(collectives, send_recv_ring_forward_and_backward) {
  const int n = GetParam();
  expect_no_wrong(exchange_many(n, [n](int r) { return (r + 1) % n; }, [n](int r) { return (r + n - 1) % n; }));
  expect_no_wrong(exchange_many(n, [n](int r) { return (r + n - 1) % n; }, [n](int r) { return (r + 1) % n; }));
}

TEST_P(collectives, send_recv_pairwise_exchange) {
  const int n = GetParam();
  // Ranks pair up (0,1), (2,3); an odd rank out exchanges with itself.
  auto partner = [n](int r) { return (r ^ 1) < n ? (r ^ 1) : r; };
  expect_no_wrong(exchange_many(n, partner, partner));
}

TEST_P(collectives, send_recv_may_skip_either_direction) {
  const int n = GetParam();
  backend_group group(n, backend_kind::cpu);
  std::vector<long> wrong(static_cast<std::size_t>(n), 0);
  // A pipeline: rank 0 only sends, the last rank only receives.
  run_threads(group.ranks, [&](int rank, communicator& comm) {
    backend& be = *group.ranks[rank];
    tensor send = f32_buffer(be, 8, "send"), recv = f32_buffer(be, 8, "recv");
    for (int it = 0; it < iterations; ++it) {
      for (std::size_t i = 0; i < 8; ++i) send.as<float>()[i] = tag_value(it, rank, 0, i);
      const bool sends = rank + 1 < n, receives = rank > 0;
      comm.send_recv(sends ? send.data() : nullptr, sends ? 32 : 0, sends ? rank + 1 : -1,
                     receives ? recv.data() : nullptr, receives ? 32 : 0, receives ? rank - 1 : -1, "pipe");
      for (std::size_t i = 0; receives && i < 8; ++i)
        if (recv.as<float>()[i] != tag_value(it, rank - 1, 0, i)) ++wrong[rank];
    }
  });
  expect_no_wrong(wrong);
}

// One step of every collective, the same sizes on cpu and meta backends.
struct step_sizes {
  std::size_t chunk_bytes = 64;     // all_to_all and all_gather chunk
  std::size_t reduce_count = 100;   // all_reduce f32 count
  std::size_t scatter_count = 12;   // reduce_scatter f32 chunk
  std::size_t message_bytes = 256;  // send_recv each way
};

// Runs `steps` mixed steps on a group and returns each rank's counters.
std::vector<comm_counters> run_mixed_steps(backend_group& group, int steps, const step_sizes& s) {
  const int n = static_cast<int>(group.ranks.size());
  std::vector<comm_counters> counters(static_cast<std::size_t>(n));
  run_threads(group.ranks, [&](int rank, communicator& comm) {
    backend& be = *group.ranks[rank];
    const std::size_t chunk = s.chunk_bytes / sizeof(float);
    tensor a2a_send = f32_buffer(be, chunk * n, "a2a_send"), a2a_recv = f32_buffer(be, chunk * n, "a2a_recv");
    tensor grad = f32_buffer(be, s.reduce_count, "grad");
    tensor rs_send = f32_buffer(be, s.scatter_count * n, "rs_send"), rs_recv = f32_buffer(be, s.scatter_count, "rs");
    tensor ag_recv = f32_buffer(be, chunk * n, "ag_recv");
    tensor msg_send = f32_buffer(be, s.message_bytes / 4, "msg"), msg_recv = f32_buffer(be, s.message_bytes / 4, "msg");
    if (be.has_data()) {
      be.fill_bytes(a2a_send.data(), 0, a2a_send.bytes());
      be.fill_bytes(grad.data(), 0, grad.bytes());
      be.fill_bytes(rs_send.data(), 0, rs_send.bytes());
      be.fill_bytes(msg_send.data(), 0, msg_send.bytes());
    }
    for (int step = 0; step < steps; ++step) {
      comm.all_to_all(a2a_send.data(), a2a_recv.data(), s.chunk_bytes, "a2a_q");
      const std::vector<std::size_t> chunks(static_cast<std::size_t>(n), s.chunk_bytes);
      comm.all_to_all_v(a2a_send.data(), chunks, a2a_recv.data(), chunks, "a2a_v");
      comm.all_reduce_sum(grad.as<float>(), s.reduce_count, "grad");
      comm.reduce_scatter_sum(rs_send.as<float>(), rs_recv.as<float>(), s.scatter_count, "grad");
      comm.all_gather(a2a_send.data(), ag_recv.data(), s.chunk_bytes, "params");
      comm.send_recv(msg_send.data(), s.message_bytes, (rank + 1) % n, msg_recv.data(), s.message_bytes,
                     (rank + n - 1) % n, "ring_kv");
      comm.barrier();
    }
    counters[rank] = comm.counters();
  });
  return counters;
}

void expect_analytic_counters(const comm_counters& c, int n, int steps, const step_sizes& s) {
  const std::uint64_t k = static_cast<std::uint64_t>(steps);
  auto bytes = [&](collective col) { return c.bytes[static_cast<std::size_t>(col)]; };
  auto calls = [&](collective col) { return c.calls[static_cast<std::size_t>(col)]; };
  EXPECT_EQ(bytes(collective::all_to_all), k * s.chunk_bytes * n);
  EXPECT_EQ(bytes(collective::all_to_all_v), k * s.chunk_bytes * n);
  EXPECT_EQ(bytes(collective::all_reduce), k * s.reduce_count * 4);
  EXPECT_EQ(bytes(collective::reduce_scatter), k * s.scatter_count * 4 * n);
  EXPECT_EQ(bytes(collective::all_gather), k * s.chunk_bytes * n);
  EXPECT_EQ(bytes(collective::send), k * s.message_bytes);
  EXPECT_EQ(bytes(collective::recv), k * s.message_bytes);
  EXPECT_EQ(bytes(collective::barrier), 0u);
  for (std::size_t i = 0; i < collective_count; ++i) EXPECT_EQ(c.calls[i], k) << collective_name(collective(i));
  EXPECT_EQ(calls(collective::barrier), k);
  EXPECT_EQ(c.label_bytes("a2a_q"), k * s.chunk_bytes * n);
  EXPECT_EQ(c.label_bytes("grad"), k * (s.reduce_count * 4 + s.scatter_count * 4 * n));
  EXPECT_EQ(c.label_bytes("params"), k * s.chunk_bytes * n);
  EXPECT_EQ(c.label_bytes("ring_kv"), k * s.message_bytes);  // labels count sent bytes
  EXPECT_EQ(c.label_bytes("a2a_v"), k * s.chunk_bytes * n);
  EXPECT_EQ(c.bytes_by_label.size(), 5u);
}

TEST_P(collectives, counters_hold_the_analytic_bytes_per_collective_and_label) {
  const int n = GetParam();
  backend_group group(n, backend_kind::cpu);
  const step_sizes sizes;
  const auto counters = run_mixed_steps(group, iterations, sizes);
  for (int r = 0; r < n; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    expect_analytic_counters(counters[r], n, iterations, sizes);
  }
}

TEST_P(collectives, meta_backends_run_every_collective_without_touching_memory) {
  const int n = GetParam();
  backend_group group(n, backend_kind::meta);
  const step_sizes sizes;
  // Meta tensors have no data: any read or write through them would crash this test.
  const auto counters = run_mixed_steps(group, 20, sizes);
  for (int r = 0; r < n; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    expect_analytic_counters(counters[r], n, 20, sizes);
  }
}

TEST_P(collectives, reset_counters_starts_from_zero) {
  const int n = GetParam();
  backend_group group(n, backend_kind::cpu);
  std::vector<comm_counters> counters(static_cast<std::size_t>(n));
  run_threads(group.ranks, [&](int rank, communicator& comm) {
    EXPECT_EQ(comm.rank(), rank);
    EXPECT_EQ(comm.size(), n);
    comm.barrier();
    comm.reset_counters();
    comm.barrier();
    counters[rank] = comm.counters();
  });
  for (const auto& c : counters) {
    EXPECT_EQ(c.calls[static_cast<std::size_t>(collective::barrier)], 1u);
    EXPECT_TRUE(c.bytes_by_label.empty());
  }
}

INSTANTIATE_TEST_SUITE_P(group_sizes, collectives, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "ranks_" + std::to_string(info.param); });

}  // namespace
}  // namespace upipe
