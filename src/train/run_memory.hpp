// What a training run holds in host and GPU memory, part by part, and the check of both
// against what the machine offers, made before anything is pinned or allocated: a run
// that cannot fit ends with exit 3 naming the parts and a way out, never in the kernel's
// OOM killer.
//
// Host memory has one meaning everywhere: --host-memory-gib is everything the process may
// hold in host memory (its ranks' pools with the offloaded state and the chunks' K/V, the
// weights' files or host copies, the step's sequences, the libraries), and each rank's
// pool is what remains of it (step_sizes.hpp). One process runs every rank of a node, so
// the budget is the node's.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "train/trainer.hpp"

namespace upipe {

struct memory_part {
  std::string what;
  std::size_t bytes = 0;
};

struct run_memory {
  std::vector<memory_part> host;  // the process's, every rank it runs
  std::vector<memory_part> gpu;   // one GPU's, every rank on it (empty off the GPU)
  std::size_t host_bytes() const;
  std::size_t gpu_bytes() const;
};

// The share of what the machine offers that a run leaves to the system (and to what it
// does not count: a data loader's pages, the page cache), as the planner's margin does.
inline constexpr double host_margin_fraction = 0.05;

// Outside a GPU's arena: the CUDA context, the cuBLASLt and cuDNN handles and staging
// (driver peak minus arena on the H200, docs/benchmarks.md, rounded up).
inline constexpr std::size_t cuda_context_bytes = std::size_t{640} << 20;

// The process's own host memory beside its buffers: code, the CUDA context's host side and
// the libraries' (3.3 GiB measured on the H200, rounded up); meta counts the GPU's.
std::size_t process_host_bytes(backend_kind kind);

// The ranks this process runs: every rank of the mesh, or one under a launcher's processes.
int process_ranks(const train_options& o);

// The process's host parts outside the ranks' pools: the first weights (their files,
// mapped for the run, or a random initialization's f32 copy), a resumed checkpoint's files,
// the step's sequences, the process's own. Meta counts what the GPU run would hold.
std::vector<memory_part> host_beside_pools(const train_options& o);

// Every part, with the pools of o.limits (resolved by resolve_step). The cpu backend's
// arena and the checkpoints' part of its pool are reservations capped at the machine's
// share when reserved (run_cp_group), so they are not counted; the CUDA backend's pool is
// taken whole at start (pinned) and is.
// `ranks`: the ranks the process runs (default process_ranks; 1 where rank 0 alone runs,
// emulating its group).
run_memory run_memory_of(const train_options& o, int ranks = 0);

// The process's host bytes after a run whose rank 0 pool reached `pool_high_water`: the
// parts beside the pools, and each rank's pool whole where the backend takes it at start
// (cuda), else at that high water (meta: what the GPU run's pools must hold; cpu).
std::size_t run_host_bytes(const train_options& o, std::size_t pool_high_water);

// Throws out_of_memory_error (exit 3) naming every part, what the machine offers and ways
// out, where the host's parts pass what the machine offers less the margin, or a GPU's pass
// its free memory. Meta takes nothing: no check.
void require_run_memory(const run_memory& need, backend_kind kind);

std::string gib_text(std::size_t bytes);  // "12.34 GiB"

}  // namespace upipe
