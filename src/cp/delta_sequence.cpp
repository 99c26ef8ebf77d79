// The Gated DeltaNet layer over the sequence layouts (cp/delta_layer.hpp): ring's and
// hybrid's zigzag halves, fpdt's and upipe's strided chunks, one rank's whole sequence. Each
// rank runs its own segments; what crosses ranks is small and fp32 where it is a state:
// - the convolution's halo, the Kc - 1 rows before each segment: every rank puts the last
//   Kc - 1 rows of each of its segments in an all-gather (whatever rank holds a row before
//   a segment, it is among the last Kc - 1 rows of its own segment), and its gradient the
//   same way back;
// - each segment's summary, its transition (Hv, dk, dk) and its local state (Hv, dk, dv):
//   all-gathered, put in sequence order and scanned (gated_delta_scan), which gives the state
//   entering every segment on every rank, in the same bits; in backward each segment's
//   gradient by its entering state from its own outputs, scanned the other way, gives the
//   gradient every segment's final state receives.
#include <algorithm>

#include "backend/ops.hpp"
#include "core/error.hpp"
#include "cp/delta_layer.hpp"
#include "ops/gated_delta/workspace.hpp"

namespace upipe {
namespace {

// Columns [first, first + heads * dim) of a row-major matrix as (rows, heads, dim).
head_view heads_of(const mat_view& m, std::int64_t first, std::int64_t heads, std::int64_t dim) {
  const mat_view c = m.col_block(first, heads * dim);
  return {c.data, c.type, c.rows, heads, dim, c.ld, dim};
}

// A stack of `count` (rows, cols) f32 matrices from `first` of a (n, rows, cols) tensor.
head_view matrices(const tensor& t, std::int64_t first, std::int64_t count) {
  return t.heads().token_block(first, count);
}

// A flat range of f32 elements as one matrix, for copies between flat buffers.
head_view flat(const tensor& t, std::int64_t first, std::int64_t count) {
  const mat_view m = t.matrix();
  return ops::as_heads({static_cast<float*>(m.data) + first, dtype::f32, 1, count, count});
}

// Where a global position lies: its rank and that rank's segment.
struct place {
  int rank = -1;
  std::int64_t segment = -1;
};

}  // namespace

// The q, k, v views of a segment's convolved channels, and its g and beta.
struct delta_rows {
  head_view q, k, v;
  mat_view g, beta;
};

namespace {

delta_rows rows_of(const delta_config& c, const mat_view& conv, const mat_view& gates, const delta_segment& seg) {
  const mat_view rows = conv.row_block(seg.token_begin, seg.count);
  const mat_view gate_rows = gates.row_block(seg.token_begin, seg.count);
  return {heads_of(rows, 0, c.key_heads, c.key_dim), heads_of(rows, c.key_width(), c.key_heads, c.key_dim),
          heads_of(rows, 2 * c.key_width(), c.value_heads, c.value_dim), gate_rows.col_block(0, c.value_heads),
          gate_rows.col_block(c.value_heads, c.value_heads)};
}

place find_place(const std::vector<std::vector<delta_segment>>& segments, std::int64_t position) {
  for (std::size_t r = 0; r < segments.size(); ++r)
    for (std::size_t i = 0; i < segments[r].size(); ++i) {
      const delta_segment& s = segments[r][i];
      if (position >= s.position_begin && position < s.position_begin + s.count)
        return {static_cast<int>(r), static_cast<std::int64_t>(i)};
    }
  return {};
}

std::int64_t most_segments(const std::vector<std::vector<delta_segment>>& segments) {
  std::size_t n = 0;
  for (const auto& s : segments) n = std::max(n, s.size());
  return static_cast<std::int64_t>(n);
}

// The leading rows of a segment's halo (h rows: positions [begin - h, begin)) that precede a
// document starting inside the halo, after its first row: the segment's rows never read them.
// (A start at the segment's first row the op handles; the op takes starts from row 0 on.)
std::int64_t rows_before_document(const std::vector<std::int64_t>& starts, std::int64_t begin, std::int64_t h) {
  std::int64_t masked = 0;
  for (const std::int64_t p : starts)
    if (p > begin - h && p < begin) masked = std::max(masked, p - (begin - h));
  return masked;
}

}  // namespace

// Zeroes the halo rows a document start inside the halo hides from its segment (`halos` as
// gather_halos lays them out): the forward's inputs and the backward's gradients alike.
void delta_layer::mask_halos(const mat_view& halos) {
  const std::int64_t h = config_.conv_kernel - 1;
  if (h == 0 || documents_.empty()) return;
  const auto& mine = segments();
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const std::int64_t n = rows_before_document(documents_, mine[i].position_begin, h);
    if (n > 0) ops::fill_heads(be_, ops::as_heads(halos.row_block(std::int64_t(i) * h, n)), 0.0f);
  }
}

