// Views of one decoder layer's parameters (or gradients) under Hugging Face names.
#pragma once

#include <functional>
#include <string>

#include "cp/strategy.hpp"
#include "model/config.hpp"

namespace upipe {

struct layer_params {
  mat_view input_norm;          // (1, D)
  attention_weights attention;  // q/k/v/o projections (+ q_norm, k_norm for Qwen3)
  mat_view post_norm;           // (1, D)
  mat_view gate, up;            // (F, D)
  mat_view down;                // (D, F)
};

// Layer `index`'s views, each looked up by its Hugging Face name.
layer_params make_layer_params(const model_config& config, int index,
                               const std::function<mat_view(const std::string&)>& view);

}  // namespace upipe
