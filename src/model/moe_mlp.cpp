#include "model/moe_mlp.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <string>

#include "backend/ops.hpp"
#include "core/error.hpp"

namespace upipe {

namespace {

// The phases of a sparse layer (bench --phases): the experts' GEMMs and activations, and
// everything that routes, dispatches, permutes and combines the rows around them.
constexpr const char* routing_phase = "moe_routing";
constexpr const char* experts_phase = "moe_experts";

std::vector<mat_view> matrices(const std::vector<projection>& p) {
  std::vector<mat_view> out;
  for (const projection& e : p) out.push_back(e.weight);
  return out;
}
std::vector<mat_view> matrices(const std::vector<projection_grads>& g) {
  std::vector<mat_view> out;
  for (const projection_grads& e : g) out.push_back(e.weight);
  return out;
}
// A frozen expert weight (LoRA on the attention) has no gradient rows.
bool trains(const std::vector<projection_grads>& g) { return !g.empty() && g.front().weight.rows > 0; }

}  // namespace

std::string_view moe_gemm_name(moe_gemm g) {
  return g == moe_gemm::grouped ? "grouped" : g == moe_gemm::cublas ? "cublas" : "loop";
}

moe_gemm parse_moe_gemm(std::string_view text) {
  for (const moe_gemm g : {moe_gemm::grouped, moe_gemm::cublas, moe_gemm::loop})
    if (text == moe_gemm_name(g)) return g;
  throw config_error("--moe-gemm '" + std::string(text) + "' is not one of grouped (CUTLASS's grouped GEMM, the "
                     "experts' sizes read on the device), cublas (cuBLAS's grouped GEMM, sizes read on the host) or "
                     "loop (one GEMM per expert); for example --moe-gemm grouped");
}

void validate_moe_options(const moe_options& o) {
  if (!(std::isfinite(o.capacity_factor) && o.capacity_factor >= 0))
    throw config_error("--moe-capacity-factor " + std::to_string(o.capacity_factor) +
                       " must be 0 (dropless: every expert takes every token routed to it) or a positive factor F, "
                       "an expert taking at most ceil(F n k / E) of a tile's n tokens; for example "
                       "--moe-capacity-factor 1.25");
}

std::int64_t moe_capacity(double factor, std::int64_t n, std::int64_t k, std::int64_t experts) {
  if (factor <= 0) return 0;
  const double rows = std::ceil(factor * static_cast<double>(n * k) / static_cast<double>(experts));
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(rows));
}

router_balance read_router_balance(backend& be, const tensor& sums, std::int64_t experts) {
  const auto E = static_cast<std::size_t>(experts);
  std::vector<std::uint64_t> words(2 * E, 0);
  be.download_bytes(words.data(), sums, words.size() * sizeof(std::uint64_t));
  router_balance b;
  for (std::size_t e = 0; e < E; ++e) {
    b.counts.push_back(static_cast<double>(words[e]));
    b.prob_sums.push_back(std::bit_cast<double>(words[E + e]));
  }
  return b;
}

moe_mlp::moe_mlp(const model_config& model, backend& be, const moe_options& options, int rank)
    : model_(model), be_(be), options_(options), rank_(rank) {
  validate_moe_options(options);
}

tensor working_copy(backend& be, const mat_view& src, const char* label) {
  tensor t = be.allocate(mem_tag::activations, be.work_dtype(), {src.rows, src.cols}, label);
  ops::copy_heads(be, ops::as_heads(t.matrix()), ops::as_heads(src));
  return t;
}