// Each segment's halo, (n (Kc - 1), C): rows [i (Kc - 1), (i + 1) (Kc - 1)) for local segment i.
tensor delta_layer::gather_halos(const mat_view& mixed) {
  const std::int64_t h = config_.conv_kernel - 1, C = config_.channels();
  const auto& mine = segments();
  tensor halos = be_.allocate_zeroed(mem_tag::activations, be_.work_dtype(), {std::max<std::int64_t>(1, std::int64_t(mine.size()) * h), C}, "delta_halo");
  if (h == 0) return halos;
  const std::int64_t slots = most_segments(segments_) * h;
  tensor tails = be_.allocate_zeroed(mem_tag::activations, be_.work_dtype(), {slots, C}, "delta_tails");
  for (std::size_t i = 0; i < mine.size(); ++i) {  // right-aligned: the last row at the slot's end
    const std::int64_t n = std::min(h, mine[i].count);
    ops::copy_heads(be_, ops::as_heads(tails.matrix().row_block((std::int64_t(i) + 1) * h - n, n)),
                    ops::as_heads(mixed.row_block(mine[i].token_begin + mine[i].count - n, n)));
  }
  tensor all = be_.allocate(mem_tag::activations, be_.work_dtype(), {slots * config_.cp, C}, "delta_tails_all");
  comm_->all_gather(tails.data(), all.data(), tails.bytes(), "delta_halo");
  tails.reset();
  for (std::size_t i = 0; i < mine.size(); ++i)
    for (std::int64_t j = 0; j < h; ++j) {
      const std::int64_t position = mine[i].position_begin - h + j;
      if (position < 0) continue;  // before the sequence: zero
      const place at = find_place(segments_, position);
      UPIPE_CHECK(at.rank >= 0, "delta_layer: no rank holds position " + std::to_string(position));
      const delta_segment& seg = segments_[at.rank][at.segment];
      const std::int64_t row = at.rank * slots + (at.segment + 1) * h - (seg.position_begin + seg.count - position);
      ops::copy_heads(be_, ops::as_heads(halos.matrix().row_block(std::int64_t(i) * h + j, 1)),
                      ops::as_heads(all.matrix().row_block(row, 1)));
    }
  mask_halos(halos.matrix());
  return halos;
}

// The gradients of the halos (as gather_halos laid them out) added to the rows they came from.
void delta_layer::scatter_halo_grads(const tensor& d_halos, const mat_view& d_mixed) {
  const std::int64_t h = config_.conv_kernel - 1, C = config_.channels();
  if (h == 0) return;
  const std::int64_t slots = most_segments(segments_) * h;
  tensor send = be_.allocate_zeroed(mem_tag::activations, be_.work_dtype(), {slots, C}, "delta_halo_grads");
  const std::int64_t rows = std::int64_t(segments().size()) * h;
  if (rows > 0) ops::copy_heads(be_, ops::as_heads(send.matrix().row_block(0, rows)), ops::as_heads(d_halos.matrix().row_block(0, rows)));
  tensor all = be_.allocate(mem_tag::activations, be_.work_dtype(), {slots * config_.cp, C}, "delta_halo_grads_all");
  comm_->all_gather(send.data(), all.data(), send.bytes(), "delta_halo_grad");
  send.reset();
  for (int r = 0; r < config_.cp; ++r)
    for (std::size_t i = 0; i < segments_[r].size(); ++i)
      for (std::int64_t j = 0; j < h; ++j) {
        const std::int64_t position = segments_[r][i].position_begin - h + j;
        if (position < 0) continue;
        const place at = find_place(segments_, position);
        if (at.rank != rank_) continue;
        const delta_segment& seg = segments_[rank_][at.segment];
        const std::int64_t local = seg.token_begin + (position - seg.position_begin);
        ops::add_heads(be_, ops::as_heads(d_mixed.row_block(local, 1)),
                       ops::as_heads(all.matrix().row_block(r * slots + std::int64_t(i) * h + j, 1)));
      }
}

