// Failure in a thread group: when one rank throws, every rank blocked in a collective
// wakes with comm_aborted and run_threads rethrows the original exception, never hanging.
// Misuse (mismatched collectives or message sizes, bad peers) is an internal error.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "core/error.hpp"

namespace upipe {
namespace {

struct cpu_group {
  explicit cpu_group(int size) {
    for (int r = 0; r < size; ++r) {
      owned.push_back(make_cpu_backend(memory_limits{std::size_t{64} << 20, std::size_t{16} << 20}));
      ranks.push_back(owned.back().get());
    }
  }
  std::vector<std::unique_ptr<backend>> owned;
  std::vector<backend*> ranks;
};

// Runs body on its own thread and returns what it threw; a hang aborts the test program
// (a deadlocked group cannot be cancelled, and a hung test would stall the whole suite).
std::exception_ptr run_with_deadline(const std::function<void()>& body) {
  std::promise<std::exception_ptr> done;
  auto result = done.get_future();
  std::thread worker([&] {
    try {
      body();
      done.set_value(nullptr);
    } catch (...) {
      done.set_value(std::current_exception());
    }
  });
  if (result.wait_for(std::chrono::seconds(10)) == std::future_status::timeout) {
    std::fprintf(stderr, "run_threads hung for 10 s after a rank failed\n");
    std::abort();
  }
  worker.join();
  return result.get();
}

enum class blocked_in { all_to_all, all_reduce, all_gather, send_recv, barrier };

// One call of the collective under test, on buffers of `count` floats per chunk.
void call_once(blocked_in op, communicator& comm, std::vector<float>& send, std::vector<float>& recv,
               std::size_t count) {
  const int n = comm.size(), r = comm.rank();
  switch (op) {
    case blocked_in::all_to_all: comm.all_to_all(send.data(), recv.data(), count * 4, "a2a"); break;
    case blocked_in::all_reduce: comm.all_reduce_sum(send.data(), count * n, "grad"); break;
    case blocked_in::all_gather: comm.all_gather(send.data(), recv.data(), count * 4, "params"); break;
    case blocked_in::send_recv:
      comm.send_recv(send.data(), count * 4, (r + 1) % n, recv.data(), count * 4, (r + n - 1) % n, "ring");
      break;
    case blocked_in::barrier: comm.barrier(); break;
  }
}

struct abort_case {
  blocked_in op;
  int size;
  int failing_rank;
};

class rank_failure : public ::testing::TestWithParam<abort_case> {};

TEST_P(rank_failure, rethrows_the_original_exception_and_aborts_the_others) {
  const auto [op, n, failing] = GetParam();
  cpu_group group(n);
  std::atomic<int> aborted_ranks{0};
  std::atomic<bool> iterations_exhausted{false};
  const auto error = run_with_deadline([&] {
    run_threads(group.ranks, [&](int rank, communicator& comm) {
      constexpr std::size_t count = 16;
      std::vector<float> send(count * comm.size(), 1.0f), recv(count * comm.size());
      try {
        // The failing rank takes part in a few calls first, then fails mid-run.
        for (int it = 0; it < 100000; ++it) {
          if (rank == failing && it == 5) {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
            throw std::invalid_argument("rank failed on purpose");
          }
          call_once(op, comm, send, recv, count);
        }
        iterations_exhausted = true;
      } catch (const comm_aborted&) {
        ++aborted_ranks;
        throw;
      }
    });
  });
  ASSERT_TRUE(error != nullptr);
  try {
    std::rethrow_exception(error);
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "rank failed on purpose");
  } catch (const std::exception& e) {
    ADD_FAILURE() << "run_threads rethrew the wrong exception: " << e.what();
  }
  EXPECT_EQ(aborted_ranks.load(), n - 1);
  EXPECT_FALSE(iterations_exhausted.load());
}

std::vector<abort_case> abort_cases() {
  std::vector<abort_case> cases;
  for (auto op : {blocked_in::all_to_all, blocked_in::all_reduce, blocked_in::all_gather, blocked_in::send_recv,
                  blocked_in::barrier})
    for (int n : {2, 3, 4}) cases.push_back({op, n, n == 2 ? 0 : 1});
  return cases;
}

std::string case_name(const ::testing::TestParamInfo<abort_case>& info) {
  static const char* names[] = {"all_to_all", "all_reduce", "all_gather", "send_recv", "barrier"};
  return std::string(names[static_cast<int>(info.param.op)]) + "_ranks_" + std::to_string(info.param.size);
}

INSTANTIATE_TEST_SUITE_P(blocked_ranks, rank_failure, ::testing::ValuesIn(abort_cases()), case_name);

TEST(run_threads, rethrows_comm_aborted_when_that_is_all_there_is) {
  cpu_group group(3);
  const auto error = run_with_deadline([&] {
    run_threads(group.ranks, [&](int rank, communicator& comm) {
      if (rank == 0) throw comm_aborted("aborted by hand");
      comm.barrier();
    });
  });
  ASSERT_TRUE(error != nullptr);
  EXPECT_THROW(std::rethrow_exception(error), comm_aborted);
}

TEST(run_threads, prefers_a_real_failure_that_came_after_a_comm_aborted) {
  cpu_group group(2);
  const auto error = run_with_deadline([&] {
    run_threads(group.ranks, [&](int rank, communicator&) {
      if (rank == 0) throw comm_aborted("aborted by hand");
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      throw std::out_of_range("the real failure");
    });
  });
  ASSERT_TRUE(error != nullptr);
  EXPECT_THROW(std::rethrow_exception(error), std::out_of_range);
}

TEST(run_threads, returns_normally_when_no_rank_fails) {
  cpu_group group(4);
  std::atomic<int> ran{0};
  run_threads(group.ranks, [&](int, communicator& comm) {
    comm.barrier();
    ++ran;
  });
  EXPECT_EQ(ran.load(), 4);
}

TEST(run_threads, refuses_an_empty_group_and_a_null_backend) {
  std::vector<backend*> none;
  EXPECT_THROW(run_threads(none, [](int, communicator&) {}), internal_error);
  cpu_group group(1);
  std::vector<backend*> with_null{group.ranks[0], nullptr};
  EXPECT_THROW(run_threads(with_null, [](int, communicator&) {}), internal_error);
}

// Runs fn on a group of n and expects run_threads to throw internal_error without hanging.
void expect_internal_error(int n, const std::function<void(int, communicator&)>& fn) {
  cpu_group group(n);
  const auto error = run_with_deadline([&] { run_threads(group.ranks, fn); });
  ASSERT_TRUE(error != nullptr);
  EXPECT_THROW(std::rethrow_exception(error), internal_error);
}

TEST(misuse, different_collectives_on_different_ranks) {
  expect_internal_error(3, [](int rank, communicator& comm) {
    std::vector<float> send(12), recv(12);
    if (rank == 0)
      comm.all_gather(send.data(), recv.data(), 16, "x");
    else
      comm.all_to_all(send.data(), recv.data(), 16, "x");
  });
}

TEST(misuse, same_collective_with_different_sizes) {
  expect_internal_error(2, [](int rank, communicator& comm) {
    std::vector<float> send(16), recv(16);
    comm.all_to_all(send.data(), recv.data(), rank == 0 ? 16 : 32, "x");
  });
}

TEST(misuse, barrier_against_a_collective) {
  expect_internal_error(2, [](int rank, communicator& comm) {
    std::vector<float> data(8);
    if (rank == 0)
      comm.barrier();
    else
      comm.all_reduce_sum(data.data(), data.size(), "x");
  });
}

TEST(misuse, send_recv_with_mismatched_message_size) {
  expect_internal_error(2, [](int rank, communicator& comm) {
    std::vector<float> send(8), recv(8);
    comm.send_recv(send.data(), rank == 0 ? 16 : 32, 1 - rank, recv.data(), 32, 1 - rank, "x");
  });
}

TEST(misuse, send_recv_to_a_rank_outside_the_group) {
  expect_internal_error(2, [](int rank, communicator& comm) {
    std::vector<float> send(8), recv(8);
    comm.send_recv(send.data(), 32, rank + 2, recv.data(), 32, 1 - rank, "x");
  });
}

TEST(misuse, all_to_all_with_overlapping_buffers) {
  expect_internal_error(2, [](int, communicator& comm) {
    std::vector<float> buffer(16);
    comm.all_to_all(buffer.data(), buffer.data() + 2, 16, "x");
  });
}

}  // namespace
}  // namespace upipe
