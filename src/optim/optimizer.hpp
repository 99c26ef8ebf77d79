// AdamW on flat fp32 shards, the learning-rate schedule and gradient clipping helpers.
#pragma once

#include <cstdint>

namespace upipe {

struct adamw_config {
  double lr = 1e-3;            // peak learning rate
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;   // decoupled; applied only where the caller asks
  double max_grad_norm = 1.0;  // global-norm clipping; <= 0 disables
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 1;  // the schedule's length (--steps)
  double min_lr_ratio = 0.1;     // cosine decays to lr * min_lr_ratio
};

// Linear warmup over warmup_steps (step 1 gets lr/warmup), then cosine decay from the peak
// (the first step after the warm-up) towards lr * min_lr_ratio, reached the step after
// total_steps (transformers' cosine schedule, its steps counted from 0). Steps count from 1.
double scheduled_lr(const adamw_config& config, std::int64_t step);

// Clipping coefficient for a global gradient norm: min(1, max / (norm + 1e-6)).
double clip_coefficient(const adamw_config& config, double grad_norm);

}  // namespace upipe