// 1. The router's probabilities and the tile's choices: its own, or a log's.
moe_mlp::routing moe_mlp::route(const moe_weights& w, const tile& at, const mat_view& h) {
  const phase_scope phase(be_, routing_phase);
  const std::int64_t n = h.rows, E = model_.moe.experts, k = model_.moe.top_k;
  routing r;
  tensor logits = be_.allocate(mem_tag::activations, dtype::f32, {n, E}, "moe_router_logits");
  ops::gemm(be_, {h, transpose::none, w.router, transpose::yes, logits.matrix()});
  r.probs = be_.allocate(mem_tag::activations, dtype::f32, {n, E}, "moe_router_probs");
  r.weights = be_.allocate(mem_tag::activations, dtype::f32, {n, k}, "moe_routing_weights");
  r.experts = be_.allocate(mem_tag::activations, dtype::i32, {n, k}, "moe_routing_experts");
  moe_routing_log* log = be_.has_data() ? options_.routing_log : nullptr;
  const moe_routing_log::key key{rank_, at.layer, at.first};
  const bool replay = log != nullptr && log->how() == moe_routing_log::mode::replay;
  const std::size_t bytes = static_cast<std::size_t>(n * k) * sizeof(std::int32_t);
  if (replay) be_.upload_bytes(r.experts, log->get(key, n, k).experts.data(), bytes);
  ops::moe_route(be_, {logits.matrix(), r.probs.matrix(), r.weights.matrix(), r.experts.matrix(),
                       model_.moe.normalize_top_k, replay});
  if (log != nullptr && !replay) {
    moe_routing_log::choices c{n, k, std::vector<std::int32_t>(static_cast<std::size_t>(n * k))};
    be_.download_bytes(c.experts.data(), r.experts, bytes);
    log->put(key, std::move(c));
  }
  return r;
}

// 2. Each slot's row in the experts' order, on the device. The per-expert loop reads the
// experts' offsets back (a synchronization); on meta it spreads the rows evenly, which gives
// the same buffers as any routing: the dispatched rows are n k (or E capacity) whatever it is.
moe_mlp::dispatch_plan moe_mlp::dispatch(const routing& r, std::int64_t n) {
  const phase_scope phase(be_, routing_phase);
  const std::int64_t E = model_.moe.experts, k = model_.moe.top_k;
  const std::int64_t capacity = moe_capacity(options_.capacity_factor, n, k, E);
  dispatch_plan d;
  d.rows = moe_dispatch_rows(n, k, E, capacity);
  d.position = be_.allocate(mem_tag::activations, dtype::i32, {n, k}, "moe_dispatch_position");
  d.offsets = be_.allocate(mem_tag::activations, dtype::i32, {1, E + 1}, "moe_dispatch_offsets");
  {
    tensor scratch =
        be_.allocate(mem_tag::activations, dtype::i32, {moe_dispatch_scratch_rows(n), E}, "moe_dispatch_scratch");
    ops::moe_dispatch(be_, {r.experts.matrix(), d.position.matrix(), d.offsets.matrix(), scratch.matrix(), capacity});
  }
  if (options_.gemm != moe_gemm::loop) return d;
  d.host_offsets.assign(static_cast<std::size_t>(E + 1), 0);
  if (!be_.has_data()) {
    for (std::int64_t e = 0; e <= E; ++e) d.host_offsets[static_cast<std::size_t>(e)] = d.rows * e / E;
    return d;
  }
  std::vector<std::int32_t> offsets(static_cast<std::size_t>(E + 1));
  be_.download_bytes(offsets.data(), d.offsets, offsets.size() * sizeof(std::int32_t));
  std::copy(offsets.begin(), offsets.end(), d.host_offsets.begin());
  return d;
}

tensor moe_mlp::permute(const dispatch_plan& d, const mat_view& h) {
  const phase_scope phase(be_, routing_phase);
  tensor x = be_.allocate(mem_tag::activations, be_.work_dtype(), {d.rows, h.cols}, "moe_gathered");
  ops::moe_permute(be_, {h, d.position.matrix(), x.matrix()});
  return x;
}

// 3. The experts, on the dispatched rows (expert parallelism exchanges them before this).
void moe_mlp::expert_gemm(const dispatch_plan& d, grouped_form form, const mat_view& rows, const mat_view& other,
                          std::vector<mat_view> weights, const mat_view& out, float beta) {
  const phase_scope phase(be_, experts_phase);
  if (options_.gemm != moe_gemm::loop) {
    moe_grouped_gemm_args a;
    a.form = form;
    a.rows = rows;
    a.other = other;
    a.weights = std::move(weights);
    a.offsets = d.offsets.matrix();
    a.out = out;
    a.beta = form == grouped_form::weight_gradient ? 1.0f : beta;
    a.engine = options_.gemm == moe_gemm::cublas ? grouped_engine::cublas : grouped_engine::cutlass;
    ops::moe_grouped_gemm(be_, a);
    return;
  }
  for (std::size_t e = 0; e < weights.size(); ++e) {
    const std::int64_t first = d.host_offsets[e], c = d.host_offsets[e + 1] - first;
    if (c == 0) continue;
    const mat_view block = rows.row_block(first, c);
    if (form == grouped_form::weight_gradient)
      ops::gemm(be_, {block, transpose::yes, other.row_block(first, c), transpose::none, weights[e], 1.0f, 1.0f});
    else
      ops::gemm(be_, {block, transpose::none, weights[e],
                      form == grouped_form::rows_by_weight_t ? transpose::yes : transpose::none,
                      out.row_block(first, c), 1.0f, beta});
  }
}

