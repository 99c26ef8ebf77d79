// What the training tests share: a short run of tiny-llama, and a run's losses step by step.
#pragma once

#include <vector>

#include "model/config.hpp"
#include "train/trainer.hpp"

namespace upipe {

// Four steps of tiny-llama at 64 tokens (lr 3e-3, one warm-up step, seed 7, no held-out
// samples) under `cp` and `zero`, `batch` sequences a step, in arenas of 256 and 64 MiB.
inline train_options four_tiny_steps(const cp_settings& cp, zero_stage zero, std::int64_t batch) {
  train_options o;
  o.model = preset("tiny-llama");
  o.seq_len = 64;
  o.cp = cp;
  o.zero = zero;
  o.batch = batch;
  o.optim.lr = 3e-3;
  o.optim.total_steps = 4;
  o.optim.warmup_steps = 1;
  o.seed = 7;
  o.eval_samples = 0;
  o.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
  return o;
}

inline std::vector<double> losses(const train_options& o) {
  std::vector<double> out;
  for (const step_record& r : train(o, nullptr).steps) out.push_back(r.loss);
  return out;
}

}  // namespace upipe
