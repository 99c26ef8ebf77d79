// The threads communicator: every rank a thread of one process. For a collective each
// rank posts its buffer pointers in a shared slot, all meet at a barrier, each rank pulls
// what it needs with its own backend, and all meet again so no sender reuses or frees
// its buffer while another rank still reads it. A rank that leaves a collective by
// exception aborts the group and first waits out the copies in flight, for the same reason.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "core/error.hpp"

namespace upipe {

namespace {

// `count` elements past base; stays nullptr on the meta backend, where buffers have no
// data and arithmetic on a null pointer would be undefined.
template <class T>
T* advance(T* base, std::size_t count) {
  return base == nullptr ? nullptr : base + count;
}
const std::byte* as_bytes(const void* p) { return static_cast<const std::byte*>(p); }
std::byte* as_bytes(void* p) { return static_cast<std::byte*>(p); }

bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  if (a == nullptr || b == nullptr || a_bytes == 0 || b_bytes == 0) return false;
  const auto pa = reinterpret_cast<std::uintptr_t>(a);
  const auto pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

// What one rank posted for the collective in flight.
struct posted_call {
  collective kind = collective::barrier;
  std::size_t size = 0;  // chunk bytes, or the f32 count of a reduction
  const void* send = nullptr;
  void* recv = nullptr;
  const std::size_t* send_offsets = nullptr;  // all_to_all_v: where each chunk of send begins (size() + 1)
};

// One direction of send_recv between an ordered pair of ranks.
struct mailbox {
  const void* data = nullptr;
  std::size_t bytes = 0;
  bool posted = false;
  bool consumed = false;
};

// The state the ranks of one group share. Every wait wakes on abort and throws
// comm_aborted, so a failed rank never leaves the others blocked.
class thread_group {
 public:
  explicit thread_group(int size)
      : size_(size), slots_(static_cast<std::size_t>(size)), mail_(static_cast<std::size_t>(size) * size) {}

  int size() const { return size_; }

  // Written by its rank before a barrier and read by the others after it; the barrier's
  // mutex orders the accesses, so the slots need no lock of their own.
  posted_call& slot(int rank) { return slots_[static_cast<std::size_t>(rank)]; }

  // Our own barrier rather than std::barrier, which cannot be aborted.
  // Ranks meet dozens of times a step on tiny tensors, so a waiter first yields its core
  // for a while (the last rank usually arrives within microseconds) before sleeping on
  // the condition variable; sleeping at once costs two context switches per meeting.
  void arrive_and_wait(int rank) {
    std::unique_lock lock(mutex_);
    throw_if_aborted(rank);
    const std::uint64_t generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      released_.store(generation_, std::memory_order_release);
      changed_.notify_all();
      return;
    }
    lock.unlock();
    for (int spin = 0; spin < 200 && released_.load(std::memory_order_acquire) == generation; ++spin)
      std::this_thread::yield();
    lock.lock();
    changed_.wait(lock, [&] { return aborted_ || generation_ != generation; });
    throw_if_aborted(rank);
  }

  // Records a rank's failure and wakes every rank blocked in the group.
  void fail(std::exception_ptr error) {
    std::lock_guard lock(mutex_);
    failures_.push_back(std::move(error));
    aborted_ = true;
    changed_.notify_all();
  }

  // A rank leaving a collective by exception aborts the group, then waits until no rank
  // is still copying, because the buffers it is about to release may be what they read.
  void abort_and_drain() {
    std::unique_lock lock(mutex_);
    aborted_ = true;
    changed_.notify_all();
    changed_.wait(lock, [&] { return readers_ == 0; });
  }

  // Brackets a rank's copies from or into other ranks' buffers; refuses to start once
  // the group is aborted, since the owners may already have released them.
  void begin_reading(int rank) {
    std::lock_guard lock(mutex_);
    throw_if_aborted(rank);
    ++readers_;
  }
  void end_reading() {
    std::lock_guard lock(mutex_);
    --readers_;
    changed_.notify_all();
  }

  std::vector<std::exception_ptr> failures() {
    std::lock_guard lock(mutex_);
    return failures_;
  }

