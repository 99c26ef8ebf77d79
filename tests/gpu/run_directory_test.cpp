// Issue #30 on the CUDA backend: a stop asked for mid-run (as SIGTERM asks) ends every
// virtual rank after the same step with a checkpoint in the run directory, and a resume
// from the run directory alone continues as the run that never stopped (within bf16 and
// cuDNN's nondeterminism: the GPU's gradients need not repeat bit for bit). Skipped when
// no CUDA device is present.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <string>

#include "train/run_directory.hpp"
#include "train/trainer.hpp"
#include "gpu_support.hpp"

namespace upipe {
namespace {

train_options run_on_gpu(const std::string& save_dir) {
  train_options o;
  o.model = preset("tiny-llama");
  o.seq_len = 128;
  o.cp = {strategy_kind::upipe, 4, 0};
  o.zero = zero_stage::three;
  o.optim.lr = 3e-3;
  o.optim.total_steps = 12;
  o.eval_samples = 0;
  o.backend = backend_kind::cuda;
  o.limits = {std::size_t{1} << 30, std::size_t{256} << 20};
  o.save_dir = save_dir;
  return o;
}

TEST(gpu_run_directory, a_stop_saves_and_the_resume_follows_the_uninterrupted_run) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  const auto dir = std::filesystem::temp_directory_path() / ("upipe_gpu_stop_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);  // --save refuses a run directory whose parent is missing
  const train_summary whole = train(run_on_gpu((dir / "whole").string()), nullptr);
  ASSERT_EQ(whole.steps.size(), 12u);
  std::atomic<int> stop{0};
  train_options first = run_on_gpu((dir / "run").string());
  first.stop_signal = &stop;
  const train_summary stopped = train(first, [&](const step_record& r) {
    if (r.step == 5) stop.store(SIGTERM);
  });
  EXPECT_EQ(stopped.stopped_by_signal, SIGTERM);
  ASSERT_EQ(stopped.steps.size(), 5u);
  EXPECT_EQ(stopped.last_checkpoint, (dir / "run" / "checkpoint-5").string());
  EXPECT_EQ(resolve_checkpoint((dir / "run").string()), (dir / "run" / "checkpoint-5").string());
  train_options second = run_on_gpu((dir / "run").string());
  second.resume_dir = (dir / "run").string();
  const train_summary resumed = train(second, nullptr);
  ASSERT_EQ(resumed.steps.size(), 7u);
  EXPECT_EQ(resumed.run_id, stopped.run_id);
  for (std::size_t i = 0; i < 7; ++i)
    EXPECT_LT(std::abs(resumed.steps[i].loss - whole.steps[5 + i].loss) / whole.steps[5 + i].loss, bf16_tolerance)
        << "step " << 6 + i;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace upipe
