// What the training tests share: the losses of a run, step by step.
#pragma once

#include <vector>

#include "train/trainer.hpp"

namespace upipe {

inline std::vector<double> losses(const train_options& o) {
  std::vector<double> out;
  for (const step_record& r : train(o, nullptr).steps) out.push_back(r.loss);
  return out;
}

}  // namespace upipe