  // Never blocks: the sender's previous message to dst was consumed before it returned.
  void post(int src, int dst, const void* data, std::size_t bytes) {
    std::lock_guard lock(mutex_);
    throw_if_aborted(src);
    mailbox& box = mail(src, dst);
    UPIPE_CHECK(!box.posted, "send_recv: mailbox " + std::to_string(src) + "->" + std::to_string(dst) + " busy");
    box = mailbox{data, bytes, true, false};
    changed_.notify_all();
  }

  mailbox wait_posted(int src, int dst) {
    std::unique_lock lock(mutex_);
    mailbox& box = mail(src, dst);
    changed_.wait(lock, [&] { return aborted_ || (box.posted && !box.consumed); });
    throw_if_aborted(dst);
    return box;
  }

  void mark_consumed(int src, int dst) {
    std::lock_guard lock(mutex_);
    mail(src, dst).consumed = true;
    changed_.notify_all();
  }

  // Returns once dst copied the message, and frees the mailbox for the next one.
  void wait_consumed(int src, int dst) {
    std::unique_lock lock(mutex_);
    mailbox& box = mail(src, dst);
    changed_.wait(lock, [&] { return aborted_ || box.consumed; });
    throw_if_aborted(src);
    box = mailbox{};
  }

 private:
  mailbox& mail(int src, int dst) { return mail_[static_cast<std::size_t>(src) * size_ + dst]; }

  void throw_if_aborted(int rank) const {
    if (aborted_)
      throw comm_aborted("rank " + std::to_string(rank) + ": communicator group aborted because another rank failed");
  }

  const int size_;
  std::vector<posted_call> slots_;  // (size)
  std::vector<mailbox> mail_;       // (size * size), index src * size + dst
  std::mutex mutex_;
  std::condition_variable changed_;
  int arrived_ = 0;
  int readers_ = 0;  // ranks inside a begin_reading / end_reading bracket
  std::uint64_t generation_ = 0;
  std::atomic<std::uint64_t> released_{0};  // generation_, readable without the lock
  bool aborted_ = false;
  std::vector<std::exception_ptr> failures_;  // in the order the ranks failed
};

// Holds a begin_reading / end_reading bracket for one scope.
class reading_scope {
 public:
  reading_scope(thread_group& group, int rank) : group_(group) { group_.begin_reading(rank); }
  ~reading_scope() { group_.end_reading(); }
  reading_scope(const reading_scope&) = delete;
  reading_scope& operator=(const reading_scope&) = delete;

 private:
  thread_group& group_;
};

class thread_communicator final : public communicator {
 public:
  thread_communicator(thread_group& group, int rank, backend& be) : group_(group), rank_(rank), be_(be) {}

  int rank() const override { return rank_; }
  int size() const override { return group_.size(); }

  void all_to_all(const void* send, void* recv, std::size_t chunk_bytes, std::string_view label) override {
    const std::size_t total = chunk_bytes * size();
    guarded([&] {
      UPIPE_CHECK(!overlaps(send, total, recv, total), "all_to_all: send and recv overlap");
      meet({collective::all_to_all, chunk_bytes, send, recv});
      {
        const reading_scope reading(group_, rank_);
        for (int j = 0; j < size(); ++j)
          be_.copy_bytes(advance(as_bytes(recv), j * chunk_bytes),
                         advance(as_bytes(group_.slot(j).send), rank_ * chunk_bytes), chunk_bytes);
        be_.synchronize();
      }
      group_.arrive_and_wait(rank_);
    });
    counters_.add(collective::all_to_all, total, label);
  }

  // Each rank pulls chunk rank_ of every rank's send, sized as that rank posted it.
  void all_to_all_v(const void* send, std::span<const std::size_t> send_bytes, void* recv,
                    std::span<const std::size_t> recv_bytes, std::string_view label) override {
    const std::vector<std::size_t> out = chunk_offsets(send_bytes, size()), in = chunk_offsets(recv_bytes, size());
    guarded([&] {
      UPIPE_CHECK(!overlaps(send, out.back(), recv, in.back()), "all_to_all_v: send and recv overlap");
      posted_call mine{collective::all_to_all_v, 0, send, recv};
      mine.send_offsets = out.data();
      meet(mine);
      {
        const reading_scope reading(group_, rank_);
        for (int j = 0; j < size(); ++j) {
          const std::size_t* theirs = group_.slot(j).send_offsets;
          const std::size_t bytes = theirs[rank_ + 1] - theirs[rank_];
          UPIPE_CHECK(bytes == recv_bytes[j], "all_to_all_v: rank " + std::to_string(rank_) + " expects " +
                                                  std::to_string(recv_bytes[j]) + " bytes from rank " +
                                                  std::to_string(j) + ", which sends " + std::to_string(bytes));
          if (bytes > 0) be_.copy_bytes(advance(as_bytes(recv), in[j]), advance(as_bytes(group_.slot(j).send), theirs[rank_]), bytes);
        }
        be_.synchronize();
      }
      group_.arrive_and_wait(rank_);
    });
    counters_.add(collective::all_to_all_v, out.back(), label);
  }

