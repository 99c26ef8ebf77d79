// The Gated DeltaNet layer over the head layouts (cp/delta_layer.hpp): ulysses and upipe
// without sequence chunks, whose ranks hold contiguous shards. Stage by stage, U value heads a
// stage (u = U / C a rank), the shard's projections of each rank's heads go out in one
// all-to-all (q and k of its key heads, v, b and a of its value heads, side by side), so that
// each rank holds whole sequences of its heads: the convolution, the gates and the recurrence
// run locally over the sequence, and a second all-to-all brings the output home. A rank's u
// value heads hold whole key-head groups (u / G key heads) or lie in one (that key head, sent
// to each of the ranks that share it; their gradients add up at home).
#include <algorithm>

#include "backend/ops.hpp"
#include "core/error.hpp"
#include "cp/delta_layer.hpp"

namespace upipe {
namespace {

head_view heads_at(const mat_view& m, std::int64_t first, std::int64_t heads, std::int64_t dim) {
  const mat_view c = m.col_block(first, heads * dim);
  return {c.data, c.type, c.rows, heads, dim, c.ld, dim};
}

// One stage's shape and each rank's heads in it.
struct stage_shape {
  std::int64_t u = 0, nk = 0;                 // value and key heads a rank
  std::int64_t dk = 0, dv = 0;
  std::int64_t first_value = 0;               // the stage's first value head
  std::int64_t group = 1;                     // G: value heads per key head
  std::int64_t value_of(int rank) const { return first_value + rank * u; }
  std::int64_t key_of(int rank) const { return value_of(rank) / group; }
  // Columns of a rank's row: q | k | v | b | a.
  std::int64_t q() const { return 0; }
  std::int64_t k() const { return nk * dk; }
  std::int64_t v() const { return 2 * nk * dk; }
  std::int64_t b() const { return 2 * nk * dk + u * dv; }
  std::int64_t a() const { return b() + u; }
  std::int64_t width() const { return a() + u; }
  std::int64_t channels() const { return b(); }  // the convolved ones
};

stage_shape shape_of(const delta_config& c, int stage_heads, int stage) {
  stage_shape s;
  s.u = stage_heads / c.cp;
  s.group = c.value_heads / c.key_heads;
  s.nk = std::max<std::int64_t>(1, s.u / s.group);
  s.dk = c.key_dim;
  s.dv = c.value_dim;
  s.first_value = std::int64_t{stage} * stage_heads;
  return s;
}

// The projections of every rank's heads of a stage into the all-to-all's send layout: chunk
// j (rows [j s, (j + 1) s)) holds this shard's q | k | v | b | a of rank j's heads. The input
// comes whole or a tile of rows at a time (the backward's), as the attention's projections take it.
void project_stage(backend& be, const delta_weights& w, const normed_input& x, const stage_shape& st, int ranks,
                   const mat_view& send) {
  const std::int64_t s = x.row_count();
  for_each_input_tile(be, x, [&](std::int64_t first, const mat_view& rows) {
    const projection_forward q(be, w.q, rows), k(be, w.k, rows), v(be, w.v, rows), b(be, w.b, rows), a(be, w.a, rows);
    for (int j = 0; j < ranks; ++j) {
      const mat_view out = send.row_block(j * s + first, rows.rows);
      q.rows(st.key_of(j) * st.dk, st.nk * st.dk, out.col_block(st.q(), st.nk * st.dk));
      k.rows(st.key_of(j) * st.dk, st.nk * st.dk, out.col_block(st.k(), st.nk * st.dk));
      v.rows(st.value_of(j) * st.dv, st.u * st.dv, out.col_block(st.v(), st.u * st.dv));
      b.rows(st.value_of(j), st.u, out.col_block(st.b(), st.u));
      a.rows(st.value_of(j), st.u, out.col_block(st.a(), st.u));
    }
  });
}

// The conv weight rows of this rank's channels: its key heads' q and k, its value heads' v.
struct conv_blocks {
  mat_view q, k, v;
};
conv_blocks conv_rows(const delta_config& c, const mat_view& conv, const stage_shape& st, int rank) {
  if (conv.rows == 0) return {};
  const std::int64_t kw = c.key_width();
  return {conv.row_block(st.key_of(rank) * st.dk, st.nk * st.dk),
          conv.row_block(kw + st.key_of(rank) * st.dk, st.nk * st.dk),
          conv.row_block(2 * kw + st.value_of(rank) * st.dv, st.u * st.dv)};
}

}  // namespace

// The stage's inputs gathered to whole sequences, convolved, and their gates.
struct delta_stage {
  tensor gathered;  // (S, width): q | k | v | b | a of this rank's heads, in sequence order
  tensor conv;      // (S, channels)
  tensor gates;     // (S, 2u) f32: g | beta
};

namespace {

delta_stage gather_stage(backend& be, communicator& comm, const delta_config& c, const delta_weights& w,
                         const normed_input& x, const stage_shape& st, int rank, const sequence_documents& documents) {
  const std::int64_t s = c.local_tokens(), S = c.seq_len;
  delta_stage out;
  {
    tensor send = be.allocate(mem_tag::activations, be.work_dtype(), {S, st.width()}, "delta_a2a_send");
    project_stage(be, w, x, st, c.cp, send.matrix());
    out.gathered = be.allocate(mem_tag::activations, be.work_dtype(), {S, st.width()}, "delta_a2a_recv");
    comm.all_to_all(send.data(), out.gathered.data(), static_cast<std::size_t>(s * st.width()) * dtype_size(be.work_dtype()),
                    "delta_a2a_in");
  }
  const mat_view g = out.gathered.matrix();
  out.conv = be.allocate(mem_tag::activations, be.work_dtype(), {S, st.channels()}, "delta_conv");
  const conv_blocks cw = conv_rows(c, w.conv, st, rank);
  const std::int64_t widths[] = {st.nk * st.dk, st.nk * st.dk, st.u * st.dv};
  const std::int64_t firsts[] = {st.q(), st.k(), st.v()};
  const mat_view weights[] = {cw.q, cw.k, cw.v};
  for (int i = 0; i < 3; ++i)
    ops::causal_conv_forward(be, {g.col_block(firsts[i], widths[i]), mat_view{}, weights[i],
                                  out.conv.matrix().col_block(firsts[i], widths[i]), documents});
  out.gates = be.allocate(mem_tag::activations, dtype::f32, {S, 2 * st.u}, "delta_gates");
  ops::gated_delta_gates_forward(be, {g.col_block(st.a(), st.u), g.col_block(st.b(), st.u),
                                      w.a_log.col_block(st.value_of(rank), st.u),
                                      w.dt_bias.col_block(st.value_of(rank), st.u),
                                      out.gates.matrix().col_block(0, st.u), out.gates.matrix().col_block(st.u, st.u)});
  return out;
}

}  // namespace

void delta_layer::heads_forward(context& ctx, const mat_view& x, const delta_weights& w) {
  const delta_config& c = config_;
  const std::int64_t s = c.local_tokens(), S = c.seq_len;
  for (int t = 0; t < c.value_heads / stage_heads_; ++t) {
    const stage_shape st = shape_of(c, stage_heads_, t);
    delta_stage stage = gather_stage(be_, *comm_, c, w, normed_input(x), st, rank_, documents_at(0));
    tensor o = be_.allocate(mem_tag::activations, be_.work_dtype(), {S, st.u * st.dv}, "delta_stage_out");
    {
      const phase_scope recurrence(be_, "delta_recurrence");
      const tensor ws = workspace(S, static_cast<int>(st.nk), static_cast<int>(st.u), gated_delta_pass::forward);
      const mat_view conv = stage.conv.matrix(), gates = stage.gates.matrix();
      ops::gated_delta_forward(be_, {heads_at(conv, st.q(), st.nk, st.dk), heads_at(conv, st.k(), st.nk, st.dk),
                                     heads_at(conv, st.v(), st.u, st.dv), gates.col_block(0, st.u),
                                     gates.col_block(st.u, st.u), head_view{}, heads_at(o.matrix(), 0, st.u, st.dv),
                                     head_view{}, documents_at(0), {}, ws.matrix()});
    }
    stage = {};
    tensor home = be_.allocate(mem_tag::activations, be_.work_dtype(), {S, st.u * st.dv}, "delta_a2a_out");
    comm_->all_to_all(o.data(), home.data(), static_cast<std::size_t>(s * st.u * st.dv) * dtype_size(be_.work_dtype()),
                      "delta_a2a_out");
    o.reset();
    for (int j = 0; j < c.cp; ++j)
      ops::copy_heads(be_, ops::as_heads(ctx.out.matrix().col_block(st.value_of(j) * st.dv, st.u * st.dv)),
                      ops::as_heads(home.matrix().row_block(j * s, s)));
  }
}

void delta_layer::heads_backward(const normed_input& x, const delta_weights& w, const mat_view& d_out,
                                 const mat_view& d_x, const delta_grads& grads) {
  const delta_config& c = config_;
  const std::int64_t s = c.local_tokens(), S = c.seq_len;
  const std::size_t work = dtype_size(be_.work_dtype());
  for (int t = 0; t < c.value_heads / stage_heads_; ++t) {
    const stage_shape st = shape_of(c, stage_heads_, t);
    // d_o of this rank's heads over the whole sequence.
    tensor d_o = be_.allocate(mem_tag::activations, be_.work_dtype(), {S, st.u * st.dv}, "delta_a2a_d_out");
    {
      tensor send = be_.allocate(mem_tag::activations, be_.work_dtype(), {S, st.u * st.dv}, "delta_a2a_d_send");
      for (int j = 0; j < c.cp; ++j)
        ops::copy_heads(be_, ops::as_heads(send.matrix().row_block(j * s, s)),
                        ops::as_heads(d_out.col_block(st.value_of(j) * st.dv, st.u * st.dv)));
      comm_->all_to_all(send.data(), d_o.data(), static_cast<std::size_t>(s * st.u * st.dv) * work, "delta_a2a_d_in");
    }
    // The stage's inputs again, projected from x whole or a tile at a time.
    delta_stage stage = gather_stage(be_, *comm_, c, w, x, st, rank_, documents_at(0));
    tensor d_gathered = be_.allocate_zeroed(mem_tag::activations, be_.work_dtype(), {S, st.width()}, "delta_d_gathered");
    const mat_view dg = d_gathered.matrix(), g = stage.gathered.matrix();
    {
      tensor d_conv = be_.allocate(mem_tag::activations, be_.work_dtype(), {S, st.channels()}, "delta_d_conv");
      tensor d_gates = be_.allocate(mem_tag::activations, dtype::f32, {S, 2 * st.u}, "delta_d_gates");
      const mat_view conv = stage.conv.matrix(), gates = stage.gates.matrix();
      const mat_view dc = d_conv.matrix(), dgt = d_gates.matrix();
      {
        const phase_scope recurrence(be_, "delta_recurrence");
        const tensor ws = workspace(S, static_cast<int>(st.nk), static_cast<int>(st.u), gated_delta_pass::backward);
        ops::gated_delta_backward(
            be_, {heads_at(conv, st.q(), st.nk, st.dk), heads_at(conv, st.k(), st.nk, st.dk),
                  heads_at(conv, st.v(), st.u, st.dv), gates.col_block(0, st.u), gates.col_block(st.u, st.u),
                  head_view{}, heads_at(d_o.matrix(), 0, st.u, st.dv), head_view{},
                  heads_at(dc, st.q(), st.nk, st.dk), heads_at(dc, st.k(), st.nk, st.dk),
                  heads_at(dc, st.v(), st.u, st.dv), dgt.col_block(0, st.u), dgt.col_block(st.u, st.u), head_view{},
                  documents_at(0), {}, ws.matrix()});
      }
      d_o.reset();
      const mat_view no_rows{};
      ops::gated_delta_gates_backward(
          be_, {g.col_block(st.a(), st.u), g.col_block(st.b(), st.u), w.a_log.col_block(st.value_of(rank_), st.u),
                w.dt_bias.col_block(st.value_of(rank_), st.u), dgt.col_block(0, st.u), dgt.col_block(st.u, st.u),
                dg.col_block(st.a(), st.u), dg.col_block(st.b(), st.u),
                grads.a_log.rows > 0 ? grads.a_log.col_block(st.value_of(rank_), st.u) : no_rows,
                grads.dt_bias.rows > 0 ? grads.dt_bias.col_block(st.value_of(rank_), st.u) : no_rows});
      const conv_blocks cw = conv_rows(c, w.conv, st, rank_), cg = conv_rows(c, grads.conv, st, rank_);
      const std::int64_t widths[] = {st.nk * st.dk, st.nk * st.dk, st.u * st.dv};
      const std::int64_t firsts[] = {st.q(), st.k(), st.v()};
      const mat_view weights[] = {cw.q, cw.k, cw.v}, weight_grads[] = {cg.q, cg.k, cg.v};
      for (int i = 0; i < 3; ++i)
        ops::causal_conv_backward(be_, {g.col_block(firsts[i], widths[i]), mat_view{}, weights[i],
                                        dc.col_block(firsts[i], widths[i]), dg.col_block(firsts[i], widths[i]),
                                        mat_view{}, weight_grads[i], documents_at(0)});
    }
    stage = {};
    // Home: chunk j holds this shard's gradients of rank j's heads' projections.
    tensor d_home = be_.allocate(mem_tag::activations, be_.work_dtype(), {S, st.width()}, "delta_a2a_d_home");
    comm_->all_to_all(d_gathered.data(), d_home.data(), static_cast<std::size_t>(s * st.width()) * work, "delta_a2a_d_out");
    d_gathered.reset();
    const projection* ws[] = {&w.q, &w.k, &w.v, &w.b, &w.a};
    const projection_grads* gs[] = {&grads.q, &grads.k, &grads.v, &grads.b, &grads.a};
    const auto block = [&](int p, int j) -> std::pair<std::int64_t, mat_view> {  // (first row, d of the block)
      const mat_view d = d_home.matrix().row_block(j * s, s);
      switch (p) {
        case 0: return {st.key_of(j) * st.dk, d.col_block(st.q(), st.nk * st.dk)};
        case 1: return {st.key_of(j) * st.dk, d.col_block(st.k(), st.nk * st.dk)};
        case 2: return {st.value_of(j) * st.dv, d.col_block(st.v(), st.u * st.dv)};
        case 3: return {st.value_of(j), d.col_block(st.b(), st.u)};
        default: return {st.value_of(j), d.col_block(st.a(), st.u)};
      }
    };
    std::vector<projection_backward> passes;
    passes.reserve(5);
    bool trains = false;
    for (int p = 0; p < 5; ++p) {
      passes.emplace_back(be_, *ws[p], *gs[p], s);
      for (int j = 0; j < c.cp; ++j) {
        const auto [first, d] = block(p, j);
        passes.back().input_grad(d, first, d_x);
      }
      passes.back().finish_input_grad(d_x);
      trains = trains || passes.back().trains();
    }
    if (!trains) continue;
    for_each_input_tile(be_, x, [&](std::int64_t first_row, const mat_view& rows) {
      for (int p = 0; p < 5; ++p) {
        if (!passes[p].trains()) continue;
        passes[p].start_tile(first_row, rows);
        for (int j = 0; j < c.cp; ++j) {
          const auto [first, d] = block(p, j);
          passes[p].weight_grad(d.row_block(first_row, rows.rows), first);
        }
      }
    });
  }
}

}  // namespace upipe
