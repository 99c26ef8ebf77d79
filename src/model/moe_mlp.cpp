#include "model/moe_mlp.hpp"

#include <algorithm>

#include "backend/ops.hpp"
#include "core/error.hpp"
#include "model/moe_exchange.hpp"

namespace upipe {

void router_balance::reset(int experts) {
  counts.assign(static_cast<std::size_t>(experts), 0.0);
  prob_sums.assign(static_cast<std::size_t>(experts), 0.0);
  rows = 0;
}

moe_mlp::moe_mlp(const model_config& model, backend& be, communicator* experts) : model_(model), be_(be) {
  if (experts != nullptr && experts->size() > 1) exchange_ = std::make_unique<moe_exchange>(model_, be_, *experts);
}

moe_mlp::~moe_mlp() = default;

tensor working_copy(backend& be, const mat_view& src, const char* label) {
  tensor t = be.allocate(mem_tag::activations, be.work_dtype(), {src.rows, src.cols}, label);
  ops::copy_heads(be, ops::as_heads(t.matrix()), ops::as_heads(src));
  return t;
}

moe_mlp::routing moe_mlp::route(const moe_weights& w, const mat_view& h) {
  const std::int64_t n = h.rows, E = model_.moe.experts, k = model_.moe.top_k;
  routing r;
  tensor logits = be_.allocate(mem_tag::activations, dtype::f32, {n, E}, "moe_router_logits");
  ops::gemm(be_, {h, transpose::none, w.router, transpose::yes, logits.matrix()});
  r.probs = be_.allocate(mem_tag::activations, dtype::f32, {n, E}, "moe_router_probs");
  r.weights = be_.allocate(mem_tag::activations, dtype::f32, {n, k}, "moe_routing_weights");
  r.experts = be_.allocate(mem_tag::activations, dtype::i32, {n, k}, "moe_routing_experts");
  ops::moe_route(be_, {logits.matrix(), r.probs.matrix(), r.weights.matrix(), r.experts.matrix(),
                       model_.moe.normalize_top_k});
  dispatch(r, n);
  return r;
}

// The gathered tile's order: expert by expert, each expert's tokens in order. Without data
// (meta) the rows are spread evenly, which gives the same buffers as any routing: the
// gathered tile is n k rows whatever the routing, and an expert's block at most n.
void moe_mlp::dispatch(routing& r, std::int64_t n) {
  const std::int64_t E = model_.moe.experts, k = model_.moe.top_k, m = n * k;
  r.offsets.assign(static_cast<std::size_t>(E + 1), 0);
  r.index = be_.allocate(mem_tag::activations, dtype::i32, {m, 1}, "moe_dispatch_index");
  r.slot = be_.allocate(mem_tag::activations, dtype::i32, {m, 1}, "moe_dispatch_slot");
  if (!be_.has_data()) {
    for (std::int64_t e = 0; e < E; ++e) r.offsets[static_cast<std::size_t>(e + 1)] = m * (e + 1) / E;
    return;
  }
  r.host_experts.resize(static_cast<std::size_t>(m));
  be_.download_bytes(r.host_experts.data(), r.experts, r.host_experts.size() * sizeof(std::int32_t));
  for (std::int32_t e : r.host_experts) {
    UPIPE_CHECK(e >= 0 && e < E, "moe routing chose expert " + std::to_string(e) + " of " + std::to_string(E));
    ++r.offsets[static_cast<std::size_t>(e + 1)];
  }
  for (std::size_t e = 1; e < r.offsets.size(); ++e) r.offsets[e] += r.offsets[e - 1];
  std::vector<std::int32_t> index(static_cast<std::size_t>(m)), slot(static_cast<std::size_t>(m));
  std::vector<std::int64_t> next(r.offsets.begin(), r.offsets.end() - 1);
  for (std::int64_t i = 0; i < m; ++i) {
    const auto at = static_cast<std::size_t>(next[static_cast<std::size_t>(r.host_experts[static_cast<std::size_t>(i)])]++);
    index[at] = static_cast<std::int32_t>(i / k);
    slot[at] = static_cast<std::int32_t>(i);
  }
  be_.upload_bytes(r.index, index.data(), index.size() * sizeof(std::int32_t));
  be_.upload_bytes(r.slot, slot.data(), slot.size() * sizeof(std::int32_t));
}

void moe_mlp::add_balance(const routing& r, std::span<const std::uint8_t> counted, router_balance& balance) {
  if (!be_.has_data()) return;
  const std::int64_t n = r.probs.matrix().rows, E = model_.moe.experts, k = model_.moe.top_k;
  std::vector<float> probs(static_cast<std::size_t>(n * E));
  be_.download_f32(probs.data(), r.probs);
  for (std::int64_t t = 0; t < n; ++t) {
    if (counted[static_cast<std::size_t>(t)] == 0) continue;
    balance.rows += 1;
    for (std::int64_t e = 0; e < E; ++e) balance.prob_sums[static_cast<std::size_t>(e)] += probs[static_cast<std::size_t>(t * E + e)];
    for (std::int64_t j = 0; j < k; ++j) balance.counts[static_cast<std::size_t>(r.host_experts[static_cast<std::size_t>(t * k + j)])] += 1;
  }
}

void moe_mlp::forward(const moe_weights& w, const mat_view& h, const mat_view& y, std::span<const std::uint8_t> counted,
                      router_balance* balance) {
  routing r = route(w, h);
  if (balance != nullptr) add_balance(r, counted, *balance);
  const std::int64_t m = r.index.matrix().rows;
  tensor x = be_.allocate(mem_tag::activations, be_.work_dtype(), {m, model_.hidden_size}, "moe_gathered");
  ops::moe_gather(be_, {h, r.index.matrix(), x.matrix()});
  if (exchange_)
    exchanged_forward(w, r, std::move(x), y, h.rows);
  else
    experts_forward(w, x.matrix(), r.offsets, {r.index.matrix(), r.slot.matrix(), r.weights.matrix(), y, {}, {}});
  if (!w.has_shared()) return;
  x.reset();
  shared_out s = shared_forward(w, h);
  ops::sigmoid_gate_forward(be_, {s.z.matrix(), s.s.matrix(), y});
}

// Each expert's gated MLP on its block of rows, its output scattered as `to` says.
void moe_mlp::experts_forward(const moe_weights& w, const mat_view& x, std::span<const std::int64_t> offsets,
                              const expert_rows& to) {
  const std::int64_t D = model_.hidden_size, I = model_.moe.expert_width;
  for (std::size_t e = 0; e < w.gate.size(); ++e) {
    const std::int64_t first = offsets[e], c = offsets[e + 1] - first;
    if (c == 0) continue;
    const mat_view rows = x.row_block(first, c);
    tensor gate = be_.allocate(mem_tag::activations, be_.work_dtype(), {c, I}, "moe_expert_gate");
    tensor up = be_.allocate(mem_tag::activations, be_.work_dtype(), {c, I}, "moe_expert_up");
    linear_forward(be_, rows, w.gate[e], gate.matrix());
    linear_forward(be_, rows, w.up[e], up.matrix());
    ops::swiglu_forward(be_, {gate.matrix(), up.matrix(), gate.matrix(), model_.activation});  // in place
    up.reset();
    tensor out = be_.allocate(mem_tag::activations, be_.work_dtype(), {c, D}, "moe_expert_out");
    linear_forward(be_, gate.matrix(), w.down[e], out.matrix());
    ops::moe_scatter(be_, {out.matrix(), to.index.row_block(first, c),
                           to.weights.rows > 0 ? to.slot.row_block(first, c) : mat_view{}, to.weights, to.dst});
  }
}

moe_mlp::shared_out moe_mlp::shared_forward(const moe_weights& w, const mat_view& h) {
  const std::int64_t n = h.rows, D = model_.hidden_size, S = model_.moe.shared_width;
  shared_out out;
  {
    tensor gate = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, S}, "moe_shared_gate");
    tensor up = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, S}, "moe_shared_up");
    linear_forward(be_, h, w.shared_gate, gate.matrix());
    linear_forward(be_, h, w.shared_up, up.matrix());
    ops::swiglu_forward(be_, {gate.matrix(), up.matrix(), gate.matrix(), model_.activation});
    up.reset();
    out.s = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, D}, "moe_shared_out");
    linear_forward(be_, gate.matrix(), w.shared_down, out.s.matrix());
  }
  out.z = be_.allocate(mem_tag::activations, dtype::f32, {n, 1}, "moe_shared_gate_logit");
  ops::gemm(be_, {h, transpose::none, w.shared_expert_gate, transpose::yes, out.z.matrix()});
  return out;
}

