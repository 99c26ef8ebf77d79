// Training on the CPU backend: the same losses under every CP strategy and ZeRO stage,
// and a stopped-and-resumed run that is bit-identical to an uninterrupted one.
#include <gtest/gtest.h>

#include <filesystem>

#include "core/error.hpp"
#include "train/trainer.hpp"

namespace upipe {
namespace {

train_options base(strategy_kind kind, int cp, int chunk, zero_stage zero) {
  train_options o;
  o.model = preset("tiny-llama");
  o.seq_len = 64;
  o.cp = {kind, cp, chunk};
  o.zero = zero;
  o.optim.lr = 3e-3;
  o.optim.total_steps = 20;
  o.optim.warmup_steps = 5;
  o.seed = 7;
  o.eval_samples = 0;
  o.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
  return o;
}

std::vector<double> losses(const train_options& o) {
  std::vector<double> out;
  for (const step_record& r : train(o, nullptr).steps) out.push_back(r.loss);
  return out;
}

TEST(trainer, twenty_steps_agree_across_strategies_and_zero_stages) {
  const std::vector<double> reference = losses(base(strategy_kind::upipe, 1, 0, zero_stage::two));
  ASSERT_EQ(reference.size(), 20u);
  EXPECT_LT(reference.back(), 0.7 * reference.front());  // it learns
  std::vector<train_options> runs;
  for (int cp : {2, 4})
    for (zero_stage z : {zero_stage::two, zero_stage::three}) {
      runs.push_back(base(strategy_kind::ulysses, cp, 0, z));
      runs.push_back(base(strategy_kind::ring, cp, 0, z));
      for (int u : valid_head_chunks(4, cp)) runs.push_back(base(strategy_kind::upipe, cp, u, z));
    }
  for (const train_options& o : runs) {
    const std::vector<double> got = losses(o);
    ASSERT_EQ(got.size(), reference.size());
    for (std::size_t i = 0; i < got.size(); ++i)
      EXPECT_LT(std::abs(got[i] - reference[i]) / reference[i], 1e-4)
          << strategy_name(o.cp.strategy) << " C=" << o.cp.cp << " U=" << o.cp.head_chunk << " zero="
          << (o.zero == zero_stage::three ? 3 : 2) << " step " << i + 1;
  }
}

TEST(trainer, stop_save_and_resume_is_bit_identical) {
  const auto dir = std::filesystem::temp_directory_path() / ("upipe_resume_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  for (zero_stage z : {zero_stage::two, zero_stage::three}) {
    const train_options whole = base(strategy_kind::upipe, 2, 0, z);
    const std::vector<double> uninterrupted = losses(whole);
    train_options first = whole;
    first.stop_after = 10;
    first.save_dir = dir.string();
    EXPECT_EQ(losses(first).size(), 10u);
    train_options second = whole;
    second.resume_dir = dir.string();
    const std::vector<double> resumed = losses(second);
    ASSERT_EQ(resumed.size(), 10u);
    for (std::size_t i = 0; i < 10; ++i) EXPECT_EQ(resumed[i], uninterrupted[10 + i]) << "step " << 11 + i;
    std::filesystem::remove_all(dir);
  }
}

TEST(trainer, resume_with_a_different_cp_layout_follows_the_same_schedule) {
  // The checkpoint holds whole tensors, so it can be resumed on another group size.
  const auto dir = std::filesystem::temp_directory_path() / ("upipe_reshard_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const std::vector<double> uninterrupted = losses(base(strategy_kind::upipe, 2, 0, zero_stage::two));
  train_options first = base(strategy_kind::upipe, 2, 0, zero_stage::two);
  first.stop_after = 10;
  first.save_dir = dir.string();
  losses(first);
  train_options second = base(strategy_kind::ring, 4, 0, zero_stage::three);
  second.resume_dir = dir.string();
  const std::vector<double> resumed = losses(second);
  for (std::size_t i = 0; i < 10; ++i) EXPECT_LT(std::abs(resumed[i] - uninterrupted[10 + i]) / uninterrupted[10 + i], 1e-4);
  std::filesystem::remove_all(dir);
}

TEST(trainer, contradictory_options_are_refused) {
  train_options o = base(strategy_kind::upipe, 2, 0, zero_stage::two);
  o.stop_after = 30;
  EXPECT_THROW(validate(o), config_error);
  o = base(strategy_kind::upipe, 2, 0, zero_stage::two);
  o.save_every = 5;
  EXPECT_THROW(validate(o), config_error);
  o = base(strategy_kind::upipe, 2, 0, zero_stage::two);
  o.resume_dir = "x";
  o.init_path = "y";
  EXPECT_THROW(validate(o), config_error);
  o = base(strategy_kind::ring, 4, 0, zero_stage::two);
  o.seq_len = 60;
  EXPECT_THROW(validate(o), config_error);
  o = base(strategy_kind::upipe, 2, 0, zero_stage::two);
  o.seq_len = 10;  // shorter than the passkey task's minimum
  EXPECT_THROW(validate(o), config_error);
}

}  // namespace
}  // namespace upipe