void delta_layer::sequence_forward(context& ctx, const mat_view& x, const delta_weights& w) {
  const delta_config& c = config_;
  const std::int64_t s = c.local_tokens(), C = c.channels(), kw = c.key_width(), Hv = c.value_heads;
  const std::int64_t dk = c.key_dim, dv = c.value_dim;
  ctx.mixed = be_.allocate(mem_tag::activations, be_.work_dtype(), {s, C}, "delta_mixed");
  projection_forward(be_, w.q, x).all(ctx.mixed.matrix().col_block(0, kw));
  projection_forward(be_, w.k, x).all(ctx.mixed.matrix().col_block(kw, kw));
  projection_forward(be_, w.v, x).all(ctx.mixed.matrix().col_block(2 * kw, c.value_width()));
  ctx.ab = be_.allocate(mem_tag::activations, be_.work_dtype(), {s, 2 * Hv}, "delta_ab");  // b | a
  linear_forward(be_, x, w.b, ctx.ab.matrix().col_block(0, Hv));
  linear_forward(be_, x, w.a, ctx.ab.matrix().col_block(Hv, Hv));
  ctx.gates = be_.allocate(mem_tag::activations, dtype::f32, {s, 2 * Hv}, "delta_gates");  // g | beta
  ops::gated_delta_gates_forward(be_, {ctx.ab.matrix().col_block(Hv, Hv), ctx.ab.matrix().col_block(0, Hv), w.a_log,
                                       w.dt_bias, ctx.gates.matrix().col_block(0, Hv),
                                       ctx.gates.matrix().col_block(Hv, Hv)});
  ctx.halos = gather_halos(ctx.mixed.matrix());
  ctx.conv = be_.allocate(mem_tag::activations, be_.work_dtype(), {s, C}, "delta_conv");
  const std::int64_t h = c.conv_kernel - 1;
  const auto& mine = segments();
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const delta_segment& seg = mine[i];
    const mat_view halo = h > 0 ? ctx.halos.matrix().row_block(std::int64_t(i) * h, h) : mat_view{};
    ops::causal_conv_forward(be_, {ctx.mixed.matrix().row_block(seg.token_begin, seg.count), halo, w.conv,
                                   ctx.conv.matrix().row_block(seg.token_begin, seg.count),
                                   documents_at(seg.position_begin)});
  }
  // The state entering each segment, from every segment's summary.
  const std::int64_t R = static_cast<std::int64_t>(order_.size());
  if (R > 1) {
    const phase_scope exchange(be_, "delta_exchange");
    const std::int64_t per = Hv * dk * (dk + dv), most = most_segments(segments_);
    tensor send = be_.allocate_zeroed(mem_tag::activations, dtype::f32, {most * per, 1}, "delta_summaries");
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const delta_rows r = rows_of(c, ctx.conv.matrix(), ctx.gates.matrix(), mine[i]);
      const tensor ws = workspace(mine[i].count, c.key_heads, c.value_heads, gated_delta_pass::summary);
      const std::int64_t at = std::int64_t(i) * per;
      const head_view transition{send.as<float>() + at, dtype::f32, Hv, dk, dk, dk * dk, dk};
      const head_view local{send.as<float>() + at + Hv * dk * dk, dtype::f32, Hv, dk, dv, dk * dv, dv};
      ops::gated_delta_summary(be_, {r.q, r.k, r.v, r.g, r.beta, transition, local, documents_at(mine[i].position_begin),
                                     {}, ws.matrix()});
    }
    tensor all = be_.allocate(mem_tag::activations, dtype::f32, {most * per * c.cp, 1}, "delta_summaries_all");
    comm_->all_gather(send.data(), all.data(), send.bytes(), "delta_summary");
    send.reset();
    ctx.transitions = be_.allocate(mem_tag::activations, dtype::f32, {R * Hv, dk, dk}, "delta_transitions");
    tensor locals = be_.allocate(mem_tag::activations, dtype::f32, {R * Hv, dk, dv}, "delta_locals");
    std::int64_t k = 0;  // rank-major segment index
    for (int r = 0; r < c.cp; ++r)
      for (std::size_t i = 0; i < segments_[r].size(); ++i, ++k) {
        const std::int64_t from = (r * most + std::int64_t(i)) * per, to = order_[k] * Hv;
        ops::copy_heads(be_, flat(ctx.transitions, to * dk * dk, Hv * dk * dk), flat(all, from, Hv * dk * dk));
        ops::copy_heads(be_, flat(locals, to * dk * dv, Hv * dk * dv), flat(all, from + Hv * dk * dk, Hv * dk * dv));
      }
    all.reset();
    ctx.states = be_.allocate(mem_tag::activations, dtype::f32, {R * Hv, dk, dv}, "delta_states");
    ops::gated_delta_scan(be_, {ctx.transitions.heads(), locals.heads(), ctx.states.heads(), Hv, scan_direction::forward});
  }
  std::int64_t k = 0;
  for (int r = 0; r < rank_; ++r) k += static_cast<std::int64_t>(segments_[r].size());
  const phase_scope recurrence(be_, "delta_recurrence");
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const delta_rows r = rows_of(c, ctx.conv.matrix(), ctx.gates.matrix(), mine[i]);
    const tensor ws = workspace(mine[i].count, c.key_heads, c.value_heads, gated_delta_pass::forward);
    const head_view initial = R > 1 ? matrices(ctx.states, order_[k + std::int64_t(i)] * Hv, Hv) : head_view{};
    ops::gated_delta_forward(be_, {r.q, r.k, r.v, r.g, r.beta, initial,
                                   heads_of(ctx.out.matrix().row_block(mine[i].token_begin, mine[i].count), 0, Hv, dv),
                                   head_view{}, documents_at(mine[i].position_begin), {}, ws.matrix()});
  }
}

