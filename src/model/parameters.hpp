// Views of one decoder layer's parameters (or gradients) under Hugging Face names.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "cp/strategy.hpp"
#include "model/config.hpp"

namespace upipe {

struct layer_params {
  mat_view input_norm;          // (1, D)
  attention_weights attention;  // q/k/v/o projections (+ q_norm, k_norm for Qwen3)
  mat_view post_norm;           // (1, D)
  projection gate, up;          // (F, D)
  projection down;              // (D, F)
};

// A layer's gradients, f32, accumulated; a frozen weight's are empty (no rows).
struct layer_gradients {
  mat_view input_norm;
  attention_grads attention;
  mat_view post_norm;
  projection_grads gate, up, down;
};

// The layer of a tensor named "model.layers.N. ...": N when it is written as a layer's name
// is (decimal digits, no leading zero, within 64 bits), -1 when it is not ("01", "-1",
// 99999999999999999999: no layer's, never read as another one), nothing for a tensor
// outside the layers.
std::optional<std::int64_t> layer_of(std::string_view name);

// Layer `index`'s views, each looked up by its Hugging Face name.
layer_params make_layer_params(const model_config& config, int index,
                               const std::function<mat_view(const std::string&)>& view);

// The gradients of a layer whose views make_layer_params looked up in a store's gradients.
layer_gradients as_gradients(const layer_params& g);

}  // namespace upipe
