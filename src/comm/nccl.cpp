// The NCCL communicator (see nccl.hpp). Every collective runs on the rank's collectives
// stream, one after another in the order they were issued (NCCL gives no order between
// operations of one communicator on different streams), joined to the compute stream by
// events: it starts after the compute work issued before it, and the compute work issued
// after it waits for it unless it was started in flight (all_to_all_start,
// all_gather_start) and not yet waited for. The host never waits; a buffer in host memory
// (a loss being summed) goes through a device staging buffer. Events mark where each
// collective can start (the compute it waits for is done) and where it ends; the rank's
// watchdog thread times the oldest unfinished one from its start, so that a collective
// queued behind minutes of attention is not taken for a hang, and past the timeout aborts
// the whole group (every communicator of this process; the other processes' watchdogs see
// the same hang), naming the rank, the collective, its label and the layer.
//
// NCCL forbids aborting a communicator while another thread is inside a call on it, and a
// blocking communicator's call can wait indefinitely (for a peer, or for room in CUDA's
// launch queue behind a hung kernel). So the communicators are non-blocking (every call
// returns at once; ncclInProgress while NCCL finishes it, polled without holding
// anything), every call on one is made under its lock, the watchdog aborts it under the
// same lock, and a rank keeps at most max_in_flight collectives queued, so that no launch
// can block inside a call.
#ifdef UPIPE_HAVE_CUDA

#include "comm/nccl.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <dlfcn.h>
#include <unistd.h>

#include "core/error.hpp"

namespace upipe {

namespace {

std::string nccl_message(ncclResult_t status, const std::string& last_error = "") {
  std::string text = ncclGetErrorString(status);
  if (!last_error.empty()) text += " (" + last_error + ")";
  return text;
}

using clock_type = std::chrono::steady_clock;

// Collectives a rank keeps queued on its collectives' stream at most (each is a few CUDA
// commands; CUDA's launch queue holds about a thousand).
constexpr std::size_t max_in_flight = 128;

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

// One communicator of a group: NCCL calls on it run under its lock and the abort takes the
// same lock, so an abort never overlaps a call (see the top of the file).
class guarded_comm {
 public:
  explicit guarded_comm(ncclComm_t comm) : comm_(comm) {}

  // `call(comm)` under the lock; ncclInvalidUsage once the communicator was aborted.
  template <class call_fn>
  ncclResult_t issue(const call_fn& call) {
    std::lock_guard lock(mutex_);
    return comm_ == nullptr ? ncclInvalidUsage : call(comm_);
  }
  // Where a non-blocking call stands: ncclInProgress, ncclSuccess or its error.
  ncclResult_t state() {
    return issue([](ncclComm_t c) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t got = ncclCommGetAsyncError(c, &state);
      return got == ncclSuccess ? state : got;
    });
  }
  std::string last_error() {
    std::lock_guard lock(mutex_);
    const char* text = comm_ != nullptr ? ncclGetLastError(comm_) : nullptr;
    return text != nullptr ? text : "";
  }
  void abort() {
    std::lock_guard lock(mutex_);
    if (comm_ != nullptr) (void)ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  // Finalizes (waiting at most `timeout` for what is still in flight) and destroys; a
  // communicator that does not finalize in time is aborted instead.
  void destroy(std::chrono::duration<double> timeout) {
    std::lock_guard lock(mutex_);
    if (comm_ == nullptr) return;
    ncclResult_t state = ncclCommFinalize(comm_);
    const auto until = clock_type::now() + timeout;
    while (state == ncclInProgress && clock_type::now() < until) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
    }
    (void)(state == ncclSuccess ? ncclCommDestroy(comm_) : ncclCommAbort(comm_));
    comm_ = nullptr;
  }