void moe_mlp::backward(const moe_weights& w, const moe_grads& g, const mat_view& h, const mat_view& d_y,
                       const mat_view& d_h, std::span<const std::uint8_t> counted, const tensor* aux_grad) {
  const std::int64_t n = h.rows, D = model_.hidden_size, k = model_.moe.top_k;
  routing r = route(w, h);
  const std::int64_t m = r.index.matrix().rows;
  ops::fill_heads(be_, ops::as_heads(d_h), 0.0f);
  tensor d_weights = be_.allocate_zeroed(mem_tag::activations, dtype::f32, {n, k}, "moe_d_routing_weights");
  {
    tensor x = be_.allocate(mem_tag::activations, be_.work_dtype(), {m, D}, "moe_gathered");
    ops::moe_gather(be_, {h, r.index.matrix(), x.matrix()});
    if (exchange_)
      exchanged_backward(w, g, r, std::move(x), d_y, d_h, d_weights.matrix(), n);
    else
      experts_backward(w, g, x.matrix(), r.offsets,
                       {r.index.matrix(), r.slot.matrix(), r.weights.matrix(), d_y, d_weights.matrix(), d_h});
  }
  // Through the router: the aux term only on counted rows, in runs of like rows.
  tensor d_logits = be_.allocate(mem_tag::activations, dtype::f32, {n, model_.moe.experts}, "moe_d_router_logits");
  for (std::int64_t t0 = 0; t0 < n;) {
    const bool aux = aux_grad != nullptr && !counted.empty() && counted[static_cast<std::size_t>(t0)] != 0;
    std::int64_t t1 = t0 + 1;
    if (aux_grad != nullptr && !counted.empty())
      while (t1 < n && (counted[static_cast<std::size_t>(t1)] != 0) == aux) ++t1;
    else
      t1 = n;
    const std::int64_t c = t1 - t0;
    ops::moe_route_backward(be_, {r.probs.matrix().row_block(t0, c), r.experts.matrix().row_block(t0, c),
                                  d_weights.matrix().row_block(t0, c), aux ? aux_grad->matrix() : mat_view{},
                                  d_logits.matrix().row_block(t0, c), model_.moe.normalize_top_k});
    t0 = t1;
  }
  tensor d_logits_work = working_copy(be_, d_logits.matrix(), "moe_d_router_logits_work");
  d_logits.reset();
  ops::gemm(be_, {d_logits_work.matrix(), transpose::none, w.router, transpose::none, d_h, 1.0f, 1.0f});
  if (g.router.rows > 0)
    ops::gemm(be_, {d_logits_work.matrix(), transpose::yes, h, transpose::none, g.router, 1.0f, 1.0f});
  if (w.has_shared()) shared_backward(w, g, h, d_y, d_h);
}

