// The communicator: collectives over the ranks of one CP group, with byte counters per
// collective and per label. Buffers live on the ranks' backends; payloads move through
// backend::copy_bytes (so the meta backend moves nothing) and fp32 sums through
// backend::add_f32.
#pragma once

#include <array>
#include <exception>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/dtype.hpp"

namespace upipe {

class backend;

enum class collective : std::uint8_t {
  all_to_all, all_reduce, reduce_scatter, all_gather, send, recv, barrier, all_to_all_v, count
};
constexpr std::size_t collective_count = static_cast<std::size_t>(collective::count);
std::string_view collective_name(collective c);

// Bytes this rank put on the wire (its whole send buffer, its own chunk included, as
// nccl-tests counts), and calls, per collective; sent bytes also per label ("a2a_q", ...).
// A send_recv counts its outgoing bytes under send and its incoming ones under recv.
struct comm_counters {
  std::array<std::uint64_t, collective_count> bytes{};
  std::array<std::uint64_t, collective_count> calls{};
  std::map<std::string, std::uint64_t, std::less<>> bytes_by_label;

  void add(collective c, std::uint64_t n, std::string_view label);
  std::uint64_t label_bytes(std::string_view label) const;
};

// Thrown on every rank of a group when another rank failed and the group was aborted.
class comm_aborted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A collective in flight (all_to_all_start): wait() orders this rank's later work after
// it (on a GPU without blocking the host). Its buffers must stay allocated, and its send
// buffer unwritten, until wait() returned. A request that was never started, or whose
// collective already completed, waits for nothing.
class comm_request {
 public:
  comm_request() = default;
  explicit comm_request(std::function<void()> wait) : wait_(std::move(wait)) {}
  void wait() {
    if (wait_) std::exchange(wait_, nullptr)();
  }
  bool pending() const { return static_cast<bool>(wait_); }

 private:
  std::function<void()> wait_;
};

class communicator {
 public:
  virtual ~communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // send holds size() chunks of chunk_bytes (chunk j goes to rank j); recv receives
  // size() chunks (chunk j came from rank j). send and recv must not overlap.
  virtual void all_to_all(const void* send, void* recv, std::size_t chunk_bytes, std::string_view label) = 0;
  // The same exchange, returned in flight so that independent work can run beside it.
  // Every rank starts it at the same point in its sequence of collectives. The default
  // completes it at once (threads, loopback); NCCL runs it on a stream of its own.
  virtual comm_request all_to_all_start(const void* send, void* recv, std::size_t chunk_bytes,
                                        std::string_view label) {
    all_to_all(send, recv, chunk_bytes, label);
    return {};
  }
  // An all-to-all of chunks of any size (expert parallelism's token exchange): chunk j of
  // `send` (send_bytes[j] bytes, the chunks back to back in rank order) goes to rank j, and
  // chunk j of `recv` (recv_bytes[j] bytes, back to back) comes from rank j, which must send
  // exactly that many (a rank learns its sizes beforehand, e.g. by an all_to_all of them).
  // send and recv must not overlap. Counted under all_to_all_v: the bytes this rank sends.
  virtual void all_to_all_v(const void* send, std::span<const std::size_t> send_bytes, void* recv,
                            std::span<const std::size_t> recv_bytes, std::string_view label) = 0;
  // In-place sum of `count` f32 values over all ranks.
  virtual void all_reduce_sum(float* data, std::size_t count, std::string_view label) = 0;
  // send: size() chunks of chunk_count f32; recv (chunk_count) = sum over ranks of chunk rank().
  virtual void reduce_scatter_sum(const float* send, float* recv, std::size_t chunk_count, std::string_view label) = 0;
  // recv: size() chunks of chunk_bytes, chunk j = rank j's send.
  virtual void all_gather(const void* send, void* recv, std::size_t chunk_bytes, std::string_view label) = 0;
  // The same gather in flight (see all_to_all_start); device buffers only.
  virtual comm_request all_gather_start(const void* send, void* recv, std::size_t chunk_bytes,
                                        std::string_view label) {
    all_gather(send, recv, chunk_bytes, label);
    return {};
  }
  // Sends to dst and receives from src at once (a ring step); either may be skipped by
  // passing nullptr with 0 bytes. Never deadlocks when every rank calls it together.
  virtual void send_recv(const void* send, std::size_t send_bytes, int dst, void* recv, std::size_t recv_bytes,
                         int src, std::string_view label) = 0;
  virtual void barrier() = 0;
  // Rank 0 of a group alone (make_loopback_communicator): its sub-groups are loopbacks too.
  virtual bool is_loopback() const { return false; }
  // A communicator of its own over `members` (ranks of this group, ascending, this rank
  // among them), where the transport can make one (NCCL's ncclCommSplit); null where it
  // cannot, and make_subgroup (comm/subgroup.hpp) then builds the group from this one's
  // point-to-point sends. Collective: every rank calls it at once, each with the members of
  // its own group, the groups disjoint.
  virtual std::unique_ptr<communicator> split_native(const std::vector<int>& /*members*/) { return nullptr; }

