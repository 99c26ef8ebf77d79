// The loopback communicator (rank 0 of `size` alone: recv chunk j = send chunk j, counters
// as in a real group) and the counters themselves.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "core/error.hpp"

namespace upipe {
namespace {

const memory_limits test_limits{std::size_t{64} << 20, std::size_t{16} << 20};

tensor f32_buffer(backend& be, std::size_t count, const char* label) {
  return be.allocate(mem_tag::comm, dtype::f32, shape{static_cast<std::int64_t>(count)}, label);
}

void fill_ramp(const tensor& t, float first) {
  for (std::int64_t i = 0; i < t.numel(); ++i) t.as<float>()[i] = first + static_cast<float>(i);
}

std::uint64_t bytes_of(const communicator& comm, collective c) {
  return comm.counters().bytes[static_cast<std::size_t>(c)];
}
std::uint64_t calls_of(const communicator& comm, collective c) {
  return comm.counters().calls[static_cast<std::size_t>(c)];
}

TEST(collective_names, name_every_collective) {
  EXPECT_EQ(collective_name(collective::all_to_all), "all_to_all");
  EXPECT_EQ(collective_name(collective::all_reduce), "all_reduce");
  EXPECT_EQ(collective_name(collective::reduce_scatter), "reduce_scatter");
  EXPECT_EQ(collective_name(collective::all_gather), "all_gather");
  EXPECT_EQ(collective_name(collective::send), "send");
  EXPECT_EQ(collective_name(collective::recv), "recv");
  EXPECT_EQ(collective_name(collective::barrier), "barrier");
}

TEST(comm_counters_test, add_sums_bytes_and_calls_per_collective_and_label) {
  comm_counters c;
  c.add(collective::all_to_all, 100, "a2a_q");
  c.add(collective::all_to_all, 50, "a2a_k");
  c.add(collective::send, 7, "a2a_q");
  c.add(collective::barrier, 0, "");
  EXPECT_EQ(c.bytes[static_cast<std::size_t>(collective::all_to_all)], 150u);
  EXPECT_EQ(c.calls[static_cast<std::size_t>(collective::all_to_all)], 2u);
  EXPECT_EQ(c.bytes[static_cast<std::size_t>(collective::send)], 7u);
  EXPECT_EQ(c.calls[static_cast<std::size_t>(collective::barrier)], 1u);
  EXPECT_EQ(c.label_bytes("a2a_q"), 107u);
  EXPECT_EQ(c.label_bytes("a2a_k"), 50u);
  EXPECT_EQ(c.label_bytes("never_used"), 0u);
  EXPECT_EQ(c.bytes_by_label.size(), 2u);  // the unlabelled barrier has no row
}

class loopback : public ::testing::TestWithParam<int> {};

TEST_P(loopback, is_rank_0_of_size) {
  auto be = make_cpu_backend(test_limits);
  auto comm = make_loopback_communicator(*be, GetParam());
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), GetParam());
}

TEST_P(loopback, all_to_all_returns_each_chunk_to_its_place) {
  const int n = GetParam();
  auto be = make_cpu_backend(test_limits);
  auto comm = make_loopback_communicator(*be, n);
  constexpr std::size_t chunk = 13;
  tensor send = f32_buffer(*be, chunk * n, "send"), recv = f32_buffer(*be, chunk * n, "recv");
  fill_ramp(send, 1.0f);
  comm->all_to_all(send.data(), recv.data(), chunk * 4, "a2a_q");
  for (std::size_t k = 0; k < chunk * n; ++k) EXPECT_EQ(recv.as<float>()[k], send.as<float>()[k]);
  EXPECT_EQ(bytes_of(*comm, collective::all_to_all), chunk * 4 * n);
  EXPECT_EQ(comm->counters().label_bytes("a2a_q"), chunk * 4 * n);
}

TEST_P(loopback, all_reduce_sum_leaves_the_data_alone) {
  const int n = GetParam();
  auto be = make_cpu_backend(test_limits);
  auto comm = make_loopback_communicator(*be, n);
  tensor data = f32_buffer(*be, 10, "grad");
  fill_ramp(data, 0.5f);
  comm->all_reduce_sum(data.as<float>(), 10, "grad");
  for (int i = 0; i < 10; ++i) EXPECT_EQ(data.as<float>()[i], 0.5f + static_cast<float>(i));
  EXPECT_EQ(bytes_of(*comm, collective::all_reduce), 40u);
  EXPECT_EQ(comm->counters().label_bytes("grad"), 40u);
}

