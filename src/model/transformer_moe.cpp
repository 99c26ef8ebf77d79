// The transformer's sparse layers (model/moe_mlp.hpp) and the load-balancing loss over the
// whole sequence: transformers' load_balancing_loss_func, E sum_e (c_e / R) (p_e / R), where
// over every sparse layer and every counted token of the sequence c_e counts the tokens
// routed to expert e (each of its k choices), p_e sums the router's probabilities of e and
// R counts the rows. Each rank counts its own tokens; the sums over the CP group are exact
// (fp64, gathered), so the loss and its gradient E c_e / R^2 on every probability are the
// whole sequence's, not an approximation.
#include <algorithm>

#include "backend/ops.hpp"
#include "core/error.hpp"
#include "model/transformer.hpp"

namespace upipe {

router_aux_loss parse_router_aux_loss(std::string_view text) {
  if (text == "config") return router_aux_loss::config;
  if (text == "on") return router_aux_loss::on;
  if (text == "off") return router_aux_loss::off;
  throw config_error("--router-aux-loss '" + std::string(text) + "' is not one of config (as config.json's "
                     "output_router_logits says), on or off; for example --router-aux-loss on");
}

void transformer::moe_forward(const layer_params& p, const tensor& x) {
  const phase_scope phase(be_, "mlp");
  const std::int64_t D = model_.hidden_size;
  for (std::int64_t t0 = 0; t0 < tokens_; t0 = next_tile(t0, mlp_tile_)) {
    const std::int64_t n = std::min(mlp_tile_, tokens_ - t0);
    const mat_view xt = x.matrix().row_block(t0, n);
    tensor h = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, D}, "mlp_norm_out");
    tensor rstd = be_.allocate(mem_tag::activations, dtype::f32, {n, 1}, "mlp_norm_rstd");
    ops::rmsnorm_forward(be_, {xt, p.mlp_norm, h.matrix(), rstd.matrix(), norm_eps(), norm_offset()});
    rstd.reset();
    const bool collect = collect_balance_ && aux_on_;
    const std::span<const std::uint8_t> counted =
        collect ? std::span<const std::uint8_t>(counted_rows_).subspan(static_cast<std::size_t>(t0), static_cast<std::size_t>(n))
                : std::span<const std::uint8_t>();
    moe_.forward(p.moe, h.matrix(), xt, counted, collect ? &balance_ : nullptr);
  }
}

// d (f32) holds d(layer output) and becomes d(x2), as the dense MLP's backward.
void transformer::moe_backward(const layer_params& p, const layer_gradients& g, const tensor& x2, const tensor& d) {
  const phase_scope phase(be_, "mlp");
  const std::int64_t D = model_.hidden_size;
  for (std::int64_t t0 = 0; t0 < tokens_; t0 = next_tile(t0, mlp_tile_)) {
    const std::int64_t n = std::min(mlp_tile_, tokens_ - t0);
    const mat_view xt = x2.matrix().row_block(t0, n), dt = d.matrix().row_block(t0, n);
    tensor h = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, D}, "mlp_norm_out");
    tensor rstd = be_.allocate(mem_tag::activations, dtype::f32, {n, 1}, "mlp_norm_rstd");
    ops::rmsnorm_forward(be_, {xt, p.mlp_norm, h.matrix(), rstd.matrix(), norm_eps(), norm_offset()});
    tensor d_h = be_.allocate(mem_tag::activations, dtype::f32, {n, D}, "mlp_d_norm_out");
    const std::span<const std::uint8_t> counted =
        aux_on_ ? std::span<const std::uint8_t>(counted_rows_).subspan(static_cast<std::size_t>(t0), static_cast<std::size_t>(n))
                : std::span<const std::uint8_t>();
    moe_.backward(p.moe, g.moe, h.matrix(), dt, d_h.matrix(), counted, aux_on_ ? &aux_grad_ : nullptr);
    h.reset();
    ops::rmsnorm_backward(be_, {xt, p.mlp_norm, rstd.matrix(), d_h.matrix(), d_h.matrix(), g.mlp_norm, norm_offset()});
    ops::add_heads(be_, ops::as_heads(dt), ops::as_heads(d_h.matrix()));
  }
}

// The local rows that count: the sequence's own tokens, not the padding past real_tokens.
void transformer::start_balance(const local_batch& batch) {
  aux_loss_ = 0;
  if (!aux_on_) return;
  counted_rows_.assign(static_cast<std::size_t>(tokens_), 1);
  if (batch.real_tokens > 0)
    for (const position_run& run : local_positions(cp_comm_->rank()))
      for (std::int64_t i = 0; i < run.count; ++i)
        counted_rows_[static_cast<std::size_t>(run.token_begin + i)] = run.position_begin + i < batch.real_tokens ? 1 : 0;
  balance_.reset(model_.moe.experts);
  collect_balance_ = true;
}

void transformer::finish_balance(double aux_scale) {
  collect_balance_ = false;
  if (!aux_on_) return;
  const auto E = static_cast<std::size_t>(model_.moe.experts);
  aux_grad_ = be_.allocate(mem_tag::activations, dtype::f32, {1, static_cast<std::int64_t>(E)}, "moe_aux_grad");
  if (!be_.has_data()) return;
  // This rank's counts, probability sums and rows, gathered from every rank and summed in fp64.
  std::vector<double> mine(2 * E + 1);
  std::copy(balance_.counts.begin(), balance_.counts.end(), mine.begin());
  std::copy(balance_.prob_sums.begin(), balance_.prob_sums.end(), mine.begin() + static_cast<std::ptrdiff_t>(E));
  mine[2 * E] = balance_.rows;
  const auto ranks = static_cast<std::size_t>(cp_comm_->size());
  std::vector<double> all(mine.size() * ranks);
  cp_comm_->all_gather(mine.data(), all.data(), mine.size() * sizeof(double), "router_balance");
  std::vector<double> total(mine.size(), 0.0);
  for (std::size_t r = 0; r < ranks; ++r)
    for (std::size_t i = 0; i < mine.size(); ++i) total[i] += all[r * mine.size() + i];
  const double rows = total[2 * E];
  std::vector<float> grad(E, 0.0f);
  if (rows > 0) {
    double sum = 0;
    for (std::size_t e = 0; e < E; ++e) sum += total[e] * total[E + e];
    const double experts = static_cast<double>(E);
    aux_loss_ = experts * sum / (rows * rows);
    for (std::size_t e = 0; e < E; ++e)
      grad[e] = static_cast<float>(aux_scale * model_.moe.router_aux_loss_coef * experts * total[e] / (rows * rows));
  }
  be_.upload_f32(aux_grad_, grad.data());
}

}  // namespace upipe
