#include "core/host_pool.hpp"

#include <algorithm>
#include <exception>
#include <utility>

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

void host_work_log::add(const char* kind, clock::time_point start, clock::time_point end) {
  std::lock_guard lock(mutex_);
  pieces_.push_back({kind, start, end});
}

namespace {

// The length of the union of intervals, in ms (sorts them).
template <class Piece>
double union_ms(std::vector<Piece>& pieces) {
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.start < b.start; });
  double ms = 0;
  auto begin = pieces.empty() ? host_work_log::clock::time_point{} : pieces.front().start, end = begin;
  for (const Piece& p : pieces) {
    if (p.start > end) {
      ms += std::chrono::duration<double, std::milli>(end - begin).count();
      begin = p.start;
    }
    end = std::max(end, p.end);
  }
  return ms + std::chrono::duration<double, std::milli>(end - begin).count();
}

}  // namespace

std::map<std::string, host_work_log::times> host_work_log::take() {
  std::vector<piece> all;
  {
    std::lock_guard lock(mutex_);
    all.swap(pieces_);
  }
  std::map<std::string, std::vector<piece>> by_kind;
  for (const piece& p : all) by_kind[p.kind].push_back(p);
  if (!all.empty()) by_kind["host"] = all;
  std::map<std::string, times> out;
  for (auto& [kind, pieces] : by_kind) {
    times& t = out[kind];
    t.pieces = static_cast<int>(pieces.size());
    for (const piece& p : pieces) t.cpu_ms += std::chrono::duration<double, std::milli>(p.end - p.start).count();
    t.busy_ms = union_ms(pieces);
  }
  return out;
}

}  // namespace upipe
