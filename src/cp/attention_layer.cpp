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
  project_output(ctx, w, y, mode);
  return ctx;
}

void attention_layer::project_output(const context& ctx, const attention_weights& w, const mat_view& y,
                                     projection_mode mode) {
  const float beta = mode == projection_mode::accumulate ? 1.0f : 0.0f;
  const phase_scope phase(be_, "attn_out_proj");
  linear_forward(be_, ctx.out.matrix(), w.wo, y, beta);
}

tensor attention_layer::output_backward(const context& ctx, const attention_weights& w, const mat_view& d_y,
                                       const attention_grads& grads) {
  tensor d_out = be_.allocate(mem_tag::activations, be_.work_dtype(), ctx.out.dims(), "attn_d_out");
  const phase_scope phase(be_, "attn_out_proj");
  linear_backward(be_, ctx.out.matrix(), d_y, w.wo, grads.wo, d_out.matrix(), 0.0f);
  return d_out;
}

void attention_layer::backward(const context& ctx, const normed_input& x, const attention_weights& w,
                               const mat_view& d_y, const mat_view& d_x, const attention_grads& grads) {
  const tensor d_out = output_backward(ctx, w, d_y, grads);
  strategy_->backward(ctx.saved, x, w, ctx.out.matrix(), d_out.matrix(), d_x, grads);
}

void attention_layer::backward(const context& ctx, const normed_input& x, const attention_weights& w, tensor&& d_y,
                               const mat_view& d_x, const attention_grads& grads) {
  const tensor d_out = output_backward(ctx, w, d_y.matrix(), grads);
  d_y.reset();
  strategy_->backward(ctx.saved, x, w, ctx.out.matrix(), d_out.matrix(), d_x, grads);
}

}  // namespace upipe
