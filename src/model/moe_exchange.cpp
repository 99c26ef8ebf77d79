#include "model/moe_exchange.hpp"

#include <algorithm>
#include <string>

#include "backend/ops.hpp"
#include "core/error.hpp"
#include "model/moe_mlp.hpp"

namespace upipe {

dispatch_bound worst_case_dispatch(std::int64_t tile_tokens, int top_k, int ep, int local_experts) {
  return {ep * tile_tokens * std::min(top_k, local_experts), ep * tile_tokens};
}

moe_exchange::moe_exchange(const model_config& model, backend& be, communicator& peers)
    : model_(model), be_(be), peers_(peers), local_(model.moe.experts / std::max(peers.size(), 1)) {
  UPIPE_CHECK(peers.size() >= 1 && model.moe.experts % peers.size() == 0,
              "the EP group of " + std::to_string(peers.size()) + " ranks must divide the " +
                  std::to_string(model.moe.experts) + " experts");
}

namespace {

tensor index_column(backend& be, std::int64_t rows, const char* label) {
  return be.allocate(mem_tag::activations, dtype::i32, {rows, 1}, label);
}

void upload_index(backend& be, const tensor& t, const std::vector<std::int32_t>& values) {
  if (be.has_data() && !values.empty()) be.upload_bytes(t, values.data(), values.size() * sizeof(std::int32_t));
}

std::int64_t total(std::span<const std::size_t> rows) {
  std::int64_t n = 0;
  for (const std::size_t r : rows) n += static_cast<std::int64_t>(r);
  return n;
}

}  // namespace

moe_exchange::plan moe_exchange::make_plan(std::span<const std::int64_t> offsets, std::int64_t tile_tokens) {
  const int E = ranks(), L = local_, experts = model_.moe.experts;
  UPIPE_CHECK(static_cast<int>(offsets.size()) == experts + 1, "an exchange's plan takes every expert's rows");
  plan p;
  p.send_rows.assign(static_cast<std::size_t>(E), 0);
  p.recv_rows.assign(static_cast<std::size_t>(E), 0);
  // This rank's count of each expert, and (after the exchange) each source's count of each
  // local expert: one tensor, so that the host reads both at once.
  tensor counts = be_.allocate(mem_tag::activations, dtype::i32, {1, 2 * std::int64_t{experts}}, "moe_ep_counts");
  std::vector<std::int32_t> host(static_cast<std::size_t>(2 * experts), 0);
  for (int e = 0; e < experts; ++e)
    host[static_cast<std::size_t>(e)] = static_cast<std::int32_t>(offsets[e + 1] - offsets[e]);
  if (be_.has_data()) be_.upload_bytes(counts, host.data(), static_cast<std::size_t>(experts) * sizeof(std::int32_t));
  auto* base = static_cast<std::int32_t*>(counts.data());
  peers_.all_to_all(base, base == nullptr ? nullptr : base + experts, static_cast<std::size_t>(L) * sizeof(std::int32_t),
                    "ep_counts");
  if (!be_.has_data()) {
    plan_without_data(p, offsets, tile_tokens);
    return p;
  }
  be_.download_bytes(host.data(), counts, host.size() * sizeof(std::int32_t));  // the host read of the exchange
  const auto own = [&](int e) { return static_cast<std::int64_t>(host[static_cast<std::size_t>(e)]); };
  const auto got = [&](int src, int e) { return static_cast<std::int64_t>(host[static_cast<std::size_t>(experts + src * L + e)]); };
  for (int b = 0; b < E; ++b)
    for (int e = 0; e < L; ++e) {
      p.send_rows[static_cast<std::size_t>(b)] += static_cast<std::size_t>(own(b * L + e));
      p.recv_rows[static_cast<std::size_t>(b)] += static_cast<std::size_t>(got(b, e));
    }
  // The received rows lie source by source, each source's expert by expert; the experts'
  // order takes expert by expert, each expert's source by source.
  std::vector<std::int64_t> source_start(static_cast<std::size_t>(E) + 1, 0);
  for (int s = 0; s < E; ++s) source_start[s + 1] = source_start[s] + static_cast<std::int64_t>(p.recv_rows[s]);
  const std::int64_t R = source_start.back();
  std::vector<std::int32_t> to_experts(static_cast<std::size_t>(R)), to_sources(static_cast<std::size_t>(R));
  p.offsets.assign(static_cast<std::size_t>(L) + 1, 0);
  std::int64_t place = 0;
  for (int e = 0; e < L; ++e) {
    for (int s = 0; s < E; ++s) {
      std::int64_t at = source_start[s];
      for (int f = 0; f < e; ++f) at += got(s, f);
      for (std::int64_t i = 0; i < got(s, e); ++i, ++place) {
        to_experts[static_cast<std::size_t>(place)] = static_cast<std::int32_t>(at + i);
        to_sources[static_cast<std::size_t>(at + i)] = static_cast<std::int32_t>(place);
      }
    }
    p.offsets[static_cast<std::size_t>(e) + 1] = place;
  }
  p.to_experts = index_column(be_, R, "moe_ep_to_experts");
  p.to_sources = index_column(be_, R, "moe_ep_to_sources");
  p.rows = index_column(be_, R, "moe_ep_rows");
  upload_index(be_, p.to_experts, to_experts);
  upload_index(be_, p.to_sources, to_sources);
  std::vector<std::int32_t> rows(static_cast<std::size_t>(R));
  for (std::int64_t i = 0; i < R; ++i) rows[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i);
  upload_index(be_, p.rows, rows);
  return p;
}

// Without data: this rank's rows spread over the EP ranks, and the worst case received
// (worst_case_dispatch), its first expert holding the most one expert can.
void moe_exchange::plan_without_data(plan& p, std::span<const std::int64_t> offsets, std::int64_t tile_tokens) {
  const int E = ranks(), L = local_;
  const std::int64_t m = offsets.back();
  const dispatch_bound bound = worst_case_dispatch(tile_tokens, model_.moe.top_k, E, L);
  const std::int64_t R = bound.rank_rows, first = std::min(bound.expert_rows, R);
  for (int b = 0; b < E; ++b) {
    p.send_rows[static_cast<std::size_t>(b)] = static_cast<std::size_t>(m * (b + 1) / E - m * b / E);
    p.recv_rows[static_cast<std::size_t>(b)] = static_cast<std::size_t>(R * (b + 1) / E - R * b / E);
  }
  p.offsets.assign(static_cast<std::size_t>(L) + 1, R);
  p.offsets[0] = 0;
  for (int e = 1; e < L; ++e) p.offsets[static_cast<std::size_t>(e)] = first + (R - first) * (e - 1) / (L - 1);
  p.to_experts = index_column(be_, R, "moe_ep_to_experts");
  p.to_sources = index_column(be_, R, "moe_ep_to_sources");
  p.rows = index_column(be_, R, "moe_ep_rows");
}

tensor moe_exchange::exchange(const mat_view& rows, std::span<const std::size_t> send_rows,
                              std::span<const std::size_t> recv_rows, const char* label) {
  UPIPE_CHECK(rows.ld == rows.cols, "the exchanged rows must be contiguous");
  const std::size_t row_bytes = static_cast<std::size_t>(rows.cols) * dtype_size(rows.type);
  std::vector<std::size_t> send_bytes(send_rows.begin(), send_rows.end()), recv_bytes(recv_rows.begin(), recv_rows.end());
  for (std::size_t& b : send_bytes) b *= row_bytes;
  for (std::size_t& b : recv_bytes) b *= row_bytes;
  UPIPE_CHECK(total(send_rows) == rows.rows, "an exchange sends every row once");
  tensor out = be_.allocate(mem_tag::activations, rows.type, {total(recv_rows), rows.cols}, "moe_ep_received");
  peers_.all_to_all_v(rows.data, send_bytes, out.data(), recv_bytes, label);
  return out;
}

tensor moe_exchange::dispatch(const plan& p, const mat_view& rows, const char* label) {
  tensor received = exchange(rows, p.send_rows, p.recv_rows, label);
  tensor ordered = be_.allocate(mem_tag::activations, rows.type, received.dims(), "moe_ep_rows_in");
  ops::moe_gather(be_, {received.matrix(), p.to_experts.matrix(), ordered.matrix()});
  return ordered;
}

tensor moe_exchange::combine(const plan& p, const mat_view& rows, const char* label) {
  tensor by_source = be_.allocate(mem_tag::activations, rows.type, {rows.rows, rows.cols}, "moe_ep_rows_out");
  ops::moe_gather(be_, {rows, p.to_sources.matrix(), by_source.matrix()});
  return exchange(by_source.matrix(), p.recv_rows, p.send_rows, label);
}

// ---------------------------------------------------------------------------------------
// The sparse layer's experts behind the exchange (moe_mlp's hooks).

void moe_mlp::exchanged_forward(const moe_weights& w, const routing& r, tensor gathered, const mat_view& y,
                                std::int64_t n) {
  moe_exchange::plan p = exchange_->make_plan(r.offsets, n);
  tensor out;
  {
    tensor x = exchange_->dispatch(p, gathered.matrix(), "ep_dispatch");
    gathered.reset();
    out = be_.allocate_zeroed(mem_tag::activations, be_.work_dtype(), x.dims(), "moe_ep_out");
    experts_forward(w, x.matrix(), p.offsets, {p.rows.matrix(), {}, {}, out.matrix(), {}, {}});
  }
  tensor back = exchange_->combine(p, out.matrix(), "ep_combine");
  out.reset();
  ops::moe_scatter(be_, {back.matrix(), r.index.matrix(), r.slot.matrix(), r.weights.matrix(), y});
}

// The experts' ranks take the rows, the incoming gradient's rows and the routing weights
// of their choices; the rows' gradients and the weights' gradients come back.
void moe_mlp::exchanged_backward(const moe_weights& w, const moe_grads& g, const routing& r, tensor gathered,
                                 const mat_view& d_y, const mat_view& d_h, const mat_view& d_weights, std::int64_t n) {
  const std::int64_t m = gathered.matrix().rows, D = model_.hidden_size, k = model_.moe.top_k;
  moe_exchange::plan p = exchange_->make_plan(r.offsets, n);
  const mat_view flat_weights{r.weights.data(), dtype::f32, n * k, 1, 1};
  const mat_view flat_d_weights{d_weights.data, dtype::f32, n * k, 1, 1};
  tensor d_x, d_w;
  {
    tensor x = exchange_->dispatch(p, gathered.matrix(), "ep_dispatch");
    gathered.reset();
    tensor dy, weights;
    {
      tensor rows = be_.allocate(mem_tag::activations, dtype::f32, {m, D}, "moe_ep_d_y");
      ops::moe_gather(be_, {d_y, r.index.matrix(), rows.matrix()});
      dy = exchange_->dispatch(p, rows.matrix(), "ep_dispatch_grad");
      tensor chosen = be_.allocate(mem_tag::activations, dtype::f32, {m, 1}, "moe_ep_weights");
      ops::moe_gather(be_, {flat_weights, r.slot.matrix(), chosen.matrix()});
      weights = exchange_->dispatch(p, chosen.matrix(), "ep_dispatch_weights");
    }
    tensor d_rows = be_.allocate_zeroed(mem_tag::activations, dtype::f32, x.dims(), "moe_ep_d_rows");
    tensor d_chosen = be_.allocate_zeroed(mem_tag::activations, dtype::f32, weights.dims(), "moe_ep_d_weights");
    const mat_view rows = p.rows.matrix();
    experts_backward(w, g, x.matrix(), p.offsets,
                     {rows, rows, weights.matrix(), dy.matrix(), d_chosen.matrix(), d_rows.matrix()});
    d_x = exchange_->combine(p, d_rows.matrix(), "ep_combine_grad");
    d_w = exchange_->combine(p, d_chosen.matrix(), "ep_combine_weights");
  }
  ops::moe_scatter(be_, {d_x.matrix(), r.index.matrix(), {}, {}, d_h});
  ops::moe_scatter(be_, {d_w.matrix(), r.slot.matrix(), {}, {}, flat_d_weights});
}

}  // namespace upipe
