// Host threads for work beside the device's: the offloaded optimizer's gradient adds,
// norms and AdamW run here while the rank's own thread keeps issuing the step. One pool
// per process, a thread per core, shared by every rank of the process; jobs start in the
// order given and never wait on one another.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace upipe {

class host_pool {
 public:
  // The process's pool: min(cores, 64) threads, started on first use.
  static host_pool& shared();

  explicit host_pool(int threads);
  ~host_pool();
  host_pool(const host_pool&) = delete;
  host_pool& operator=(const host_pool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()); }
  void submit(std::function<void()> job);

 private:
  void work();

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

// A batch of jobs that someone waits for: add() jobs (each submitted to the pool at once),
// then wait() until all have run. A job that throws is caught; wait() rethrows the first.
class host_batch {
 public:
  explicit host_batch(host_pool& pool = host_pool::shared()) : pool_(pool) {}
  ~host_batch();  // waits
  host_batch(const host_batch&) = delete;
  host_batch& operator=(const host_batch&) = delete;

  void add(std::function<void()> job);
  // Work that will be added later (from a device callback): wait() waits through it as
  // if it were a job, until unhold().
  void hold();
  void unhold();
  bool done();
  void wait();

 private:
  host_pool& pool_;
  std::mutex mutex_;
  std::condition_variable finished_;
  std::size_t pending_ = 0;
  std::exception_ptr error_;
};

// The host's work timed for a step's phase table (the offloaded optimizer's pieces): each
// piece's start and end on the steady clock, by kind. Pieces run on many threads at once:
// a kind's busy time is the union of its pieces' intervals (the wall time the host spent
// on it), its cpu time their sum.
class host_work_log {
 public:
  using clock = std::chrono::steady_clock;
  void add(const char* kind, clock::time_point start, clock::time_point end);
  struct times {
    double busy_ms = 0, cpu_ms = 0;
    int pieces = 0;
  };
  // The pieces that ended since the last take, by kind, and all kinds together ("host").
  std::map<std::string, times> take();

 private:
  struct piece {
    const char* kind;
    clock::time_point start, end;
  };
  std::mutex mutex_;
  std::vector<piece> pieces_;
};

}  // namespace upipe
