// scheduled_lr: linear warmup, the peak at the end of warmup, the cosine's midpoint and
// end, the final value held past the end, no warmup, a schedule no longer than its
// warmup. clip_coefficient: disabled, below and above the threshold, zero, inf and NaN.
#include "optim/optimizer.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>

#include "core/error.hpp"

namespace upipe {
namespace {

adamw_config schedule(double lr, std::int64_t warmup, std::int64_t total, double min_ratio) {
  adamw_config c;
  c.lr = lr;
  c.warmup_steps = warmup;
  c.total_steps = total;
  c.min_lr_ratio = min_ratio;
  return c;
}

TEST(scheduled_lr, warmup_is_linear_from_lr_over_warmup) {
  const adamw_config c = schedule(6e-4, 10, 110, 0.1);
  for (std::int64_t step = 1; step <= 10; ++step)
    EXPECT_DOUBLE_EQ(scheduled_lr(c, step), 6e-4 * static_cast<double>(step) / 10.0) << "step " << step;
  EXPECT_DOUBLE_EQ(scheduled_lr(c, 1), 6e-5);
}

TEST(scheduled_lr, peaks_at_the_end_of_warmup_then_decays) {
  const adamw_config c = schedule(6e-4, 10, 110, 0.1);
  EXPECT_DOUBLE_EQ(scheduled_lr(c, 10), 6e-4);
  EXPECT_DOUBLE_EQ(scheduled_lr(c, 11), 6e-4);  // the decay's step 0, as transformers counts it
  EXPECT_GT(scheduled_lr(c, 12), 6e-4 * 0.999);  // no jump where the pieces meet
  for (std::int64_t step = 12; step <= 111; ++step)
    EXPECT_LT(scheduled_lr(c, step), scheduled_lr(c, step - 1)) << "step " << step;
}

TEST(scheduled_lr, cosine_midpoint_end_and_beyond) {
  const double lr = 6e-4, min_ratio = 0.1;
  const adamw_config c = schedule(lr, 10, 110, min_ratio);
  EXPECT_DOUBLE_EQ(scheduled_lr(c, 61), (1.0 + min_ratio) / 2.0 * lr);  // progress 1/2
  // progress 1/4: cos(pi/4) = sqrt(2)/2.
  EXPECT_DOUBLE_EQ(scheduled_lr(c, 36), lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + std::sqrt(0.5))));
  // The last step short of the floor (progress 99/100), the floor after it.
  EXPECT_GT(scheduled_lr(c, 110), min_ratio * lr);
  EXPECT_DOUBLE_EQ(scheduled_lr(c, 110),
                   lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + std::cos(std::numbers::pi * 0.99))));
  EXPECT_DOUBLE_EQ(scheduled_lr(c, 111), min_ratio * lr);
  EXPECT_DOUBLE_EQ(scheduled_lr(c, 100000), min_ratio * lr);
}

// As transformers' get_cosine_schedule_with_warmup(num_warmup_steps=0) at its steps 0, 49, 99.
TEST(scheduled_lr, without_warmup_starts_at_the_peak_and_no_step_runs_at_zero) {
  const double lr = 1e-3;
  const adamw_config c = schedule(lr, 0, 100, 0.0);
  EXPECT_DOUBLE_EQ(scheduled_lr(c, 1), lr);
  EXPECT_DOUBLE_EQ(scheduled_lr(c, 51), 0.5 * lr);
  EXPECT_NEAR(scheduled_lr(c, 100), lr * 0.5 * (1.0 + std::cos(std::numbers::pi * 0.99)), 1e-18);
  EXPECT_GT(scheduled_lr(c, 100), 0.0);
  EXPECT_EQ(scheduled_lr(c, 101), 0.0);
  EXPECT_EQ(scheduled_lr(c, 150), 0.0);
}

// --steps 1 (and any short run): the fine-tune's warm-up ratio 0.03 rounds to no warm-up,
// and the one step runs at the peak, never at the floor of 0.
TEST(scheduled_lr, a_short_run_never_runs_a_step_at_the_floor) {
  for (std::int64_t total = 1; total <= 40; ++total) {
    const adamw_config c = schedule(2e-5, total * 3 / 100, total, 0.0);
    EXPECT_DOUBLE_EQ(scheduled_lr(c, 1), c.warmup_steps > 0 ? 2e-5 / static_cast<double>(c.warmup_steps) : 2e-5);
    for (std::int64_t step = 1; step <= total; ++step) EXPECT_GT(scheduled_lr(c, step), 0.0) << total << " " << step;
  }
}

TEST(scheduled_lr, a_schedule_within_its_warmup_holds_the_peak_after_it) {
  const adamw_config c = schedule(2e-4, 20, 10, 0.1);
  EXPECT_DOUBLE_EQ(scheduled_lr(c, 5), 5e-5);
  EXPECT_DOUBLE_EQ(scheduled_lr(c, 20), 2e-4);
  EXPECT_DOUBLE_EQ(scheduled_lr(c, 21), 2e-4);
  EXPECT_DOUBLE_EQ(scheduled_lr(schedule(2e-4, 20, 20, 0.1), 30), 2e-4);
  EXPECT_DOUBLE_EQ(scheduled_lr(schedule(2e-4, 0, 1, 0.1), 1), 2e-4);  // the default total of 1: the peak
}

TEST(scheduled_lr, steps_count_from_one) {
  EXPECT_THROW(scheduled_lr(schedule(1e-3, 10, 100, 0.1), 0), internal_error);
}

TEST(clip_coefficient, disabled_by_a_non_positive_max_norm) {
  adamw_config c;
  c.max_grad_norm = 0.0;
  EXPECT_EQ(clip_coefficient(c, 1e6), 1.0);
  c.max_grad_norm = -1.0;
  EXPECT_EQ(clip_coefficient(c, 1e6), 1.0);
}

TEST(clip_coefficient, scales_only_norms_above_the_threshold) {
  adamw_config c;
  c.max_grad_norm = 1.0;
  EXPECT_EQ(clip_coefficient(c, 0.5), 1.0);
  EXPECT_EQ(clip_coefficient(c, 0.0), 1.0);
  EXPECT_EQ(clip_coefficient(c, 1.0), 1.0 / (1.0 + 1e-6));  // just under 1, as in PyTorch
  EXPECT_DOUBLE_EQ(clip_coefficient(c, 4.0), 1.0 / (4.0 + 1e-6));
  c.max_grad_norm = 2.5;
  EXPECT_DOUBLE_EQ(clip_coefficient(c, 10.0), 2.5 / (10.0 + 1e-6));
  EXPECT_EQ(clip_coefficient(c, std::numeric_limits<double>::infinity()), 0.0);
}

TEST(clip_coefficient, a_nan_norm_stays_visible) {
  adamw_config c;
  c.max_grad_norm = 1.0;
  EXPECT_TRUE(std::isnan(clip_coefficient(c, std::numeric_limits<double>::quiet_NaN())));
}

}  // namespace
}  // namespace upipe
