// The host pool: a batch waits for every job it was given, for work held open until it
// is added (a device callback's), and reports a job's failure to the waiter.
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/host_pool.hpp"

namespace upipe {
namespace {

TEST(host_pool, a_batch_waits_for_all_its_jobs) {
  host_pool pool(3);
  std::vector<int> out(100, 0);
  host_batch batch(pool);
  for (int i = 0; i < 100; ++i) batch.add([&out, i] { out[i] = i * i; });
  batch.wait();
  for (int i = 0; i < 100; ++i) EXPECT_EQ(out[i], i * i);
  EXPECT_TRUE(batch.done());
}

TEST(host_pool, held_work_keeps_the_batch_waiting_until_added) {
  host_pool pool(2);
  host_batch batch(pool);
  std::atomic<int> ran{0};
  batch.hold();
  EXPECT_FALSE(batch.done());
  std::thread later([&] {  // as a device callback would, from another thread
    batch.add([&] { ++ran; });
    batch.unhold();
  });
  batch.wait();
  EXPECT_EQ(ran.load(), 1);
  later.join();
}

TEST(host_pool, a_failed_job_is_rethrown_to_the_waiter) {
  host_pool pool(2);
  host_batch batch(pool);
  std::atomic<int> ran{0};
  batch.add([] { throw std::runtime_error("piece 3 failed"); });
  for (int i = 0; i < 8; ++i) batch.add([&] { ++ran; });
  EXPECT_THROW(batch.wait(), std::runtime_error);
  EXPECT_EQ(ran.load(), 8);  // the other jobs still ran
  EXPECT_NO_THROW(batch.wait());  // reported once
}

}  // namespace
}  // namespace upipe
