#include "runtime/cp_group.hpp"

#include <optional>
#include <string>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "comm/launch.hpp"
#include "comm/nccl.hpp"
#include "comm/replica_mesh.hpp"
#include "core/error.hpp"
#include "core/machine.hpp"

namespace upipe {

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

// The cpu backend's arenas are reservations whose pages are committed on first touch, so
// ranks that together touch more than the machine has would be killed midway. Each rank's
// arena and pool together are capped at its share of the memory available now; a run
// that needs more ends in out_of_memory_error (exit 3) naming the allocation instead.
memory_limits within_machine(memory_limits limits, int ranks, std::size_t& share) {
  const std::size_t available = available_memory_bytes();
  share = available / static_cast<std::size_t>(ranks);
  const std::size_t asked = limits.device_bytes + limits.host_bytes;
  if (available == 0 || asked <= share) {
    share = 0;
    return limits;
  }
  const double scale = static_cast<double>(share) / static_cast<double>(asked);
  limits.device_bytes = static_cast<std::size_t>(static_cast<double>(limits.device_bytes) * scale);
  limits.host_bytes = static_cast<std::size_t>(static_cast<double>(limits.host_bytes) * scale);
  return limits;
}

}  // namespace

std::vector<std::unique_ptr<backend>> run_cp_group(backend_kind kind, const memory_limits& limits, int size,
                                                   const std::function<void(int rank, backend& be, communicator& comm)>& fn,
                                                   group_run ranks, const comm_options& comm) {
  validate(comm);
  std::vector<std::unique_ptr<backend>> backends;
  if (ranks == group_run::rank_zero_emulated || kind == backend_kind::meta) {
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
  std::size_t share = 0;
  const memory_limits capped = kind == backend_kind::cpu ? within_machine(limits, size, share) : limits;
  for (int r = 0; r < size; ++r) backends.push_back(make_backend(kind, capped));
  std::vector<backend*> raw;
  for (auto& b : backends) raw.push_back(b.get());
  try {
    run_threads(raw, [&](int rank, communicator& c) { fn(rank, *raw[rank], c); });
  } catch (const out_of_memory_error& e) {
    if (share == 0) throw;
    throw out_of_memory_error(std::string(e.what()) + " (each of the " + std::to_string(size) +
                              " cpu ranks has " + std::to_string(share >> 20) +
                              " MiB, its share of the memory this machine has available)");
  }
  return backends;
}

std::vector<std::unique_ptr<backend>> run_mesh(backend_kind kind, const memory_limits& limits, mesh_shape mesh,
                                               const mesh_rank_fn& fn, group_run ranks, const comm_options& comm) {
  if (mesh.dp < 1 || mesh.cp < 1)
    throw config_error("--dp " + std::to_string(mesh.dp) + " and --cp " + std::to_string(mesh.cp) +
                       " must be at least 1 (replicas, and ranks in each replica's CP group; for example --dp 2 --cp 4)");
  if (mesh.dp > 1 && ranks == group_run::every_rank && kind != backend_kind::meta && comm.kind != comm_kind::threads) {
    const std::optional<launch_env> env = launcher_environment();
    if (env && env->size != mesh.ranks())
      throw config_error(env->launcher + " started " + std::to_string(env->size) + " processes but --dp " +
                         std::to_string(mesh.dp) + " x --cp " + std::to_string(mesh.cp) + " makes " +
                         std::to_string(mesh.ranks()) + " ranks: start one process per rank (mpirun -np " +
                         std::to_string(mesh.ranks()) + "), or choose --dp and --cp whose product is " +
                         std::to_string(env->size));
  }
  return run_cp_group(
      kind, limits, mesh.ranks(),
      [&](int rank, backend& be, communicator& world) {
        const replica_groups groups = split_replicas(world, be, mesh.cp);
        const expert_groups experts = split_experts(world, be, mesh.ep);
        communicator& cp = groups.cp ? *groups.cp : world;
        fn(rank, be, {world, cp, groups.shards ? *groups.shards : world, experts.peers.get(), experts.replicas.get()});
      },
      ranks, comm);
}

}  // namespace upipe