 private:
  std::mutex mutex_;
  ncclComm_t comm_;
};

// Waits for a non-blocking communicator's setup to finish (every rank joined), at most
// `timeout`; aborts it and throws past that.
void wait_until_ready(ncclComm_t comm, double timeout_s, const std::string& what) {
  ncclResult_t state = ncclInProgress;
  const auto until = clock_type::now() + std::chrono::duration<double>(timeout_s);
  while (state == ncclInProgress) {
    if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) state = ncclSystemError;
    if (state != ncclInProgress) break;
    if (clock_type::now() > until) {
      (void)ncclCommAbort(comm);
      throw std::runtime_error(what + " did not complete within " + std::to_string(static_cast<long long>(timeout_s)) +
                               " s (a rank did not start); raise --comm-timeout if the setup legitimately takes longer");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (state != ncclSuccess) {
    (void)ncclCommAbort(comm);
    throw std::runtime_error(what + " failed: " + nccl_message(state));
  }
}

void check_cuda(cudaError_t status, const std::string& what) {
  if (status != cudaSuccess) throw std::runtime_error(what + ": " + cudaGetErrorString(status));
}

// Where a collective was called from, for messages.
std::string place(int rank, collective c, std::string_view label) {
  std::string text = "rank " + std::to_string(rank) + ": " + std::string(collective_name(c));
  if (!label.empty()) text += " '" + std::string(label) + "'";
  const int layer = current_layer();
  text += layer >= 0 ? " in layer " + std::to_string(layer) : " outside the layers";
  return text;
}

// An event recorded on a stream at construction, destroyed with the last holder.
struct completion {
  cudaEvent_t event = nullptr;
  explicit completion(cudaStream_t stream) {
    check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    const cudaError_t recorded = cudaEventRecord(event, stream);
    if (recorded != cudaSuccess) (void)cudaEventDestroy(event);
    check_cuda(recorded, "cudaEventRecord");
  }
  ~completion() { (void)cudaEventDestroy(event); }
  completion(const completion&) = delete;
  completion& operator=(const completion&) = delete;
};

// The communicators of one group in this process, aborted together.
class nccl_group {
 public:
  guarded_comm& add(ncclComm_t comm) {
    std::lock_guard lock(mutex_);
    comms_.push_back(std::make_unique<guarded_comm>(comm));
    return *comms_.back();
  }
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  std::string reason() const {
    std::lock_guard lock(mutex_);
    return reason_;
  }
  // The first reason wins; every communicator is aborted once, which also ends any
  // collective kernel still waiting for a peer.
  void abort(const std::string& reason) {
    std::lock_guard lock(mutex_);
    if (aborted_.load(std::memory_order_relaxed)) return;
    reason_ = reason;
    aborted_.store(true, std::memory_order_release);
    std::fprintf(stderr, "upipe: aborting the NCCL group: %s\n", reason.c_str());
    for (auto& c : comms_) c->abort();  // each waits for a call in progress on it, which never blocks
  }
  // Destroys what abort() did not already release.
  void destroy_all(double timeout_s) {
    std::lock_guard lock(mutex_);
    for (auto& c : comms_) c->destroy(std::chrono::duration<double>(timeout_s));
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<guarded_comm>> comms_;  // stable addresses: communicators hold them
  std::atomic<bool> aborted_{false};
  std::string reason_;
};

// Watches one rank's collectives: each is an event recorded after it on the stream.
class watchdog {
 public:
  watchdog(int device, double timeout_s, nccl_group& group)
      : device_(device), timeout_(std::chrono::duration<double>(timeout_s)), group_(group),
        thread_([this] { loop(); }) {}
  ~watchdog() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;

  // `started` was recorded before the collective and `done` after it; the watchdog keeps
  // them until it completes.
  void watch(std::shared_ptr<const completion> started, std::shared_ptr<const completion> done, std::string what) {
    std::lock_guard lock(mutex_);
    pending_.push_back({std::move(started), std::move(done), std::move(what), std::nullopt});
  }

 private:
  struct pending {
    std::shared_ptr<const completion> started, done;
    std::string what;
    std::optional<clock_type::time_point> running_since;  // when `started` was first seen complete
  };

  void loop() {
    (void)cudaSetDevice(device_);
    std::unique_lock lock(mutex_);
    while (!stop_) {
      wake_.wait_for(lock, std::chrono::milliseconds(50));
      while (!pending_.empty()) {
        if (cudaEventQuery(pending_.front().done->event) == cudaErrorNotReady) break;
        pending_.pop_front();
      }
      if (pending_.empty() || group_.aborted()) continue;
      pending& oldest = pending_.front();
      // Not yet startable (its inputs are still being computed): nothing to time.
      if (cudaEventQuery(oldest.started->event) == cudaErrorNotReady) continue;
      if (!oldest.running_since) oldest.running_since = clock_type::now();
      if (clock_type::now() - *oldest.running_since < timeout_) continue;
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%g", timeout_.count());
      const std::string reason = oldest.what + " did not complete within " + seconds +
                                 " s (a rank failed, stopped or called another collective); raise --comm-timeout "
                                 "if a step legitimately takes longer";
      lock.unlock();
      group_.abort(reason);
      lock.lock();
    }
  }

  const int device_;
  const std::chrono::duration<double> timeout_;
  nccl_group& group_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<pending> pending_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the rest is built
};

class nccl_communicator final : public communicator {
 public:
  nccl_communicator(backend& be, guarded_comm& comm, int rank, int size, nccl_group& group, double timeout_s)
      : be_(be), comm_(comm), rank_(rank), size_(size), group_(group), timeout_s_(timeout_s),
        stream_(static_cast<cudaStream_t>(be.native_stream())), dog_(be.device_index(), timeout_s, group) {
    UPIPE_CHECK(stream_ != nullptr, "the NCCL communicator needs a cuda backend");
    check_cuda(cudaSetDevice(be.device_index()), "cudaSetDevice");
    check_cuda(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking), "cudaStreamCreate(collectives)");
    check_cuda(cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~nccl_communicator() override {
    (void)cudaSetDevice(be_.device_index());
    if (comm_stream_ != nullptr) {
      (void)cudaStreamSynchronize(comm_stream_);
      (void)cudaStreamDestroy(comm_stream_);
    }
    if (inputs_ready_ != nullptr) (void)cudaEventDestroy(inputs_ready_);
    if (staging_ != nullptr) (void)cudaFree(staging_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_to_all(const void* send, void* recv, std::size_t chunk_bytes, std::string_view label) override {
    all_to_all_start(send, recv, chunk_bytes, label).wait();
  }

  comm_request all_to_all_start(const void* send, void* recv, std::size_t chunk_bytes,
                                std::string_view label) override {
    comm_request r = in_flight(collective::all_to_all, label, [&](ncclComm_t comm) {
      return grouped([&](ncclResult_t& status) {
        for (int j = 0; j < size_ && enqueued(status); ++j) {
          status = ncclSend(static_cast<const std::byte*>(send) + j * chunk_bytes, chunk_bytes, ncclUint8, j, comm,
                            comm_stream_);
          if (enqueued(status))
            status = ncclRecv(static_cast<std::byte*>(recv) + j * chunk_bytes, chunk_bytes, ncclUint8, j, comm,
                              comm_stream_);
        }
      });
    });
    counters_.add(collective::all_to_all, chunk_bytes * size_, label);
    return r;
  }

  // Grouped sends and receives of each peer's size (none where it is 0).
  void all_to_all_v(const void* send, std::span<const std::size_t> send_bytes, void* recv,
                    std::span<const std::size_t> recv_bytes, std::string_view label) override {
    const std::vector<std::size_t> out = chunk_offsets(send_bytes, size_), in = chunk_offsets(recv_bytes, size_);
    run(collective::all_to_all_v, label, [&](ncclComm_t comm) {
      return grouped([&](ncclResult_t& status) {
        for (int j = 0; j < size_ && enqueued(status); ++j) {
          if (send_bytes[j] > 0)
            status = ncclSend(static_cast<const std::byte*>(send) + out[j], send_bytes[j], ncclUint8, j, comm,
                              comm_stream_);
          if (recv_bytes[j] > 0 && enqueued(status))
            status = ncclRecv(static_cast<std::byte*>(recv) + in[j], recv_bytes[j], ncclUint8, j, comm, comm_stream_);
        }
      });
    });
    counters_.add(collective::all_to_all_v, out.back(), label);
  }

  comm_request all_gather_start(const void* send, void* recv, std::size_t chunk_bytes,
                                std::string_view label) override {
    comm_request r = in_flight(collective::all_gather, label, [&](ncclComm_t comm) {
      return ncclAllGather(send, recv, chunk_bytes, ncclUint8, comm, comm_stream_);
    });
    counters_.add(collective::all_gather, chunk_bytes * size_, label);
    return r;
  }

  void all_reduce_sum(float* data, std::size_t count, std::string_view label) override {
    const std::size_t bytes = count * sizeof(float);
    staged(data, bytes, data, bytes, [&](const void* in, void* out) {
      run(collective::all_reduce, label, [&](ncclComm_t comm) {
        return ncclAllReduce(in, out, count, ncclFloat32, ncclSum, comm, comm_stream_);
      });
    });
    counters_.add(collective::all_reduce, bytes, label);
  }

  void reduce_scatter_sum(const float* send, float* recv, std::size_t chunk_count, std::string_view label) override {
    const std::size_t bytes = chunk_count * sizeof(float);
    staged(send, bytes * size_, recv, bytes, [&](const void* in, void* out) {
      run(collective::reduce_scatter, label, [&](ncclComm_t comm) {
        return ncclReduceScatter(in, out, chunk_count, ncclFloat32, ncclSum, comm, comm_stream_);
      });
    });
    counters_.add(collective::reduce_scatter, bytes * size_, label);
  }

  void all_gather(const void* send, void* recv, std::size_t chunk_bytes, std::string_view label) override {
    staged(send, chunk_bytes, recv, chunk_bytes * size_, [&](const void* in, void* out) {
      run(collective::all_gather, label, [&](ncclComm_t comm) {
        return ncclAllGather(in, out, chunk_bytes, ncclUint8, comm, comm_stream_);
      });
    });
    counters_.add(collective::all_gather, chunk_bytes * size_, label);
  }

  void send_recv(const void* send, std::size_t send_bytes, int dst, void* recv, std::size_t recv_bytes, int src,
                 std::string_view label) override {
    if (send_bytes > 0) check_peer(dst, "destination");
    if (recv_bytes > 0) check_peer(src, "source");
    run(collective::send, label, [&](ncclComm_t comm) {
      return grouped([&](ncclResult_t& status) {
        if (send_bytes > 0) status = ncclSend(send, send_bytes, ncclUint8, dst, comm, comm_stream_);
        if (recv_bytes > 0 && enqueued(status)) status = ncclRecv(recv, recv_bytes, ncclUint8, src, comm, comm_stream_);
      });
    });
    if (send_bytes > 0) counters_.add(collective::send, send_bytes, label);
    if (recv_bytes > 0) counters_.add(collective::recv, recv_bytes, label);
  }

  // ncclCommSplit: the colour is the group's first member, the key this rank's place in it.
  // The new communicator joins this one's group, so an abort of either ends both, and the
  // group destroys it at the end of the run.
  std::unique_ptr<communicator> split_native(const std::vector<int>& members) override {
    const auto it = std::find(members.begin(), members.end(), rank_);
    UPIPE_CHECK(it != members.end(), "rank " + std::to_string(rank_) + " splits into a group it is not a member of");
    const int key = static_cast<int>(it - members.begin()), size = static_cast<int>(members.size());
    throw_if_aborted();
    check_cuda(cudaSetDevice(be_.device_index()), "cudaSetDevice");
    ncclComm_t child = nullptr;
    ncclConfig_t config = nonblocking_config();
    const ncclResult_t status =
        comm_.issue([&](ncclComm_t parent) { return ncclCommSplit(parent, members.front(), key, &child, &config); });
    const std::string what = "rank " + std::to_string(rank_) + ": splitting NCCL into a group of " +
                             std::to_string(size) + " ranks from rank " + std::to_string(members.front());
    if ((status != ncclSuccess && status != ncclInProgress) || child == nullptr) {
      group_.abort(what + " failed: " + nccl_message(status, comm_.last_error()));
      throw comm_aborted(what + " failed: " + nccl_message(status));
    }
    try {
      wait_until_ready(child, timeout_s_, what);
    } catch (const std::exception& e) {
      group_.abort(e.what());  // the other ranks wait in their split for this one
      throw;
    }
    guarded_comm& guarded = group_.add(child);
    return std::make_unique<nccl_communicator>(be_, guarded, key, size, group_, timeout_s_);
  }

  void barrier() override {
    float* one = static_cast<float*>(staging(sizeof(float)));
    run(collective::barrier, "", [&](ncclComm_t comm) {
      return ncclAllReduce(one, one, 1, ncclFloat32, ncclSum, comm, comm_stream_);
    });
    wait_for_stream();
    counters_.add(collective::barrier, 0, "");
  }

 private:
  void throw_if_aborted() const {
    if (group_.aborted())
      throw comm_aborted("rank " + std::to_string(rank_) + ": the NCCL group was aborted: " + group_.reason());
  }

  // A call of a non-blocking communicator has been accepted (done, or finishing in NCCL).
  static bool enqueued(ncclResult_t status) { return status == ncclSuccess || status == ncclInProgress; }

  // ncclGroupStart, `body(status)` (which stops at the first failed call), ncclGroupEnd
  // even after a failure; the first failure, else ncclGroupEnd's status.
  template <class body_fn>
  static ncclResult_t grouped(const body_fn& body) {
    ncclResult_t status = ncclGroupStart();
    if (enqueued(status)) body(status);
    const ncclResult_t end = ncclGroupEnd();
    return enqueued(status) ? end : status;
  }

  // Makes the NCCL calls of `body(comm)` under the communicator's lock, then waits, without
  // the lock, for NCCL to finish what it still does in the background; a failure aborts the
  // group, an abort meanwhile ends the wait.
  template <class body_fn>
  void call_nccl(collective c, std::string_view label, const body_fn& body) {
    throw_if_aborted();
    ncclResult_t status = comm_.issue(body);
    while (status == ncclInProgress) {
      throw_if_aborted();
      std::this_thread::yield();
      status = comm_.state();
    }
    throw_if_aborted();  // an abort between the calls makes issue() refuse: that is not this call's failure
    if (status == ncclSuccess) return;
    const std::string what = place(rank_, c, label) + " failed: " + nccl_message(status, comm_.last_error());
    group_.abort(what);
    throw comm_aborted(what);
  }

  // Keeps at most max_in_flight collectives queued (see the top of the file); waits on the
  // host otherwise, which an abort ends.
  void throttle() {
    const auto finished = [this] {
      while (!queued_.empty() && cudaEventQuery(queued_.front()->event) != cudaErrorNotReady) queued_.pop_front();
    };
    finished();
    while (queued_.size() >= max_in_flight) {
      throw_if_aborted();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      finished();
    }
  }

  void check_peer(int peer, const char* role) const {
    UPIPE_CHECK(peer >= 0 && peer < size_, "send_recv: " + std::string(role) + " rank " + std::to_string(peer) +
                                               " is outside the group of " + std::to_string(size_));
  }

  // Runs one collective in order: on the collectives' stream after the compute stream's
  // work so far, with the compute stream's later work after it.
  template <class body_fn>
  void run(collective c, std::string_view label, const body_fn& body) {
    in_flight(c, label, body).wait();
  }

  // Enqueues one collective on the collectives' own stream, after the work issued so far
  // on the compute stream; the request makes the compute stream wait for it.
  template <class body_fn>
  comm_request in_flight(collective c, std::string_view label, const body_fn& body) {
    throw_if_aborted();
    check_cuda(cudaSetDevice(be_.device_index()), "cudaSetDevice");
    throttle();
    check_cuda(cudaEventRecord(inputs_ready_, stream_), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(comm_stream_, inputs_ready_, 0), "cudaStreamWaitEvent");
    // The watchdog's clock starts here, not at issue: the host runs ahead of the GPU.
    auto started = std::make_shared<const completion>(comm_stream_);
    call_nccl(c, label, body);
    // One event marks the collective's end, for the watchdog and for the compute stream.
    auto done = std::make_shared<const completion>(comm_stream_);
    dog_.watch(std::move(started), done, place(rank_, c, label));
    queued_.push_back(done);
    return comm_request([this, done] {
      check_cuda(cudaStreamWaitEvent(stream_, done->event, 0), "cudaStreamWaitEvent");
    });
  }

  // Waits for the stream; a hang ends when the watchdog aborts the group.
  void wait_for_stream() {
    const cudaError_t status = cudaStreamSynchronize(stream_);
    throw_if_aborted();
    check_cuda(status, "rank " + std::to_string(rank_) + ": cudaStreamSynchronize after a collective");
  }

  static bool on_device(const void* p) {
    if (p == nullptr) return true;
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
  }

  void* staging(std::size_t bytes) {
    if (bytes > staging_bytes_) {
      if (staging_ != nullptr) {
        wait_for_stream();
        check_cuda(cudaFree(staging_), "cudaFree(staging)");
        staging_ = nullptr;
      }
      check_cuda(cudaMalloc(&staging_, bytes), "cudaMalloc(staging)");
      staging_bytes_ = bytes;
    }
    return staging_;
  }

  // Runs `body(in, out)` on device buffers: host buffers (small values such as a loss)
  // are copied through the staging buffer and waited for; device buffers go as they are.
  template <class body_fn>
  void staged(const void* in, std::size_t in_bytes, void* out, std::size_t out_bytes, const body_fn& body) {
    if (on_device(in) && on_device(out)) {
      body(in, out);
      return;
    }
    auto* base = static_cast<std::byte*>(staging(in_bytes + out_bytes));
    std::byte* const out_dev = in == out ? base : base + in_bytes;
    check_cuda(cudaMemcpyAsync(base, in, in_bytes, cudaMemcpyDefault, stream_), "cudaMemcpyAsync(staging)");
    body(base, out_dev);
    check_cuda(cudaMemcpyAsync(out, out_dev, out_bytes, cudaMemcpyDefault, stream_), "cudaMemcpyAsync(staging)");
    wait_for_stream();
  }

  backend& be_;
  guarded_comm& comm_;
  const int rank_, size_;
  nccl_group& group_;
  const double timeout_s_;                // for the communicators split from this one
  cudaStream_t stream_;                   // the rank's compute stream
  cudaStream_t comm_stream_ = nullptr;    // every collective, in issue order
  cudaEvent_t inputs_ready_ = nullptr;    // the compute stream's point an in-flight collective waits for
  void* staging_ = nullptr;
  std::size_t staging_bytes_ = 0;
  std::deque<std::shared_ptr<const completion>> queued_;  // the ends of the collectives still queued
  watchdog dog_;  // last: destroyed first, while the rest is still valid
};

// Runs one rank's function; a failure aborts the group so that no other rank waits.
void run_rank(int rank, backend& be, guarded_comm& comm, int size, nccl_group& group, double timeout_s,
              const rank_fn& fn, std::exception_ptr& failure) {
  set_current_rank(rank);
  try {
    nccl_communicator c(be, comm, rank, size, group, timeout_s);
    fn(rank, be, c);
    be.synchronize();
  } catch (...) {
    failure = std::current_exception();
    try {
      std::rethrow_exception(failure);
    } catch (const comm_aborted&) {
    } catch (const std::exception& e) {
      group.abort("rank " + std::to_string(rank) + " failed: " + e.what());
    } catch (...) {
      group.abort("rank " + std::to_string(rank) + " failed");
    }
  }
}

// libupipe_mpi.so, beside the running binary, loaded once.
class mpi_plugin {
 public:
  int (*init)(int* rank, int* size) = nullptr;
  int (*broadcast)(void* data, int bytes) = nullptr;
  void (*abort)(int code) = nullptr;

  static const mpi_plugin& load(const launch_env& env) {
    static const mpi_plugin plugin = open(env);
    return plugin;
  }

  // The plugin when it can be loaded, else null: a job of one process needs no id exchange,
  // but under a launcher it still goes through MPI where MPI is there, as a larger job would.
  static const mpi_plugin* load_if_present(const launch_env& env) {
    try {
      return &load(env);
    } catch (const config_error&) {
      return nullptr;
    }
  }

 private:
  static std::string beside_binary(const char* name) {
    char path[4096];
    const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
    if (n <= 0) return name;
    std::string exe(path, static_cast<std::size_t>(n));
    return exe.substr(0, exe.rfind('/') + 1) + name;
  }

  static mpi_plugin open(const launch_env& env) {
    const std::string path = beside_binary("libupipe_mpi.so");
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (handle == nullptr)
      throw config_error(env.launcher + " started upipe as rank " + std::to_string(env.rank) + " of " +
                         std::to_string(env.size) + ", which needs MPI to carry NCCL's id: " + path +
                         " could not be loaded (" + dlerror() +
                         "). Build where MPI's development files are installed (libopenmpi-dev) and run with the "
                         "MPI that built it, or run one process with a thread per GPU (no launcher)");
    mpi_plugin p;
    p.init = reinterpret_cast<int (*)(int*, int*)>(dlsym(handle, "upipe_mpi_init"));
    p.broadcast = reinterpret_cast<int (*)(void*, int)>(dlsym(handle, "upipe_mpi_broadcast"));
    p.abort = reinterpret_cast<void (*)(int)>(dlsym(handle, "upipe_mpi_abort"));
    if (p.init == nullptr || p.broadcast == nullptr || p.abort == nullptr)
      throw config_error(path + " lacks the upipe_mpi_* entry points: rebuild it with this upipe");
    return p;
  }
};

}  // namespace

int visible_gpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

std::vector<std::unique_ptr<backend>> run_nccl_threads(const memory_limits& limits, int size, const rank_fn& fn,
                                                       double timeout_s) {
  const int gpus = visible_gpus();
  if (gpus < size)
    throw config_error("--comm nccl with " + std::to_string(size) + " ranks needs a GPU per rank but " +
                       std::to_string(gpus) + " GPU(s) are visible: use --cp " + std::to_string(std::max(gpus, 1)) +
                       ", start one process per GPU with mpirun, or --comm threads for virtual ranks on one GPU");
  std::vector<std::unique_ptr<backend>> backends;
  std::vector<int> devices;
  for (int r = 0; r < size; ++r) {
    backends.push_back(make_cuda_backend(limits, r));
    devices.push_back(r);
  }
  // ncclCommInitAll makes blocking communicators: one non-blocking communicator per GPU
  // instead, set up together in one group call.
  std::vector<ncclComm_t> comms(static_cast<std::size_t>(size), nullptr);
  ncclUniqueId id{};
  ncclResult_t status = ncclGetUniqueId(&id);
  if (status != ncclSuccess) throw std::runtime_error("ncclGetUniqueId failed: " + nccl_message(status));
  ncclConfig_t config = nonblocking_config();
  status = ncclGroupStart();
  for (int r = 0; r < size && (status == ncclSuccess || status == ncclInProgress); ++r) {
    check_cuda(cudaSetDevice(devices[r]), "cudaSetDevice");
    status = ncclCommInitRankConfig(&comms[r], size, id, r, &config);
  }
  const ncclResult_t ended = ncclGroupEnd();
  if ((status != ncclSuccess && status != ncclInProgress) || (ended != ncclSuccess && ended != ncclInProgress))
    throw std::runtime_error("setting up NCCL over " + std::to_string(size) + " GPUs failed: " +
                             nccl_message(status != ncclSuccess && status != ncclInProgress ? status : ended));
  for (int r = 0; r < size; ++r) {
    try {
      wait_until_ready(comms[r], timeout_s, "setting up NCCL for rank " + std::to_string(r) + " of " +
                                                std::to_string(size));
    } catch (...) {
      for (int other = 0; other < size; ++other)
        if (other != r) (void)ncclCommAbort(comms[other]);
      throw;
    }
  }
  nccl_group group;
  std::vector<guarded_comm*> guarded;
  for (ncclComm_t c : comms) guarded.push_back(&group.add(c));
  std::vector<std::exception_ptr> failures(static_cast<std::size_t>(size));
  {
    std::vector<std::thread> threads;
    try {
      for (int r = 0; r < size; ++r)
        threads.emplace_back(run_rank, r, std::ref(*backends[r]), std::ref(*guarded[r]), size, std::ref(group),
                             timeout_s, std::cref(fn), std::ref(failures[r]));
    } catch (const std::exception& e) {
      // A thread that could not start must not leave the started ones waiting for it.
      failures[threads.size()] = std::current_exception();
      group.abort("the thread of rank " + std::to_string(threads.size()) + " could not start: " + e.what());
    }
    for (auto& t : threads) t.join();
  }
  group.destroy_all(timeout_s);
  std::vector<std::exception_ptr> raised;
  for (auto& f : failures)
    if (f) raised.push_back(f);
  rethrow_first_failure(raised);
  return backends;
}

std::vector<std::unique_ptr<backend>> run_nccl_process(const memory_limits& limits, const launch_env& env,
                                                       const rank_fn& fn, double timeout_s) {
  const int gpus = visible_gpus();
  if (env.local_rank >= gpus)
    throw config_error("rank " + std::to_string(env.rank) + " (started by " + env.launcher + ") has local rank " +
                       std::to_string(env.local_rank) + " but this node shows " + std::to_string(gpus) +
                       " GPU(s): start at most one process per GPU on each node");
  std::vector<std::unique_ptr<backend>> backends;
  backends.push_back(make_cuda_backend(limits, env.local_rank));
  // One process needs no MPI (its NCCL id stays here) but uses it where it is installed.
  const mpi_plugin* mpi = env.size > 1 ? &mpi_plugin::load(env) : mpi_plugin::load_if_present(env);
  ncclComm_t comm = nullptr;
  try {
    int mpi_rank = 0, mpi_size = 1;
    if (mpi != nullptr && mpi->init(&mpi_rank, &mpi_size) != 0) {
      if (env.size > 1) throw std::runtime_error("MPI_Init failed (" + env.launcher + ")");
      mpi = nullptr;  // a job of one process goes on without it
      mpi_rank = 0;
      mpi_size = 1;
    }
    if (mpi_rank != env.rank || mpi_size != env.size)
      throw config_error("MPI says rank " + std::to_string(mpi_rank) + " of " + std::to_string(mpi_size) + " but " +
                         env.launcher + "'s environment says " + std::to_string(env.rank) + " of " +
                         std::to_string(env.size) + ": start upipe with the launcher of the MPI it was built with");
    ncclUniqueId id{};
    if (env.rank == 0) {
      const ncclResult_t got_id = ncclGetUniqueId(&id);
      if (got_id != ncclSuccess)
        throw std::runtime_error("ncclGetUniqueId failed: " + nccl_message(got_id));
    }
    if (mpi != nullptr && mpi->broadcast(&id, sizeof(id)) != 0)
      throw std::runtime_error("MPI_Bcast of the NCCL id failed");
    check_cuda(cudaSetDevice(env.local_rank), "cudaSetDevice");
    ncclConfig_t config = nonblocking_config();
    const ncclResult_t status = ncclCommInitRankConfig(&comm, env.size, id, env.rank, &config);
    if (status != ncclSuccess && status != ncclInProgress)
      throw std::runtime_error("rank " + std::to_string(env.rank) + ": ncclCommInitRankConfig over " +
                               std::to_string(env.size) + " processes failed: " + nccl_message(status));
    wait_until_ready(comm, timeout_s, "rank " + std::to_string(env.rank) + ": setting up NCCL over " +
                                          std::to_string(env.size) + " processes");
  } catch (const std::exception& e) {
    // The other processes wait in MPI or in NCCL's setup for this one: end the job.
    if (mpi != nullptr) {
      std::fprintf(stderr, "upipe: error: rank %d: %s; aborting the job\n", env.rank, e.what());
      mpi->abort(1);
    }
    throw;
  }
  nccl_group group;
  guarded_comm& guarded = group.add(comm);
  std::exception_ptr failure;
  run_rank(env.rank, *backends[0], guarded, env.size, group, timeout_s, fn, failure);
  group.destroy_all(timeout_s);
  // A failed rank ends the job at once: the other processes may be waiting for it.
  if (failure && env.size > 1) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "upipe: error: rank %d: %s; aborting the job\n", env.rank, e.what());
    } catch (...) {
      std::fprintf(stderr, "upipe: error: rank %d failed; aborting the job\n", env.rank);
    }
    mpi->abort(1);
  }
  if (failure) std::rethrow_exception(failure);
  return backends;
}

}  // namespace upipe

#endif  // UPIPE_HAVE_CUDA
