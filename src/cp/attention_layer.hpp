// The attention layer under CP: QKV projection, RoPE and attention (the strategy), then
// the output projection, through the hybrids' output gate where the weights have one
// (out * sigmoid(x W_gate^T), the gate made a tile of x at a time). Input and weight
// gradients in backward.
#pragma once

#include <memory>

#include "cp/strategy.hpp"

namespace upipe {

// Whether the output projection overwrites y or adds to it (the residual stream).
enum class projection_mode : std::uint8_t { overwrite, accumulate };

class attention_layer {
 public:
  attention_layer(const attention_config& config, backend& be, const cp_groups& groups);

  // What backward needs besides the layer input.
  struct context {
    tensor out;  // (s, H*d) attention output before the output projection
    attention_saved saved;
  };

  // y (s, D) = attention(x) W_o^T, or y += that with projection_mode::accumulate.
  context forward(const mat_view& x, const attention_weights& w, const mat_view& y,
                  projection_mode mode = projection_mode::overwrite);
  // Only the output projection, from a context whose `out` was kept (a checkpoint that
  // saved the attention output): y (+)= out W_o^T, or through the gate made from x.
  void project_output(const context& ctx, const normed_input& x, const attention_weights& w, const mat_view& y,
                      projection_mode mode);
  // d_x (s, D, f32) and the weight gradients are accumulated.
  void backward(const context& ctx, const normed_input& x, const attention_weights& w, const mat_view& d_y,
                const mat_view& d_x, const attention_grads& grads);
  // The same, freeing d_y once the output projection's backward has read it, so that its
  // bytes are not held through the attention's own backward (the layer's peak).
  void backward(const context& ctx, const normed_input& x, const attention_weights& w, tensor&& d_y,
                const mat_view& d_x, const attention_grads& grads);

  const attention_config& config() const { return config_; }
  const attention_strategy& strategy() const { return *strategy_; }
  attention_strategy& strategy() { return *strategy_; }

 private:
  // dW_o += d_y^T out; returns d_out = d_y W_o. Through a gate: the gate's backward too
  // (its input and weight gradients), d_out the gradient of the ungated output.
  tensor output_backward(const context& ctx, const normed_input& x, const attention_weights& w, const mat_view& d_y,
                         const mat_view& d_x, const attention_grads& grads);
  tensor gated_output_backward(const context& ctx, const normed_input& x, const attention_weights& w,
                               const mat_view& d_y, const mat_view& d_x, const attention_grads& grads);

  attention_config config_;
  backend& be_;
  std::unique_ptr<attention_strategy> strategy_;
};

}  // namespace upipe
