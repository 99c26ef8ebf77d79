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

void transformer::moe_forward(int layer, const layer_params& p, const tensor& x) {
  const phase_scope phase(be_, "mlp");
  const std::int64_t D = model_.hidden_size;
  const bool collect = collect_balance_ && aux_on_;
  for (std::int64_t t0 = 0; t0 < tokens_; t0 = next_tile(t0, mlp_tile_)) {
    const std::int64_t n = std::min(mlp_tile_, tokens_ - t0);
    const mat_view xt = x.matrix().row_block(t0, n);
    tensor h = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, D}, "mlp_norm_out");
    tensor rstd = be_.allocate(mem_tag::activations, dtype::f32, {n, 1}, "mlp_norm_rstd");
    ops::rmsnorm_forward(be_, {xt, p.mlp_norm, h.matrix(), rstd.matrix(), norm_eps(), norm_offset()});
    rstd.reset();
    moe_mlp::tile at;
    at.layer = layer;
    at.first = t0;
    if (collect) {
      at.counted = counted_.matrix().row_block(t0, n);
      at.balance = &balance_;
      const auto first = counted_rows_.begin() + t0;
      balance_rows_ += static_cast<double>(std::count(first, first + n, std::uint8_t{1}));
    }
    moe_.forward(p.moe, at, h.matrix(), xt);
  }
}

// d (f32) holds d(layer output) and becomes d(x2), as the dense MLP's backward.
void transformer::moe_backward(int layer, const layer_params& p, const layer_gradients& g, const tensor& x2,
                               const tensor& d) {
  const phase_scope phase(be_, "mlp");
  const std::int64_t D = model_.hidden_size;
  for (std::int64_t t0 = 0; t0 < tokens_; t0 = next_tile(t0, mlp_tile_)) {
    const std::int64_t n = std::min(mlp_tile_, tokens_ - t0);
    const mat_view xt = x2.matrix().row_block(t0, n), dt = d.matrix().row_block(t0, n);
    tensor h = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, D}, "mlp_norm_out");
    tensor rstd = be_.allocate(mem_tag::activations, dtype::f32, {n, 1}, "mlp_norm_rstd");
    ops::rmsnorm_forward(be_, {xt, p.mlp_norm, h.matrix(), rstd.matrix(), norm_eps(), norm_offset()});
    tensor d_h = be_.allocate(mem_tag::activations, dtype::f32, {n, D}, "mlp_d_norm_out");
    moe_mlp::tile at;
    at.layer = layer;
    at.first = t0;
    if (aux_on_) {
      at.counted = counted_.matrix().row_block(t0, n);
      at.aux_grad = &aux_grad_;
    }
    moe_.backward(p.moe, g.moe, at, h.matrix(), dt, d_h.matrix());
    h.reset();
    ops::rmsnorm_backward(be_, {xt, p.mlp_norm, rstd.matrix(), d_h.matrix(), d_h.matrix(), g.mlp_norm, norm_offset()});
    ops::add_heads(be_, ops::as_heads(dt), ops::as_heads(d_h.matrix()));
  }
}

// The local rows that count: the sequence's own tokens, not the padding past real_tokens;
// on the device too, with the step's sums zeroed there.
void transformer::start_balance(const local_batch& batch) {
  aux_loss_ = 0;
  if (!aux_on_) return;
  counted_rows_.assign(static_cast<std::size_t>(tokens_), 1);
  if (batch.real_tokens > 0)
    for (const position_run& run : local_positions(cp_comm_->rank()))
      for (std::int64_t i = 0; i < run.count; ++i)
        counted_rows_[static_cast<std::size_t>(run.token_begin + i)] = run.position_begin + i < batch.real_tokens ? 1 : 0;
  counted_ = be_.allocate(mem_tag::activations, dtype::u8, {tokens_, 1}, "moe_counted_rows");
  be_.upload_bytes(counted_, counted_rows_.data(), counted_rows_.size());
  balance_ = be_.allocate_zeroed(mem_tag::activations, dtype::i32, {1, 4 * std::int64_t{model_.moe.experts}}, "moe_balance");
  balance_rows_ = 0;
  collect_balance_ = true;
}

void transformer::finish_balance(double aux_scale) {
  collect_balance_ = false;
  if (!aux_on_) return;
  const auto E = static_cast<std::size_t>(model_.moe.experts);
  aux_grad_ = be_.allocate(mem_tag::activations, dtype::f32, {1, static_cast<std::int64_t>(E)}, "moe_aux_grad");
  if (!be_.has_data()) {
    balance_.reset();
    return;
  }
  // This rank's counts, probability sums and rows (one read of the device's sums a step),
  // gathered from every rank and summed in fp64.
  const router_balance mine_sums = read_router_balance(be_, balance_, model_.moe.experts);
  balance_.reset();
  std::vector<double> mine(2 * E + 1);
  std::copy(mine_sums.counts.begin(), mine_sums.counts.end(), mine.begin());
  std::copy(mine_sums.prob_sums.begin(), mine_sums.prob_sums.end(), mine.begin() + static_cast<std::ptrdiff_t>(E));
  mine[2 * E] = balance_rows_;
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
