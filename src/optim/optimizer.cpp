// The learning-rate schedule and the global-norm clipping coefficient; the AdamW step
// itself is the op ops::adamw.
#include "optim/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include "core/error.hpp"

namespace upipe {

// Warmup reaches the peak at step warmup_steps exactly; the cosine starts there, so the
// two pieces meet without a jump. Past total_steps the final value holds, and a schedule
// no longer than its warmup stays at the peak.
double scheduled_lr(const adamw_config& config, std::int64_t step) {
  UPIPE_CHECK(step >= 1, "scheduled_lr: step " + std::to_string(step) + " must be >= 1 (steps count from 1)");
  const std::int64_t warmup = std::max<std::int64_t>(config.warmup_steps, 0);
  if (warmup > 0 && step <= warmup) return config.lr * static_cast<double>(step) / static_cast<double>(warmup);
  if (config.total_steps <= warmup) return config.lr;
  const double progress = std::clamp(
      static_cast<double>(step - warmup) / static_cast<double>(config.total_steps - warmup), 0.0, 1.0);
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return config.lr * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine);
}

// As torch.nn.utils.clip_grad_norm_: the 1e-6 keeps a zero norm finite, and a NaN norm
// gives a NaN coefficient (std::min would turn it into 1 and hide it).
double clip_coefficient(const adamw_config& config, double grad_norm) {
  if (config.max_grad_norm <= 0.0) return 1.0;
  const double coefficient = config.max_grad_norm / (grad_norm + 1e-6);
  return coefficient > 1.0 ? 1.0 : coefficient;
}

}  // namespace upipe