TEST_P(loopback, reduce_scatter_sum_copies_chunk_0) {
  const int n = GetParam();
  auto be = make_cpu_backend(test_limits);
  auto comm = make_loopback_communicator(*be, n);
  constexpr std::size_t chunk = 9;
  tensor send = f32_buffer(*be, chunk * n, "send"), recv = f32_buffer(*be, chunk, "recv");
  fill_ramp(send, 3.0f);
  comm->reduce_scatter_sum(send.as<float>(), recv.as<float>(), chunk, "grad");
  for (std::size_t i = 0; i < chunk; ++i) EXPECT_EQ(recv.as<float>()[i], send.as<float>()[i]);
  EXPECT_EQ(bytes_of(*comm, collective::reduce_scatter), chunk * 4 * n);
}

TEST_P(loopback, all_gather_writes_send_into_every_chunk) {
  const int n = GetParam();
  auto be = make_cpu_backend(test_limits);
  auto comm = make_loopback_communicator(*be, n);
  constexpr std::size_t chunk = 7;
  tensor send = f32_buffer(*be, chunk, "send"), recv = f32_buffer(*be, chunk * n, "recv");
  fill_ramp(send, -2.0f);
  comm->all_gather(send.data(), recv.data(), chunk * 4, "params");
  for (int j = 0; j < n; ++j)
    for (std::size_t i = 0; i < chunk; ++i) EXPECT_EQ(recv.as<float>()[j * chunk + i], send.as<float>()[i]);
  EXPECT_EQ(bytes_of(*comm, collective::all_gather), chunk * 4 * n);
}

TEST_P(loopback, send_recv_receives_its_own_message) {
  const int n = GetParam();
  auto be = make_cpu_backend(test_limits);
  auto comm = make_loopback_communicator(*be, n);
  tensor send = f32_buffer(*be, 6, "send"), recv = f32_buffer(*be, 6, "recv");
  fill_ramp(send, 11.0f);
  comm->send_recv(send.data(), 24, 1 % n, recv.data(), 24, n - 1, "ring_kv");
  for (int i = 0; i < 6; ++i) EXPECT_EQ(recv.as<float>()[i], 11.0f + static_cast<float>(i));
  EXPECT_EQ(bytes_of(*comm, collective::send), 24u);
  EXPECT_EQ(bytes_of(*comm, collective::recv), 24u);
  EXPECT_EQ(comm->counters().label_bytes("ring_kv"), 24u);  // labels count sent bytes
  EXPECT_THROW(comm->send_recv(send.data(), 24, 0, recv.data(), 20, 0, "ring_kv"), internal_error);
  EXPECT_THROW(comm->send_recv(send.data(), 24, n, recv.data(), 24, 0, "ring_kv"), internal_error);
}

TEST_P(loopback, barrier_counts_a_call_and_no_bytes) {
  auto be = make_cpu_backend(test_limits);
  auto comm = make_loopback_communicator(*be, GetParam());
  comm->barrier();
  comm->barrier();
  EXPECT_EQ(calls_of(*comm, collective::barrier), 2u);
  EXPECT_EQ(bytes_of(*comm, collective::barrier), 0u);
  comm->reset_counters();
  EXPECT_EQ(calls_of(*comm, collective::barrier), 0u);
}

TEST_P(loopback, meta_backend_moves_nothing_and_counts_everything) {
  const int n = GetParam();
  auto be = make_meta_backend(test_limits);
  auto comm = make_loopback_communicator(*be, n);
  tensor a = f32_buffer(*be, 16 * n, "a"), b = f32_buffer(*be, 16 * n, "b");
  ASSERT_EQ(a.data(), nullptr);
  comm->all_to_all(a.data(), b.data(), 64, "a2a_q");
  const std::vector<std::size_t> sent(static_cast<std::size_t>(n), 64), planned(static_cast<std::size_t>(n), 32);
  comm->all_to_all_v(a.data(), sent, b.data(), planned, "a2a_v");  // without data the sizes may differ
  comm->all_reduce_sum(a.as<float>(), 16, "grad");
  comm->reduce_scatter_sum(a.as<float>(), b.as<float>(), 16, "grad");
  comm->all_gather(a.data(), b.data(), 64, "params");
  comm->send_recv(a.data(), 64, 0, b.data(), 64, 0, "ring_kv");
  comm->barrier();
  EXPECT_EQ(bytes_of(*comm, collective::all_to_all), 64u * n);
  EXPECT_EQ(bytes_of(*comm, collective::all_to_all_v), 64u * n);
  EXPECT_EQ(comm->counters().label_bytes("grad"), 64u + 64u * n);
  EXPECT_EQ(bytes_of(*comm, collective::all_gather), 64u * n);
  EXPECT_EQ(comm->counters().label_bytes("ring_kv"), 64u);
  for (std::size_t i = 0; i < collective_count; ++i) EXPECT_EQ(comm->counters().calls[i], 1u);
}

TEST(loopback_size, must_be_positive) {
  auto be = make_cpu_backend(test_limits);
  EXPECT_THROW(make_loopback_communicator(*be, 0), internal_error);
}

INSTANTIATE_TEST_SUITE_P(group_sizes, loopback, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "size_" + std::to_string(info.param); });

}  // namespace
}  // namespace upipe
