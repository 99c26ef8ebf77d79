// How this process was started: alone, or as one rank of a job that a launcher (mpirun,
// srun) started, and then which rank. NCCL's multi-process mode takes the rank, the job
// size and the rank within the node (its GPU) from the launcher's environment.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace upipe {

struct launch_env {
  std::string launcher;  // "mpirun (Open MPI)", "mpirun (MPICH/Hydra)" or "srun"
  int rank = 0, size = 1, local_rank = 0;
};

using env_reader = std::function<const char*(const char*)>;

// The launcher's rank, size and local rank, or nothing when no launcher's variables
// are set. A variable that is set but not a count in range throws config_error naming it.
std::optional<launch_env> launcher_environment(const env_reader& getenv_fn);
std::optional<launch_env> launcher_environment();

}  // namespace upipe