moe_mlp::expert_pass moe_mlp::experts_in(const moe_weights& w, const dispatch_plan& d, tensor x) {
  const std::int64_t I = model_.moe.expert_width;
  expert_pass p;
  p.x = std::move(x);
  p.gate = be_.allocate(mem_tag::activations, be_.work_dtype(), {d.rows, I}, "moe_expert_gate");
  p.up = be_.allocate(mem_tag::activations, be_.work_dtype(), {d.rows, I}, "moe_expert_up");
  expert_gemm(d, grouped_form::rows_by_weight_t, p.x.matrix(), {}, matrices(w.gate), p.gate.matrix());
  expert_gemm(d, grouped_form::rows_by_weight_t, p.x.matrix(), {}, matrices(w.up), p.up.matrix());
  return p;
}

void moe_mlp::forward(const moe_weights& w, const tile& at, const mat_view& h, const mat_view& y) {
  const std::int64_t n = h.rows, D = model_.hidden_size;
  const routing r = route(w, at, h);
  if (at.balance != nullptr) {
    const phase_scope phase(be_, routing_phase);
    ops::moe_balance(be_, {r.probs.matrix(), r.experts.matrix(), at.counted, at.balance->matrix()});
  }
  const dispatch_plan d = dispatch(r, n);
  tensor out;
  {
    // Expert parallelism exchanges the permuted rows (and the offsets) here, and the
    // experts' outputs back before the combine.
    expert_pass p = experts_in(w, d, permute(d, h));
    p.x.reset();
    {
      const phase_scope phase(be_, experts_phase);
      ops::swiglu_forward(be_, {p.gate.matrix(), p.up.matrix(), p.gate.matrix(), model_.activation});  // in place
    }
    p.up.reset();
    out = be_.allocate(mem_tag::activations, be_.work_dtype(), {d.rows, D}, "moe_expert_out");
    expert_gemm(d, grouped_form::rows_by_weight_t, p.gate.matrix(), {}, matrices(w.down), out.matrix());
  }
  const shared_out s = w.has_shared() ? shared_forward(w, h) : shared_out{};
  // 4. Each token's k outputs weighted, and the shared expert's, summed in fp32 and added once.
  const phase_scope phase(be_, routing_phase);
  ops::moe_combine(be_, {out.matrix(), d.position.matrix(), r.weights.matrix(), w.has_shared() ? s.s.matrix() : mat_view{},
                         w.has_shared() ? s.z.matrix() : mat_view{}, y});
}

