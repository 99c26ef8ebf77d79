// The communicator's helpers that need no particular group: the sum over ranks, the
// names of the communicator kinds and the check of their options.
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "comm/byte_at.hpp"
#include "comm/communicator.hpp"
#include "comm/nccl.hpp"
#include "core/error.hpp"

namespace upipe {

double sum_over_ranks(communicator& comm, double value, std::string_view label) {
  std::vector<double> all(static_cast<std::size_t>(comm.size()));
  comm.all_gather(&value, all.data(), sizeof(double), label);
  double total = 0;
  for (double v : all) total += v;
  return total;
}

std::vector<std::size_t> chunk_offsets(std::span<const std::size_t> bytes, int ranks) {
  UPIPE_CHECK(static_cast<int>(bytes.size()) == ranks, "all_to_all_v takes one size per rank: " +
                                                           std::to_string(bytes.size()) + " for " +
                                                           std::to_string(ranks) + " ranks");
  std::vector<std::size_t> offsets(bytes.size() + 1, 0);
  for (std::size_t j = 0; j < bytes.size(); ++j) offsets[j + 1] = offsets[j] + bytes[j];
  return offsets;
}

void communicator::relay_all_to_all_v(communicator& parent, const std::function<int(int)>& parent_rank, backend& be,
                                      const void* send, std::span<const std::size_t> send_bytes, void* recv,
                                      std::span<const std::size_t> recv_bytes, std::string_view label) {
  const int n = size(), me = rank();
  const std::vector<std::size_t> out = chunk_offsets(send_bytes, n), in = chunk_offsets(recv_bytes, n);
  UPIPE_CHECK(send_bytes[me] == recv_bytes[me], "all_to_all_v: rank " + std::to_string(me) + " sends itself " +
                                                    std::to_string(send_bytes[me]) + " bytes but expects " +
                                                    std::to_string(recv_bytes[me]));
  if (send_bytes[me] > 0) be.copy_bytes(at(recv, in[me]), at(send, out[me]), send_bytes[me]);
  for (int k = 1; k < n; ++k) {
    const int dst = (me + k) % n, src = (me - k + n) % n;
    const std::size_t s = send_bytes[dst], r = recv_bytes[src];
    parent.send_recv(s > 0 ? at(send, out[dst]) : nullptr, s, s > 0 ? parent_rank(dst) : -1,
                     r > 0 ? at(recv, in[src]) : nullptr, r, r > 0 ? parent_rank(src) : -1, label);
  }
  counters_.add(collective::all_to_all_v, out.back(), label);
}

std::string_view comm_kind_name(comm_kind kind) {
  switch (kind) {
    case comm_kind::automatic: return "auto";
    case comm_kind::threads: return "threads";
    case comm_kind::nccl: return "nccl";
  }
  return "unknown";
}

comm_kind parse_comm_kind(std::string_view name) {
  if (name == "auto") return comm_kind::automatic;
  if (name == "threads") return comm_kind::threads;
  if (name == "nccl") return comm_kind::nccl;
  throw config_error("unknown communicator '" + std::string(name) +
                     "': use auto, threads (ranks as threads, virtual ranks on one GPU) or nccl (a GPU per rank)");
}

void validate(const comm_options& options) {
  if (!(options.timeout_s > 0))
    throw config_error("--comm-timeout " + std::to_string(options.timeout_s) +
                       " must be a positive number of seconds (for example 600)");
}

#ifndef UPIPE_HAVE_CUDA
int visible_gpus() { return 0; }
#endif

}  // namespace upipe
