#include "core/host_pool.hpp"

#include <algorithm>
#include <exception>

namespace upipe {

host_pool& host_pool::shared() {
  static host_pool pool(static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 64u)));
  return pool;
}

host_pool::host_pool(int threads) {
  for (int i = 0; i < std::max(threads, 1); ++i) workers_.emplace_back([this] { work(); });
}

host_pool::~host_pool() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  ready_.notify_all();
  for (auto& w : workers_) w.join();
}

void host_pool::submit(std::function<void()> job) {
  {
    std::lock_guard lock(mutex_);
    jobs_.push_back(std::move(job));
  }
  ready_.notify_one();
}

void host_pool::work() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock lock(mutex_);
      ready_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, and nothing left
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

host_batch::~host_batch() {
  std::unique_lock lock(mutex_);
  finished_.wait(lock, [&] { return pending_ == 0; });
}

void host_batch::add(std::function<void()> job) {
  {
    std::lock_guard lock(mutex_);
    ++pending_;
  }
  pool_.submit([this, job = std::move(job)] {
    std::exception_ptr error;
    try {
      job();
    } catch (...) {
      error = std::current_exception();
    }
    // Notified under the lock: once pending_ reads 0, the waiter may destroy this batch.
    std::lock_guard lock(mutex_);
    if (error && !error_) error_ = error;
    if (--pending_ == 0) finished_.notify_all();
  });
}

void host_batch::hold() {
  std::lock_guard lock(mutex_);
  ++pending_;
}

void host_batch::unhold() {
  std::lock_guard lock(mutex_);
  if (--pending_ == 0) finished_.notify_all();
}

bool host_batch::done() {
  std::lock_guard lock(mutex_);
  return pending_ == 0;
}

void host_batch::wait() {
  std::unique_lock lock(mutex_);
  finished_.wait(lock, [&] { return pending_ == 0; });
  if (error_) {
    std::exception_ptr error = error_;
    error_ = nullptr;
    std::rethrow_exception(error);
  }
}

}  // namespace upipe