void delta_layer::sequence_backward(context& ctx, const normed_input& x, const delta_weights& w, const mat_view& d_out,
                                    const mat_view& d_x, const delta_grads& grads) {
  const delta_config& c = config_;
  const std::int64_t s = c.local_tokens(), C = c.channels(), kw = c.key_width(), Hv = c.value_heads;
  const std::int64_t dk = c.key_dim, dv = c.value_dim, h = c.conv_kernel - 1;
  const auto& mine = segments();
  const std::int64_t R = static_cast<std::int64_t>(order_.size());
  std::int64_t first_global = 0;
  for (int r = 0; r < rank_; ++r) first_global += static_cast<std::int64_t>(segments_[r].size());
  // The gradient each segment's final state receives, from the later segments' outputs.
  tensor d_finals;
  if (R > 1) {
    const phase_scope exchange(be_, "delta_exchange");
    const std::int64_t per = Hv * dk * dv, most = most_segments(segments_);
    tensor send = be_.allocate_zeroed(mem_tag::activations, dtype::f32, {most * per, 1}, "delta_d_summaries");
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const delta_rows r = rows_of(c, ctx.conv.matrix(), ctx.gates.matrix(), mine[i]);
      const tensor ws = workspace(mine[i].count, c.key_heads, c.value_heads, gated_delta_pass::summary_backward);
      const head_view local{send.as<float>() + std::int64_t(i) * per, dtype::f32, Hv, dk, dv, dk * dv, dv};
      ops::gated_delta_summary_backward(
          be_, {r.q, r.k, r.g, r.beta, heads_of(d_out.row_block(mine[i].token_begin, mine[i].count), 0, Hv, dv), local,
                documents_at(mine[i].position_begin), {}, ws.matrix()});
    }
    tensor all = be_.allocate(mem_tag::activations, dtype::f32, {most * per * c.cp, 1}, "delta_d_summaries_all");
    comm_->all_gather(send.data(), all.data(), send.bytes(), "delta_summary_grad");
    send.reset();
    tensor locals = be_.allocate(mem_tag::activations, dtype::f32, {R * Hv, dk, dv}, "delta_d_locals");
    std::int64_t k = 0;
    for (int r = 0; r < c.cp; ++r)
      for (std::size_t i = 0; i < segments_[r].size(); ++i, ++k)
        ops::copy_heads(be_, flat(locals, order_[k] * per, per), flat(all, (r * most + std::int64_t(i)) * per, per));
    all.reset();
    d_finals = be_.allocate(mem_tag::activations, dtype::f32, {R * Hv, dk, dv}, "delta_d_finals");
    ops::gated_delta_scan(be_, {ctx.transitions.heads(), locals.heads(), d_finals.heads(), Hv, scan_direction::backward});
  }
  ctx.transitions.reset();
  // The recurrence's backward, segment by segment, into the convolved channels' gradients.
  tensor d_conv = be_.allocate(mem_tag::activations, be_.work_dtype(), {s, C}, "delta_d_conv");
  tensor d_gates = be_.allocate(mem_tag::activations, dtype::f32, {s, 2 * Hv}, "delta_d_gates");  // d_g | d_beta
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const phase_scope recurrence(be_, "delta_recurrence");
    const delta_segment& seg = mine[i];
    const delta_rows r = rows_of(c, ctx.conv.matrix(), ctx.gates.matrix(), seg);
    const delta_rows d = rows_of(c, d_conv.matrix(), d_gates.matrix(), seg);
    const tensor ws = workspace(seg.count, c.key_heads, c.value_heads, gated_delta_pass::backward);
    const std::int64_t global = R > 1 ? order_[first_global + std::int64_t(i)] * Hv : 0;
    ops::gated_delta_backward(
        be_, {r.q, r.k, r.v, r.g, r.beta, R > 1 ? matrices(ctx.states, global, Hv) : head_view{},
              heads_of(d_out.row_block(seg.token_begin, seg.count), 0, Hv, dv),
              R > 1 ? matrices(d_finals, global, Hv) : head_view{}, d.q, d.k, d.v, d.g, d.beta, head_view{},
              documents_at(seg.position_begin), {}, ws.matrix()});
  }
  d_finals.reset();
  ctx.states.reset();
  // The gates' backward: d_b | d_a over ab.
  tensor d_ab = be_.allocate(mem_tag::activations, be_.work_dtype(), {s, 2 * Hv}, "delta_d_ab");
  ops::gated_delta_gates_backward(be_, {ctx.ab.matrix().col_block(Hv, Hv), ctx.ab.matrix().col_block(0, Hv), w.a_log,
                                        w.dt_bias, d_gates.matrix().col_block(0, Hv), d_gates.matrix().col_block(Hv, Hv),
                                        d_ab.matrix().col_block(Hv, Hv), d_ab.matrix().col_block(0, Hv), grads.a_log,
                                        grads.dt_bias});
  d_gates.reset();
  // The convolution's backward, its halos' gradients back to their rows.
  tensor d_mixed = be_.allocate(mem_tag::activations, be_.work_dtype(), {s, C}, "delta_d_mixed");
  tensor d_halos = be_.allocate_zeroed(mem_tag::activations, be_.work_dtype(), ctx.halos.dims(), "delta_d_halo");
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const delta_segment& seg = mine[i];
    const std::int64_t at = std::int64_t(i) * h;
    ops::causal_conv_backward(be_, {ctx.mixed.matrix().row_block(seg.token_begin, seg.count),
                                    h > 0 ? ctx.halos.matrix().row_block(at, h) : mat_view{}, w.conv,
                                    d_conv.matrix().row_block(seg.token_begin, seg.count),
                                    d_mixed.matrix().row_block(seg.token_begin, seg.count),
                                    h > 0 ? d_halos.matrix().row_block(at, h) : mat_view{}, grads.conv,
                                    documents_at(seg.position_begin)});
  }
  d_conv.reset();
  mask_halos(d_halos.matrix());
  if (config_.cp > 1 || mine.size() > 1) scatter_halo_grads(d_halos, d_mixed.matrix());
  d_halos.reset();
  ctx.conv.reset();
  ctx.halos.reset();
  ctx.mixed.reset();
  ctx.gates.reset();
  ctx.ab.reset();
  // The input projections' backward: d_x and, a tile of x at a time, their weights'.
  const mat_view dm = d_mixed.matrix(), dab = d_ab.matrix();
  const std::pair<const projection*, mat_view> blocks[] = {
      {&w.q, dm.col_block(0, kw)}, {&w.k, dm.col_block(kw, kw)}, {&w.v, dm.col_block(2 * kw, c.value_width())},
      {&w.b, dab.col_block(0, Hv)}, {&w.a, dab.col_block(Hv, Hv)}};
  const projection_grads* block_grads[] = {&grads.q, &grads.k, &grads.v, &grads.b, &grads.a};
  std::vector<projection_backward> passes;
  passes.reserve(5);
  bool trains = false;
  for (std::size_t i = 0; i < 5; ++i) {
    passes.emplace_back(be_, *blocks[i].first, *block_grads[i], s);
    passes.back().input_grad(blocks[i].second, 0, d_x);
    passes.back().finish_input_grad(d_x);
    trains = trains || passes.back().trains();
  }
  if (!trains) return;
  for_each_input_tile(be_, x, [&](std::int64_t first, const mat_view& rows) {
    for (std::size_t i = 0; i < 5; ++i) {
      if (!passes[i].trains()) continue;
      passes[i].start_tile(first, rows);
      passes[i].weight_grad(blocks[i].second.row_block(first, rows.rows), 0);
    }
  });
}

}  // namespace upipe