moe_mlp::shared_out moe_mlp::shared_forward(const moe_weights& w, const mat_view& h) {
  const phase_scope phase(be_, experts_phase);
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

// The tile's routing and its experts' activations are recomputed, then gone back through:
// the combine, the experts (each output is needed for its routing weight's gradient), the
// permute, the router.
void moe_mlp::backward(const moe_weights& w, const moe_grads& g, const tile& at, const mat_view& h,
                       const mat_view& d_y, const mat_view& d_h) {
  const std::int64_t n = h.rows, k = model_.moe.top_k;
  const routing r = route(w, at, h);
  const dispatch_plan d = dispatch(r, n);
  tensor d_weights = be_.allocate(mem_tag::activations, dtype::f32, {n, k}, "moe_d_routing_weights");
  experts_backward(w, g, d, r, h, d_y, d_h, d_weights.matrix());
  router_backward(w, g, at, r, h, d_weights.matrix(), d_h);
  if (w.has_shared()) shared_backward(w, g, h, d_y, d_h);
}

// d_h = the experts' input gradients combined per token; d_weights from the combine.
void moe_mlp::experts_backward(const moe_weights& w, const moe_grads& g, const dispatch_plan& d, const routing& r,
                               const mat_view& h, const mat_view& d_y, const mat_view& d_h, const mat_view& d_weights) {
  const std::int64_t D = model_.hidden_size, I = model_.moe.expert_width;
  expert_pass p = experts_in(w, d, permute(d, h));
  tensor act = be_.allocate(mem_tag::activations, be_.work_dtype(), {d.rows, I}, "moe_expert_act");
  {
    const phase_scope phase(be_, experts_phase);
    ops::swiglu_forward(be_, {p.gate.matrix(), p.up.matrix(), act.matrix(), model_.activation});
  }
  tensor d_out = be_.allocate(mem_tag::activations, be_.work_dtype(), {d.rows, D}, "moe_expert_d_out");
  {
    tensor out = be_.allocate(mem_tag::activations, be_.work_dtype(), {d.rows, D}, "moe_expert_out");
    expert_gemm(d, grouped_form::rows_by_weight_t, act.matrix(), {}, matrices(w.down), out.matrix());
    const phase_scope phase(be_, routing_phase);
    ops::moe_combine_backward(be_, {d_y, d.position.matrix(), r.weights.matrix(), out.matrix(), d_out.matrix(), d_weights});
  }
  tensor d_act = be_.allocate(mem_tag::activations, be_.work_dtype(), {d.rows, I}, "moe_expert_d_act");
  expert_gemm(d, grouped_form::rows_by_weight, d_out.matrix(), {}, matrices(w.down), d_act.matrix());
  if (trains(g.down)) expert_gemm(d, grouped_form::weight_gradient, d_out.matrix(), act.matrix(), matrices(g.down), {});
  act.reset();
  d_out.reset();
  {
    const phase_scope phase(be_, experts_phase);
    // In place: gate and up become their gradients.
    ops::swiglu_backward(be_, {p.gate.matrix(), p.up.matrix(), d_act.matrix(), p.gate.matrix(), p.up.matrix(),
                               model_.activation});
  }
  d_act.reset();
  tensor d_x = be_.allocate(mem_tag::activations, dtype::f32, {d.rows, D}, "moe_expert_d_in");
  expert_gemm(d, grouped_form::rows_by_weight, p.gate.matrix(), {}, matrices(w.gate), d_x.matrix(), 0.0f);
  expert_gemm(d, grouped_form::rows_by_weight, p.up.matrix(), {}, matrices(w.up), d_x.matrix(), 1.0f);
  if (trains(g.gate)) expert_gemm(d, grouped_form::weight_gradient, p.gate.matrix(), p.x.matrix(), matrices(g.gate), {});
  if (trains(g.up)) expert_gemm(d, grouped_form::weight_gradient, p.up.matrix(), p.x.matrix(), matrices(g.up), {});
  p = {};
  const phase_scope phase(be_, routing_phase);
  ops::fill_heads(be_, ops::as_heads(d_h), 0.0f);
  ops::moe_combine(be_, {d_x.matrix(), d.position.matrix(), {}, {}, {}, d_h});
}

// Through the router: the routing weights' gradient and, on the counted rows, the aux term.
void moe_mlp::router_backward(const moe_weights& w, const moe_grads& g, const tile& at, const routing& r,
                              const mat_view& h, const mat_view& d_weights, const mat_view& d_h) {
  const phase_scope phase(be_, routing_phase);
  const std::int64_t n = h.rows, E = model_.moe.experts;
  tensor d_logits = be_.allocate(mem_tag::activations, dtype::f32, {n, E}, "moe_d_router_logits");
  const bool aux = at.aux_grad != nullptr;
  ops::moe_route_backward(be_, {r.probs.matrix(), r.experts.matrix(), d_weights, aux ? at.aux_grad->matrix() : mat_view{},
                                aux ? at.counted : mat_view{}, d_logits.matrix(), model_.moe.normalize_top_k});
  tensor d_logits_work = working_copy(be_, d_logits.matrix(), "moe_d_router_logits_work");
  d_logits.reset();
  ops::gemm(be_, {d_logits_work.matrix(), transpose::none, w.router, transpose::none, d_h, 1.0f, 1.0f});
  if (g.router.rows > 0)
    ops::gemm(be_, {d_logits_work.matrix(), transpose::yes, h, transpose::none, g.router, 1.0f, 1.0f});
}

void moe_mlp::shared_backward(const moe_weights& w, const moe_grads& g, const mat_view& h, const mat_view& d_y,
                              const mat_view& d_h) {
  const phase_scope phase(be_, experts_phase);
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
