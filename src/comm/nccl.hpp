// The NCCL communicator: one GPU per rank, collectives on a stream of their own joined to
// the rank's compute stream by events (no host wait), and a watchdog per rank that aborts
// the group when a collective has not finished within the timeout of its start. Built only with the
// CUDA backend.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "comm/launch.hpp"

namespace upipe {

using rank_fn = std::function<void(int rank, backend& be, communicator& comm)>;

// GPUs this process sees (0 without a driver or without CUDA in the build).
int visible_gpus();

// One process, one thread per GPU: rank r on GPU r, communicators from ncclCommInitAll.
std::vector<std::unique_ptr<backend>> run_nccl_threads(const memory_limits& limits, int size, const rank_fn& fn,
                                                       double timeout_s);

// This process is rank env.rank of env.size, started by a launcher: its GPU is the local
// rank; MPI only broadcasts the NCCL id (a build without MPI runs a job of one process).
std::vector<std::unique_ptr<backend>> run_nccl_process(const memory_limits& limits, const launch_env& env,
                                                       const rank_fn& fn, double timeout_s);

}  // namespace upipe