// Each expert's block is recomputed (gate, up, their activation and the down projection,
// whose output the routing weight's gradient needs), then gone back through.
void moe_mlp::experts_backward(const moe_weights& w, const moe_grads& g, const mat_view& x,
                               std::span<const std::int64_t> offsets, const expert_rows& to) {
  const std::int64_t D = model_.hidden_size, I = model_.moe.expert_width;
  for (std::size_t e = 0; e < w.gate.size(); ++e) {
    const std::int64_t first = offsets[e], c = offsets[e + 1] - first;
    if (c == 0) continue;
    const mat_view rows = x.row_block(first, c);
    const mat_view index = to.index.row_block(first, c), slot = to.slot.row_block(first, c);
    tensor gate = be_.allocate(mem_tag::activations, be_.work_dtype(), {c, I}, "moe_expert_gate");
    tensor up = be_.allocate(mem_tag::activations, be_.work_dtype(), {c, I}, "moe_expert_up");
    linear_forward(be_, rows, w.gate[e], gate.matrix());
    linear_forward(be_, rows, w.up[e], up.matrix());
    tensor act = be_.allocate(mem_tag::activations, be_.work_dtype(), {c, I}, "moe_expert_act");
    ops::swiglu_forward(be_, {gate.matrix(), up.matrix(), act.matrix(), model_.activation});
    tensor d_out = be_.allocate(mem_tag::activations, be_.work_dtype(), {c, D}, "moe_expert_d_out");
    {
      tensor out = be_.allocate(mem_tag::activations, be_.work_dtype(), {c, D}, "moe_expert_out");
      linear_forward(be_, act.matrix(), w.down[e], out.matrix());
      ops::moe_scatter_backward(be_, {to.dst, index, slot, to.weights, out.matrix(), d_out.matrix(), to.d_weights});
    }
    tensor d_act = be_.allocate(mem_tag::activations, be_.work_dtype(), {c, I}, "moe_expert_d_act");
    linear_backward(be_, act.matrix(), d_out.matrix(), w.down[e], g.down[e], d_act.matrix(), 0.0f);
    act.reset();
    d_out.reset();
    ops::swiglu_backward(be_, {gate.matrix(), up.matrix(), d_act.matrix(), gate.matrix(), up.matrix(), model_.activation});
    d_act.reset();
    tensor d_x = be_.allocate(mem_tag::activations, dtype::f32, {c, D}, "moe_expert_d_in");
    linear_backward(be_, rows, gate.matrix(), w.gate[e], g.gate[e], d_x.matrix(), 0.0f);
    linear_backward(be_, rows, up.matrix(), w.up[e], g.up[e], d_x.matrix(), 1.0f);
    ops::moe_scatter(be_, {d_x.matrix(), index, {}, {}, to.d_src});
  }
}