  void all_reduce_sum(float* data, std::size_t count, std::string_view label) override {
    guarded([&] {
      meet({collective::all_reduce, count, data, data});
      // Rank r sums segment r into rank 0's buffer in rank order, so every element is the
      // same left fold d0 + d1 + ... whichever rank owns it, run after run.
      const std::size_t begin = count * rank_ / size(), end = count * (rank_ + 1) / size();
      float* sum = static_cast<float*>(group_.slot(0).recv);
      {
        const reading_scope reading(group_, rank_);
        for (int j = 1; j < size(); ++j)
          be_.add_f32(advance(sum, begin), advance(static_cast<const float*>(group_.slot(j).send), begin),
                      end - begin);
        be_.synchronize();
      }
      group_.arrive_and_wait(rank_);
      if (rank_ != 0) {
        const reading_scope reading(group_, rank_);
        be_.copy_bytes(data, sum, count * sizeof(float));
        be_.synchronize();
      }
      group_.arrive_and_wait(rank_);
    });
    counters_.add(collective::all_reduce, count * sizeof(float), label);
  }

  void reduce_scatter_sum(const float* send, float* recv, std::size_t chunk_count, std::string_view label) override {
    const std::size_t chunk_bytes = chunk_count * sizeof(float);
    guarded([&] {
      UPIPE_CHECK(!overlaps(send, chunk_bytes * size(), recv, chunk_bytes),
                  "reduce_scatter_sum: send and recv overlap");
      meet({collective::reduce_scatter, chunk_count, send, recv});
      const std::size_t first = chunk_count * rank_;
      {
        const reading_scope reading(group_, rank_);
        be_.copy_bytes(recv, advance(static_cast<const float*>(group_.slot(0).send), first), chunk_bytes);
        for (int j = 1; j < size(); ++j)
          be_.add_f32(recv, advance(static_cast<const float*>(group_.slot(j).send), first), chunk_count);
        be_.synchronize();
      }
      group_.arrive_and_wait(rank_);
    });
    counters_.add(collective::reduce_scatter, chunk_bytes * size(), label);
  }

  void all_gather(const void* send, void* recv, std::size_t chunk_bytes, std::string_view label) override {
    guarded([&] {
      // In place (send is this rank's chunk of recv) is fine: no rank writes another's chunk.
      const bool in_place = send != nullptr && send == advance(as_bytes(recv), rank_ * chunk_bytes);
      UPIPE_CHECK(in_place || !overlaps(send, chunk_bytes, recv, chunk_bytes * size()),
                  "all_gather: send overlaps recv other than as this rank's chunk");
      meet({collective::all_gather, chunk_bytes, send, recv});
      {
        const reading_scope reading(group_, rank_);
        for (int j = 0; j < size(); ++j)
          be_.copy_bytes(advance(as_bytes(recv), j * chunk_bytes), group_.slot(j).send, chunk_bytes);
        be_.synchronize();
      }
      group_.arrive_and_wait(rank_);
    });
    counters_.add(collective::all_gather, chunk_bytes * size(), label);
  }

  void send_recv(const void* send, std::size_t send_bytes, int dst, void* recv, std::size_t recv_bytes, int src,
                 std::string_view label) override;

  void barrier() override {
    // Posting a slot lets a rank in barrier() and one in a collective see the mismatch.
    guarded([&] {
      meet({collective::barrier, 0, nullptr, nullptr});
      group_.arrive_and_wait(rank_);
    });
    counters_.add(collective::barrier, 0, "");
  }

 private:
  // Runs one collective; if it throws on this rank, the group is aborted (it cannot
  // continue with one rank gone) and drained before this rank's buffers are released.
  template <class body_fn>
  void guarded(const body_fn& body) {
    try {
      body();
    } catch (...) {
      group_.abort_and_drain();
      throw;
    }
  }

