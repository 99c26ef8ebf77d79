// The launcher's environment: Open MPI's, MPICH's and Slurm's variables, none, and bad ones.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "comm/launch.hpp"
#include "core/error.hpp"

namespace upipe {
namespace {

env_reader from(const std::map<std::string, std::string>& vars) {
  return [vars](const char* name) -> const char* {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

TEST(launch, no_launcher_variables_mean_one_process) { EXPECT_FALSE(launcher_environment(from({})).has_value()); }

TEST(launch, reads_open_mpi_mpich_and_slurm) {
  auto ompi = launcher_environment(
      from({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}}));
  ASSERT_TRUE(ompi.has_value());
  EXPECT_EQ(ompi->rank, 3);
  EXPECT_EQ(ompi->size, 8);
  EXPECT_EQ(ompi->local_rank, 1);
  EXPECT_EQ(ompi->launcher, "mpirun (Open MPI)");
  auto hydra = launcher_environment(from({{"PMI_RANK", "0"}, {"PMI_SIZE", "1"}}));
  ASSERT_TRUE(hydra.has_value());
  EXPECT_EQ(hydra->size, 1);
  EXPECT_EQ(hydra->local_rank, 0);  // no local rank given: the rank itself
  auto slurm =
      launcher_environment(from({{"SLURM_PROCID", "5"}, {"SLURM_STEP_NUM_TASKS", "16"}, {"SLURM_LOCALID", "5"}}));
  ASSERT_TRUE(slurm.has_value());
  EXPECT_EQ(slurm->launcher, "srun");
  EXPECT_EQ(slurm->rank, 5);
  // A Slurm allocation without srun sets no SLURM_PROCID: one process.
  EXPECT_FALSE(launcher_environment(from({{"SLURM_NTASKS", "16"}})).has_value());
  // Nor is the batch script itself a rank, though it sees SLURM_PROCID=0 and the job's SLURM_NTASKS.
  EXPECT_FALSE(launcher_environment(from({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "16"}})).has_value());
}

TEST(launch, bad_values_name_the_variable) {
  try {
    launcher_environment(from({{"OMPI_COMM_WORLD_RANK", "x1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}));
    FAIL() << "expected config_error";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("OMPI_COMM_WORLD_RANK='x1'"), std::string::npos) << e.what();
  }
  try {
    launcher_environment(from({{"SLURM_PROCID", "4"}, {"SLURM_STEP_NUM_TASKS", "4"}}));
    FAIL() << "expected config_error";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("SLURM_PROCID=4 is not below SLURM_STEP_NUM_TASKS=4"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace upipe
