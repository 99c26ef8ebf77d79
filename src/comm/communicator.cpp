// The communicator's helpers that need no particular group: the sum over ranks, the
// names of the communicator kinds and the check of their options.
#include <string>
#include <vector>

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