  // Posts this rank's call, waits for every rank, and checks they all called the same
  // collective with the same size (a mismatch would read past the others' buffers).
  void meet(const posted_call& mine) {
    be_.synchronize();  // the buffer must be complete before other ranks read it
    group_.slot(rank_) = mine;
    group_.arrive_and_wait(rank_);
    for (int j = 0; j < size(); ++j) {
      const posted_call& other = group_.slot(j);
      UPIPE_CHECK(other.kind == mine.kind && other.size == mine.size,
                  "rank " + std::to_string(rank_) + " called " + std::string(collective_name(mine.kind)) + " (size " +
                      std::to_string(mine.size) + ") while rank " + std::to_string(j) + " called " +
                      std::string(collective_name(other.kind)) + " (size " + std::to_string(other.size) + ")");
    }
  }

  void check_peer(int peer, const char* role) const {
    UPIPE_CHECK(peer >= 0 && peer < size(), "send_recv: " + std::string(role) + " rank " + std::to_string(peer) +
                                                " is outside the group of " + std::to_string(size()));
  }

  thread_group& group_;
  const int rank_;
  backend& be_;
};

// Posting first and waiting last means a rank blocks only on a peer that has already
// posted or will post without waiting on anyone, so a ring of calls cannot deadlock.
void thread_communicator::send_recv(const void* send, std::size_t send_bytes, int dst, void* recv,
                                    std::size_t recv_bytes, int src, std::string_view label) {
  guarded([&] {
    if (send_bytes > 0) check_peer(dst, "destination");
    if (recv_bytes > 0) check_peer(src, "source");
    if (send_bytes > 0) {
      be_.synchronize();
      group_.post(rank_, dst, send, send_bytes);
    }
    if (recv_bytes > 0) {
      const mailbox incoming = group_.wait_posted(src, rank_);
      UPIPE_CHECK(incoming.bytes == recv_bytes, "send_recv: rank " + std::to_string(rank_) + " expects " +
                                                    std::to_string(recv_bytes) + " bytes from rank " +
                                                    std::to_string(src) + ", which sends " +
                                                    std::to_string(incoming.bytes));
      {
        const reading_scope reading(group_, rank_);
        be_.copy_bytes(recv, incoming.data, recv_bytes);
        be_.synchronize();
      }
      group_.mark_consumed(src, rank_);
    }
    if (send_bytes > 0) group_.wait_consumed(rank_, dst);
  });
  if (send_bytes > 0) counters_.add(collective::send, send_bytes, label);
  if (recv_bytes > 0) counters_.add(collective::recv, recv_bytes, label);
}

bool is_comm_aborted(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const comm_aborted&) {
    return true;
  } catch (...) {
    return false;
  }
}

}  // namespace

// The failure that caused the abort is the first that is not comm_aborted.
void rethrow_first_failure(const std::vector<std::exception_ptr>& failures) {
  if (failures.empty()) return;
  for (const auto& error : failures)
    if (!is_comm_aborted(error)) std::rethrow_exception(error);
  std::rethrow_exception(failures.front());
}

void run_threads(std::span<backend* const> backends, const std::function<void(int rank, communicator& comm)>& fn) {
  UPIPE_CHECK(!backends.empty(), "run_threads needs at least one backend");
  const int size = static_cast<int>(backends.size());
  for (int r = 0; r < size; ++r)
    UPIPE_CHECK(backends[r] != nullptr, "run_threads: the backend of rank " + std::to_string(r) + " is null");
  thread_group group(size);
  std::vector<std::unique_ptr<thread_communicator>> comms;
  for (int r = 0; r < size; ++r) comms.push_back(std::make_unique<thread_communicator>(group, r, *backends[r]));

  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(size));
  try {
    for (int r = 0; r < size; ++r)
      threads.emplace_back([&group, &comms, &fn, r] {
        set_current_rank(r);
        try {
          fn(r, *comms[static_cast<std::size_t>(r)]);
        } catch (...) {
          group.fail(std::current_exception());
        }
      });
  } catch (...) {
    // A thread that could not start must not leave the started ones waiting for it.
    group.fail(std::current_exception());
  }
  for (auto& t : threads) t.join();
  rethrow_first_failure(group.failures());
}

}  // namespace upipe
