// The Gated DeltaNet layer's shared parts (cp/delta_layer.hpp): its configuration's checks,
// the segments of the sequence layouts, the gated RMSNorm and the output projection.
#include "cp/delta_layer.hpp"

#include <algorithm>
#include <numeric>

#include "backend/ops.hpp"
#include "core/error.hpp"
#include "ops/gated_delta/workspace.hpp"

namespace upipe {

bool delta_config::head_layout() const {
  return cp > 1 && (strategy == strategy_kind::ulysses || strategy == strategy_kind::upipe) && seq_chunks <= 1;
}

namespace {

// A stage of x value heads over the group: a multiple of C that divides Hv, whose u = x / C
// value heads a rank hold whole key-head groups or lie inside one.
bool valid_stage(const delta_config& c, int x) {
  if (x < c.cp || x % c.cp != 0 || c.value_heads % x != 0) return false;
  const int u = x / c.cp, group = c.value_heads / std::max(c.key_heads, 1);
  return u % group == 0 || group % u == 0;
}

}  // namespace

// The attention's share of heads (U Hv / H), or the largest valid stage below it, else the
// smallest above: as many stages as the attention's where the shapes allow.
int delta_config::stage_heads(int attention_heads) const {
  const int share = static_cast<int>(std::int64_t{std::max(head_chunk, 1)} * value_heads / std::max(attention_heads, 1));
  for (int x = share; x >= cp; --x)
    if (valid_stage(*this, x)) return x;
  for (int x = share + 1; x <= value_heads; ++x)
    if (valid_stage(*this, x)) return x;
  return 0;
}

void validate(const delta_config& c, int attention_heads) {
  if (!c.head_layout()) return;
  const std::string where = "--attention " + std::string(strategy_name(c.strategy)) + " over " + std::to_string(c.cp) +
                            " ranks";
  if (c.value_heads % c.cp != 0)
    throw config_error(where + " gives each rank whole sequences of a share of the Gated DeltaNet layers' " +
                       std::to_string(c.value_heads) + " value heads (linear_num_value_heads), which " +
                       std::to_string(c.cp) + " does not divide: use a CP size that divides it, or a sequence "
                       "layout (--attention ring, or fpdt)");
  if (c.stage_heads(attention_heads) == 0)
    throw config_error(where + ": no stage of the Gated DeltaNet layers' " + std::to_string(c.value_heads) +
                       " value heads gives each rank whole groups of " +
                       std::to_string(c.value_heads / c.key_heads) + " value heads per key head or a part of one; "
                       "use a sequence layout (--attention ring, or fpdt)");
}

namespace {

// A rank's runs merged where one continues the other in the sequence and in its rows.
std::vector<delta_segment> merged_runs(const std::vector<position_run>& runs) {
  std::vector<delta_segment> out;
  for (const position_run& r : runs) {
    if (r.count == 0) continue;
    if (!out.empty() && out.back().token_begin + out.back().count == r.token_begin &&
        out.back().position_begin + out.back().count == r.position_begin) {
      out.back().count += r.count;
      continue;
    }
    out.push_back(r);
  }
  return out;
}

}  // namespace

delta_layer::delta_layer(const delta_config& config, int attention_heads, backend& be, const cp_groups& groups,
                         std::vector<std::vector<position_run>> layout)
    : config_(config), be_(be), comm_(groups.all_to_all), rank_(groups.all_to_all->rank()) {
  validate(config_, attention_heads);
  UPIPE_CHECK(static_cast<int>(layout.size()) == config_.cp, "delta_layer: a layout for every rank");
  for (const auto& runs : layout) segments_.push_back(merged_runs(runs));
  // Every segment's place in the sequence, rank-major.
  std::vector<std::int64_t> starts;
  for (const auto& segs : segments_)
    for (const delta_segment& s : segs) starts.push_back(s.position_begin);
  std::vector<std::int64_t> by_position(starts.size());
  std::iota(by_position.begin(), by_position.end(), 0);
  std::sort(by_position.begin(), by_position.end(), [&](auto a, auto b) { return starts[a] < starts[b]; });
  order_.resize(starts.size());
  for (std::size_t i = 0; i < by_position.size(); ++i) order_[static_cast<std::size_t>(by_position[i])] = static_cast<std::int64_t>(i);
  if (config_.head_layout()) stage_heads_ = config_.stage_heads(attention_heads);
}

tensor delta_layer::workspace(std::int64_t rows, int key_heads, int value_heads, gated_delta_pass pass) const {
  const gated_delta_shape shape{rows, key_heads, value_heads, config_.key_dim, config_.value_dim};
  const std::int64_t chunks = std::min<std::int64_t>(gated_delta_chunks(rows), 16);
  return be_.allocate(mem_tag::activations, dtype::f32, {1, gated_delta_workspace_floats(shape, pass, chunks)},
                      "delta_workspace");
}

namespace {

// A (s, H dv) matrix as (s H, dv) rows: the gated norm's rows, one per token and value head.
mat_view head_rows(const mat_view& m, std::int64_t d) {
  return {m.data, m.type, m.rows * (m.cols / d), d, d};
}

}  // namespace

// rmsnorm(o) * w * silu(z), per token and value head.
tensor delta_layer::norm_forward(const mat_view& out, const mat_view& z, const delta_weights& w) {
  const std::int64_t dv = config_.value_dim;
  tensor normed = be_.allocate(mem_tag::activations, be_.work_dtype(), {out.rows, out.cols}, "delta_normed");
  tensor rstd = be_.allocate(mem_tag::activations, dtype::f32, {out.rows * config_.value_heads, 1}, "delta_norm_rstd");
  ops::rmsnorm_forward(be_, {head_rows(out, dv), w.norm, head_rows(normed.matrix(), dv), rstd.matrix(), config_.norm_eps,
                             0.0f});
  ops::swiglu_forward(be_, {z, normed.matrix(), normed.matrix(), gate_activation::silu});
  return normed;
}

delta_layer::context delta_layer::forward(const mat_view& x, const delta_weights& w, const mat_view& y,
                                          projection_mode mode) {
  const phase_scope phase(be_, "delta");
  const std::int64_t s = config_.local_tokens();
  context ctx;
  ctx.z = be_.allocate(mem_tag::activations, be_.work_dtype(), {s, config_.value_width()}, "delta_z");
  linear_forward(be_, x, w.z, ctx.z.matrix());
  ctx.out = be_.allocate(mem_tag::activations, be_.work_dtype(), {s, config_.value_width()}, "delta_out");
  if (config_.head_layout())
    heads_forward(ctx, x, w);
  else
    sequence_forward(ctx, x, w);
  const tensor normed = norm_forward(ctx.out.matrix(), ctx.z.matrix(), w);
  linear_forward(be_, normed.matrix(), w.out, y, mode == projection_mode::accumulate ? 1.0f : 0.0f);
  return ctx;
}

// Through the output projection and the gated norm: d_o (s, Hv dv) and the z projection's
// backward, then the layout's own.
void delta_layer::backward(context& ctx, const normed_input& x, const delta_weights& w, tensor&& d_y,
                           const mat_view& d_x, const delta_grads& grads) {
  const phase_scope phase(be_, "delta");
  const std::int64_t s = config_.local_tokens(), width = config_.value_width(), dv = config_.value_dim;
  tensor d_normed = be_.allocate(mem_tag::activations, be_.work_dtype(), {s, width}, "delta_d_normed");
  {
    const tensor normed = norm_forward(ctx.out.matrix(), ctx.z.matrix(), w);
    linear_backward(be_, normed.matrix(), d_y.matrix(), w.out, grads.out, d_normed.matrix(), 0.0f);
  }
  d_y.reset();
  // The norm's output before the gate, recomputed, and the gate's backward in place: z
  // becomes d_z and d_normed the gradient of rmsnorm(o) w.
  tensor pre = be_.allocate(mem_tag::activations, be_.work_dtype(), {s, width}, "delta_normed");
  tensor rstd = be_.allocate(mem_tag::activations, dtype::f32, {s * config_.value_heads, 1}, "delta_norm_rstd");
  ops::rmsnorm_forward(be_, {head_rows(ctx.out.matrix(), dv), w.norm, head_rows(pre.matrix(), dv), rstd.matrix(),
                             config_.norm_eps, 0.0f});
  ops::swiglu_backward(be_, {ctx.z.matrix(), pre.matrix(), d_normed.matrix(), ctx.z.matrix(), d_normed.matrix(),
                             gate_activation::silu});
  pre.reset();
  tensor d_out = be_.allocate(mem_tag::activations, be_.work_dtype(), {s, width}, "delta_d_out");
  ops::rmsnorm_backward(be_, {head_rows(ctx.out.matrix(), dv), w.norm, rstd.matrix(), head_rows(d_normed.matrix(), dv),
                              head_rows(d_out.matrix(), dv), grads.norm, 0.0f});
  rstd.reset();
  d_normed.reset();
  // d_z's projection.
  projection_backward z_pass(be_, w.z, grads.z, s);
  z_pass.input_grad(ctx.z.matrix(), 0, d_x);
  z_pass.finish_input_grad(d_x);
  if (z_pass.trains())
    for_each_input_tile(be_, x, [&](std::int64_t first, const mat_view& rows) {
      z_pass.start_tile(first, rows);
      z_pass.weight_grad(ctx.z.matrix().row_block(first, rows.rows), 0);
    });
  ctx.z.reset();
  ctx.out.reset();
  if (config_.head_layout())
    heads_backward(x, w, d_out.matrix(), d_x, grads);
  else
    sequence_backward(ctx, x, w, d_out.matrix(), d_x, grads);
}

}  // namespace upipe
