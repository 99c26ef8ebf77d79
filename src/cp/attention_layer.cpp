#include "cp/attention_layer.hpp"

#include "backend/ops.hpp"

namespace upipe {

attention_layer::attention_layer(const attention_config& config, backend& be, const cp_groups& groups)
    : config_(config), be_(be) {
  validate(config_);
  strategy_ = make_strategy(config_, be, groups);
}

attention_layer::context attention_layer::forward(const mat_view& x, const attention_weights& w, const mat_view& y,
                                                  projection_mode mode) {
  context ctx;
  ctx.out = be_.allocate(mem_tag::activations, be_.work_dtype(),
                         {config_.local_tokens(), std::int64_t{config_.heads} * config_.head_dim}, "attn_out");
  ctx.saved = strategy_->forward(x, w, ctx.out.matrix());
  project_output(ctx, x, w, y, mode);
  return ctx;
}

void attention_layer::project_output(const context& ctx, const normed_input& x, const attention_weights& w,
                                     const mat_view& y, projection_mode mode) {
  const float beta = mode == projection_mode::accumulate ? 1.0f : 0.0f;
  const phase_scope phase(be_, "attn_out_proj");
  if (!w.gated()) {
    linear_forward(be_, ctx.out.matrix(), w.wo, y, beta);
    return;
  }
  // y (+)= (out * sigmoid(x W_gate^T)) W_o^T, a tile of rows at a time.
  for_each_input_tile(be_, x, [&](std::int64_t first, const mat_view& rows) {
    const std::int64_t n = rows.rows, width = ctx.out.dims()[1];
    tensor gate = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, width}, "attn_gate");
    linear_forward(be_, rows, w.gate, gate.matrix());
    ops::swiglu_forward(be_, {gate.matrix(), ctx.out.matrix().row_block(first, n), gate.matrix(),
                              gate_activation::sigmoid});
    linear_forward(be_, gate.matrix(), w.wo, y.row_block(first, n), beta);
  });
}

tensor attention_layer::output_backward(const context& ctx, const normed_input& x, const attention_weights& w,
                                        const mat_view& d_y, const mat_view& d_x, const attention_grads& grads) {
  if (w.gated()) return gated_output_backward(ctx, x, w, d_y, d_x, grads);
  tensor d_out = be_.allocate(mem_tag::activations, be_.work_dtype(), ctx.out.dims(), "attn_d_out");
  const phase_scope phase(be_, "attn_out_proj");
  linear_backward(be_, ctx.out.matrix(), d_y, w.wo, grads.wo, d_out.matrix(), 0.0f);
  return d_out;
}

// With g = x W_gate^T and p = out * sigmoid(g): dW_o += d_y^T p, d_p = d_y W_o, then
// d_out = d_p sigmoid(g) and d_g = d_p out sigmoid'(g), whose projection's backward adds
// into d_x and the gate's weight gradient.
tensor attention_layer::gated_output_backward(const context& ctx, const normed_input& x, const attention_weights& w,
                                              const mat_view& d_y, const mat_view& d_x,
                                              const attention_grads& grads) {
  const phase_scope phase(be_, "attn_out_proj");
  const std::int64_t s = ctx.out.dims()[0], width = ctx.out.dims()[1];
  tensor gate = be_.allocate(mem_tag::activations, be_.work_dtype(), {s, width}, "attn_gate");
  for_each_input_tile(be_, x, [&](std::int64_t first, const mat_view& rows) {
    linear_forward(be_, rows, w.gate, gate.matrix().row_block(first, rows.rows));
  });
  tensor d_gated = be_.allocate(mem_tag::activations, be_.work_dtype(), {s, width}, "attn_d_gated");
  {
    tensor gated = be_.allocate(mem_tag::activations, be_.work_dtype(), {s, width}, "attn_gated");
    ops::swiglu_forward(be_, {gate.matrix(), ctx.out.matrix(), gated.matrix(), gate_activation::sigmoid});
    linear_backward(be_, gated.matrix(), d_y, w.wo, grads.wo, d_gated.matrix(), 0.0f);
  }
  tensor d_out = be_.allocate(mem_tag::activations, be_.work_dtype(), {s, width}, "attn_d_out");
  // In place: the gate becomes its gradient.
  ops::swiglu_backward(be_, {gate.matrix(), ctx.out.matrix(), d_gated.matrix(), gate.matrix(), d_out.matrix(),
                             gate_activation::sigmoid});
  d_gated.reset();
  projection_backward pass(be_, w.gate, grads.gate, s);
  pass.input_grad(gate.matrix(), 0, d_x);
  pass.finish_input_grad(d_x);
  if (pass.trains())
    for_each_input_tile(be_, x, [&](std::int64_t first, const mat_view& rows) {
      pass.start_tile(first, rows);
      pass.weight_grad(gate.matrix().row_block(first, rows.rows), 0);
    });
  return d_out;
}

void attention_layer::backward(const context& ctx, const normed_input& x, const attention_weights& w,
                               const mat_view& d_y, const mat_view& d_x, const attention_grads& grads) {
  const tensor d_out = output_backward(ctx, x, w, d_y, d_x, grads);
  strategy_->backward(ctx.saved, x, w, ctx.out.matrix(), d_out.matrix(), d_x, grads);
}

void attention_layer::backward(const context& ctx, const normed_input& x, const attention_weights& w, tensor&& d_y,
                               const mat_view& d_x, const attention_grads& grads) {
  const tensor d_out = output_backward(ctx, x, w, d_y.matrix(), d_x, grads);
  d_y.reset();
  strategy_->backward(ctx.saved, x, w, ctx.out.matrix(), d_out.matrix(), d_x, grads);
}

}  // namespace upipe
