#include <optional>
#include <string>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "comm/launch.hpp"
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

namespace {

// NCCL runs the group when asked, or by default on the cuda backend when a launcher
// started several processes or every rank can have a GPU of its own.
bool use_nccl(backend_kind kind, int size, const comm_options& comm, const std::optional<launch_env>& env) {
  if (comm.kind == comm_kind::nccl) {
    if (kind != backend_kind::cuda)
      throw config_error("--comm nccl needs --backend cuda (the " + std::string(backend_name(kind)) +
                         " backend's ranks talk through --comm threads)");
    return true;
  }
  // Asked for by name, threads run the whole group in this process even under a launcher.
  if (comm.kind == comm_kind::threads) return false;
  const bool several_processes = env && env->size > 1;
  if (kind != backend_kind::cuda) {
    if (several_processes)
      throw config_error(env->launcher + " started " + std::to_string(env->size) + " processes, but the " +
                         std::string(backend_name(kind)) + " backend runs every rank in one process: use --backend "
                         "cuda with NCCL, or start one process");
    return false;
  }
  return several_processes || (size > 1 && visible_gpus() >= size);
}

}  // namespace

std::vector<std::unique_ptr<backend>> run_cp_group(backend_kind kind, const memory_limits& limits, int size,
                                                   const std::function<void(int rank, backend& be, communicator& comm)>& fn,
                                                   bool emulate, const comm_options& comm) {
  validate(comm);
  std::vector<std::unique_ptr<backend>> backends;
  if (emulate || kind == backend_kind::meta) {
    backends.push_back(make_backend(kind, limits));
    auto loopback = make_loopback_communicator(*backends[0], size);
    fn(0, *backends[0], *loopback);
    return backends;
  }
  const std::optional<launch_env> env = launcher_environment();
  if (use_nccl(kind, size, comm, env)) {
#ifdef UPIPE_HAVE_CUDA
    if (!env) return run_nccl_threads(limits, size, fn, comm.timeout_s);
    if (env->size != size)
      throw config_error(env->launcher + " started " + std::to_string(env->size) + " processes but the CP group has " +
                         std::to_string(size) + " ranks: start one process per rank (mpirun -np " +
                         std::to_string(size) + ") or set --cp " + std::to_string(env->size));
    return run_nccl_process(limits, *env, fn, comm.timeout_s);
#else
    throw config_error("this build has no CUDA backend, so no NCCL: use --comm threads");
#endif
  }
  for (int r = 0; r < size; ++r) backends.push_back(make_backend(kind, limits));
  std::vector<backend*> raw;
  for (auto& b : backends) raw.push_back(b.get());
  run_threads(raw, [&](int rank, communicator& c) { fn(rank, *raw[rank], c); });
  return backends;
}

}  // namespace upipe
