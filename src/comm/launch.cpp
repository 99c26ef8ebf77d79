#include "comm/launch.hpp"

#include <charconv>
#include <cstdlib>
#include <string_view>

#include "core/error.hpp"

namespace upipe {

namespace {

// The variables each launcher sets: rank, size, rank within the node.
struct launcher_vars {
  const char* name;
  const char* rank;
  const char* size;
  const char* local_rank;
};

constexpr launcher_vars known_launchers[] = {
    {"mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
    {"mpirun (MPICH/Hydra)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
    // srun's own: a batch script also sees SLURM_PROCID=0 and SLURM_NTASKS, but not this size.
    {"srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"},
};

int parse_count(const env_reader& getenv_fn, const char* var, const char* launcher, int fallback) {
  const char* text = getenv_fn(var);
  if (text == nullptr) return fallback;
  const std::string_view v(text);
  int value = -1;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), value);
  if (ec != std::errc() || end != v.data() + v.size() || value < 0)
    throw config_error(std::string(var) + "='" + std::string(v) + "' (set by " + launcher +
                       ") is not a non-negative count; start upipe through the launcher unchanged, or unset it to run "
                       "one process");
  return value;
}

}  // namespace

std::optional<launch_env> launcher_environment(const env_reader& getenv_fn) {
  for (const launcher_vars& l : known_launchers) {
    if (getenv_fn(l.rank) == nullptr || getenv_fn(l.size) == nullptr) continue;
    launch_env env;
    env.launcher = l.name;
    env.rank = parse_count(getenv_fn, l.rank, l.name, 0);
    env.size = parse_count(getenv_fn, l.size, l.name, 1);
    env.local_rank = parse_count(getenv_fn, l.local_rank, l.name, env.rank);
    if (env.size < 1 || env.rank >= env.size)
      throw config_error(std::string(l.rank) + "=" + std::to_string(env.rank) + " is not below " + l.size + "=" +
                         std::to_string(env.size) + " (set by " + l.name +
                         "); the launcher's rank must lie in [0, size)");
    return env;
  }
  return std::nullopt;
}

std::optional<launch_env> launcher_environment() {
  return launcher_environment([](const char* name) { return std::getenv(name); });
}

}  // namespace upipe