  const comm_counters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

 protected:
  // A group built on `parent`'s ranks: its point-to-point exchange (ranks already the
  // parent's, -1 where a side is skipped) and its barrier run there, counted here.
  void relay_send_recv(communicator& parent, const void* send, std::size_t send_bytes, int parent_dst, void* recv,
                       std::size_t recv_bytes, int parent_src, std::string_view label) {
    parent.send_recv(send, send_bytes, parent_dst, recv, recv_bytes, parent_src, label);
    if (send_bytes > 0) counters_.add(collective::send, send_bytes, label);
    if (recv_bytes > 0) counters_.add(collective::recv, recv_bytes, label);
  }
  // all_to_all_v as rounds of `parent`'s point-to-point sends (round k sends to the rank k
  // places on and receives from the rank k places back), this group's rank j being parent
  // rank parent_rank(j); the own chunk is copied on `be`. Counted here.
  void relay_all_to_all_v(communicator& parent, const std::function<int(int)>& parent_rank, backend& be,
                          const void* send, std::span<const std::size_t> send_bytes, void* recv,
                          std::span<const std::size_t> recv_bytes, std::string_view label);
  void relay_barrier(communicator& parent) {
    parent.barrier();
    counters_.add(collective::barrier, 0, "");
  }

  comm_counters counters_;
};

// Rank 0 of a group of `size` alone: each collective moves rank 0's own bytes (recv
// chunk j = send chunk j), so shapes, memory and compute are rank 0's. Honest for
// ulysses and upipe, where every rank does the same work; never for communication time.
std::unique_ptr<communicator> make_loopback_communicator(backend& be, int size);

// Runs fn(rank, communicator) on one thread per backend (rank r uses backends[r]);
// the communicators form one group. If any rank throws, the group is aborted (every
// rank blocked in a collective gets comm_aborted) and, after all threads joined, the
// first exception that is not comm_aborted is rethrown here.
void run_threads(std::span<backend* const> backends, const std::function<void(int rank, communicator& comm)>& fn);

// After a group's threads joined: rethrows the failure that caused the abort, the first
// that is not comm_aborted (or the first, if all are); nothing when there is none.
void rethrow_first_failure(const std::vector<std::exception_ptr>& failures);

// Which communicator a group of real ranks uses: `threads` (ranks are threads sharing
// memory, on the CPU or as virtual ranks on one GPU), `nccl` (one GPU per rank: one
// thread per GPU of this node, or one process per GPU under mpirun/srun), or `automatic`:
// nccl on the cuda backend when a launcher started several processes or this node has a
// GPU for every rank, threads otherwise.
enum class comm_kind : std::uint8_t { automatic, threads, nccl };
std::string_view comm_kind_name(comm_kind kind);
// Parses "auto", "threads" or "nccl"; throws config_error naming the valid values.
comm_kind parse_comm_kind(std::string_view name);

struct comm_options {
  comm_kind kind = comm_kind::automatic;
  // NCCL: a collective not done after this many seconds aborts every rank with a message
  // naming the rank, the collective and the layer.
  double timeout_s = 600;
};
// Throws config_error for a timeout that is not a positive number of seconds.
void validate(const comm_options& options);

// The offsets of all_to_all_v's chunks (one more than the ranks: the last is the total);
// throws internal_error unless there is one size per rank.
std::vector<std::size_t> chunk_offsets(std::span<const std::size_t> bytes, int ranks);

// The fp64 sum over the group of one value per rank, identical on every rank: the values
// travel as raw bytes and every rank adds them in rank order.
double sum_over_ranks(communicator& comm, double value, std::string_view label);

}  // namespace upipe
