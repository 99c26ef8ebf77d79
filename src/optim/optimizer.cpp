// The learning-rate schedule and the global-norm clipping coefficient; the AdamW step
// itself is the op ops::adamw.
#include "optim/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include "core/error.hpp"

namespace upipe {

// Warm-up step s of W runs at lr * s / W: the first is never 0 (transformers' schedules run
// their first step at 0) and step W at the peak. The decay then counts its steps from 0 as
// transformers' get_cosine_schedule_with_warmup does: the first after the warm-up at the
// peak, and the last of total_steps short of the floor, which the step after it would
// reach (so no step runs at lr * min_lr_ratio, an lr of 0 in a fine-tune, and a run of one
// step runs at the peak). Past total_steps the floor holds; a schedule no longer than its
// warm-up stays at the peak.
double scheduled_lr(const adamw_config& config, std::int64_t step) {
  UPIPE_CHECK(step >= 1, "scheduled_lr: step " + std::to_string(step) + " must be >= 1 (steps count from 1)");
  const std::int64_t warmup = std::max<std::int64_t>(config.warmup_steps, 0);
  if (warmup > 0 && step <= warmup) return config.lr * static_cast<double>(step) / static_cast<double>(warmup);
  if (config.total_steps <= warmup) return config.lr;
  const double progress = std::clamp(
      static_cast<double>(step - warmup - 1) / static_cast<double>(config.total_steps - warmup), 0.0, 1.0);
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