void moe_mlp::shared_backward(const moe_weights& w, const moe_grads& g, const mat_view& h, const mat_view& d_y,
                              const mat_view& d_h) {
  const std::int64_t n = h.rows, D = model_.hidden_size, S = model_.moe.shared_width;
  tensor gate = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, S}, "moe_shared_gate");
  tensor up = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, S}, "moe_shared_up");
  linear_forward(be_, h, w.shared_gate, gate.matrix());
  linear_forward(be_, h, w.shared_up, up.matrix());
  tensor act = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, S}, "moe_shared_act");
  ops::swiglu_forward(be_, {gate.matrix(), up.matrix(), act.matrix(), model_.activation});
  tensor d_s = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, D}, "moe_shared_d_out");
  tensor d_z = be_.allocate(mem_tag::activations, dtype::f32, {n, 1}, "moe_shared_d_gate_logit");
  {
    tensor s = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, D}, "moe_shared_out");
    linear_forward(be_, act.matrix(), w.shared_down, s.matrix());
    tensor z = be_.allocate(mem_tag::activations, dtype::f32, {n, 1}, "moe_shared_gate_logit");
    ops::gemm(be_, {h, transpose::none, w.shared_expert_gate, transpose::yes, z.matrix()});
    ops::sigmoid_gate_backward(be_, {z.matrix(), s.matrix(), d_y, d_s.matrix(), d_z.matrix()});
  }
  tensor d_act = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, S}, "moe_shared_d_act");
  linear_backward(be_, act.matrix(), d_s.matrix(), w.shared_down, g.shared_down, d_act.matrix(), 0.0f);
  act.reset();
  d_s.reset();
  ops::swiglu_backward(be_, {gate.matrix(), up.matrix(), d_act.matrix(), gate.matrix(), up.matrix(), model_.activation});
  d_act.reset();
  linear_backward(be_, h, gate.matrix(), w.shared_gate, g.shared_gate, d_h, 1.0f);
  linear_backward(be_, h, up.matrix(), w.shared_up, g.shared_up, d_h, 1.0f);
  tensor d_z_work = working_copy(be_, d_z.matrix(), "moe_shared_d_gate_logit_work");
  ops::gemm(be_, {d_z_work.matrix(), transpose::none, w.shared_expert_gate, transpose::none, d_h, 1.0f, 1.0f});
  if (g.shared_expert_gate.rows > 0)
    ops::gemm(be_, {d_z_work.matrix(), transpose::yes, h, transpose::none, g.shared_expert_gate, 1.0f, 1.0f});
}

}  // namespace upipe
