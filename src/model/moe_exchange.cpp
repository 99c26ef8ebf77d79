#include "model/moe_exchange.hpp"

#include <algorithm>
#include <string>

#include "backend/ops.hpp"
#include "core/error.hpp"

namespace upipe {

dispatch_bound worst_case_dispatch(std::int64_t tile_tokens, int top_k, int ep, int local_experts,
                                   std::int64_t capacity) {
  std::int64_t from_each = tile_tokens * std::min(top_k, local_experts), per_expert = tile_tokens;
  if (capacity > 0) {
    from_each = std::min(from_each, local_experts * capacity);
    per_expert = std::min(per_expert, capacity);
  }
  return {ep * from_each, ep * per_expert};
}

moe_exchange::moe_exchange(const model_config& model, backend& be, communicator& peers)
    : model_(model), be_(be), peers_(peers), local_(model.moe.experts / std::max(peers.size(), 1)) {
  UPIPE_CHECK(peers.size() >= 1 && model.moe.experts % peers.size() == 0,
              "the EP group of " + std::to_string(peers.size()) + " ranks must divide the " +
                  std::to_string(model.moe.experts) + " experts");  // Rank 0 alone (an emulated mesh) receives its own rows for every EP rank's experts, ids
  // of experts it does not hold: the planner's meta runs take this group, a run with data
  // does not yet.
  if (peers.is_loopback() && be.has_data())
    throw config_error("--ep " + std::to_string(peers.size()) +
                       " with an emulated mesh (rank 0 alone) is not supported: rank 0 would receive rows for "
                       "experts it does not hold; run every rank of the mesh (without --emulate-cp) or drop --ep");
}

namespace {

std::int64_t total(std::span<const std::size_t> rows) {
  std::int64_t n = 0;
  for (const std::size_t r : rows) n += static_cast<std::int64_t>(r);
  return n;
}

void* word_at(const mat_view& v, std::int64_t i) { return static_cast<std::byte*>(v.data) + i * 4; }

// An i32 column read as 4-byte f32 words: moe_permute copies rows bit for bit, so the
// experts' ids ride the rows' permute (no arithmetic touches them).
mat_view as_words(const mat_view& ids, std::int64_t rows) { return {ids.data, dtype::f32, rows, 1, 1}; }

}  // namespace

moe_exchange::plan moe_exchange::make_plan(const mat_view& offsets, const mat_view& position, const mat_view& choices,
                                           std::int64_t rows, std::int64_t capacity) {
  const int P = ranks(), L = local_, E = model_.moe.experts;
  UPIPE_CHECK(offsets.cols == E + 1, "an exchange's plan takes every expert's offsets");
  plan p;
  // Row 0: the slice of this rank's offsets that covers each EP rank's experts (L + 1 each);
  // row 1: the slices the EP ranks send here. One tensor, so that the host reads both at once.
  const std::int64_t slice = L + 1;
  tensor counts = be_.allocate(mem_tag::activations, dtype::i32, {2, P * slice}, "moe_ep_counts");
  const mat_view c = counts.matrix();
  for (int b = 0; b < P; ++b)
    be_.copy_bytes(word_at(c, b * slice), word_at(offsets, std::int64_t{b} * L), static_cast<std::size_t>(slice) * 4);
  peers_.all_to_all(c.data, word_at(c, c.ld), static_cast<std::size_t>(slice) * 4, "ep_counts");
  if (be_.has_data()) {
    std::vector<std::int32_t> host(static_cast<std::size_t>(2 * P * slice));
    be_.download_bytes(host.data(), counts, host.size() * sizeof(std::int32_t));  // the exchange's host read
    sizes_from_counts(p, host);
  } else {
    plan_without_data(p, rows, position.rows, capacity);
  }
  counts.reset();
  // Each dispatched row's expert, sent with the rows; the receiver dispatches by it.
  const std::int64_t n = choices.rows, k = choices.cols;
  tensor ids = be_.allocate(mem_tag::activations, dtype::i32, {rows, 1}, "moe_ep_experts_out");
  ops::moe_permute(be_, {as_words(choices, n * k),
                         {position.data, dtype::i32, n * k, 1, 1}, as_words(ids.matrix(), rows)});
  tensor ids_in = be_.allocate(mem_tag::activations, dtype::i32, {p.received, 1}, "moe_ep_experts_in");
  exchange(ids.matrix(), p.send_rows, p.recv_rows, ids_in.matrix(), "ep_experts");
  ids.reset();
  p.position = be_.allocate(mem_tag::activations, dtype::i32, {p.received, 1}, "moe_ep_position");
  p.offsets = be_.allocate(mem_tag::activations, dtype::i32, {1, std::int64_t{E} + 1}, "moe_ep_offsets");
  tensor scratch =
      be_.allocate(mem_tag::activations, dtype::i32, {moe_dispatch_scratch_rows(p.received), E}, "moe_ep_scratch");
  ops::moe_dispatch(be_, {ids_in.matrix(), p.position.matrix(), p.offsets.matrix(), scratch.matrix(), 0});
  return p;
}

// Row 0 of `host`: this rank's offsets per EP rank's slice; row 1: each source's for this
// rank's experts. The received rows lie source by source, each source's expert by expert.
void moe_exchange::sizes_from_counts(plan& p, const std::vector<std::int32_t>& host) {
  const int P = ranks(), L = local_;
  const std::size_t slice = static_cast<std::size_t>(L) + 1, received_at = static_cast<std::size_t>(P) * slice;
  const auto own = [&](int b, int j) { return std::int64_t{host[static_cast<std::size_t>(b) * slice + j]}; };
  const auto got = [&](int s, int j) { return std::int64_t{host[received_at + static_cast<std::size_t>(s) * slice + j]}; };
  p.send_rows.assign(static_cast<std::size_t>(P), 0);
  p.recv_rows.assign(static_cast<std::size_t>(P), 0);
  p.host_offsets.assign(slice, 0);
  for (int b = 0; b < P; ++b) {
    p.send_rows[static_cast<std::size_t>(b)] = static_cast<std::size_t>(own(b, L) - own(b, 0));
    p.recv_rows[static_cast<std::size_t>(b)] = static_cast<std::size_t>(got(b, L) - got(b, 0));
  }
  for (int e = 0; e < L; ++e) {
    std::int64_t rows = 0;
    for (int s = 0; s < P; ++s) rows += got(s, e + 1) - got(s, e);
    p.host_offsets[static_cast<std::size_t>(e) + 1] = p.host_offsets[static_cast<std::size_t>(e)] + rows;
  }
  p.sent = total(p.send_rows);
  p.received = total(p.recv_rows);
}

// Without data: this rank's rows spread over the EP ranks, and the worst case received
// (worst_case_dispatch), its first expert holding the most one expert can.
void moe_exchange::plan_without_data(plan& p, std::int64_t rows, std::int64_t tile_tokens, std::int64_t capacity) {
  const int P = ranks(), L = local_;
  const dispatch_bound bound = worst_case_dispatch(tile_tokens, model_.moe.top_k, P, L, capacity);
  const std::int64_t R = bound.rank_rows, first = std::min(bound.expert_rows, R);
  p.send_rows.assign(static_cast<std::size_t>(P), 0);
  p.recv_rows.assign(static_cast<std::size_t>(P), 0);
  for (int b = 0; b < P; ++b) {
    p.send_rows[static_cast<std::size_t>(b)] = static_cast<std::size_t>(rows * (b + 1) / P - rows * b / P);
    p.recv_rows[static_cast<std::size_t>(b)] = static_cast<std::size_t>(R * (b + 1) / P - R * b / P);
  }
  p.host_offsets.assign(static_cast<std::size_t>(L) + 1, R);
  p.host_offsets[0] = 0;
  for (int e = 1; e < L; ++e) p.host_offsets[static_cast<std::size_t>(e)] = first + (R - first) * (e - 1) / (L - 1);
  p.sent = rows;
  p.received = R;
}

mat_view moe_exchange::group_offsets(const plan& p) const {
  return p.offsets.matrix().col_block(first_expert(), std::int64_t{local_} + 1);
}

void moe_exchange::exchange(const mat_view& rows, std::span<const std::size_t> send_rows,
                            std::span<const std::size_t> recv_rows, const mat_view& into, const char* label) {
  UPIPE_CHECK(rows.ld == rows.cols && into.ld == into.cols && rows.cols == into.cols,
              "the exchanged rows must be contiguous, of one width");
  UPIPE_CHECK(total(send_rows) <= rows.rows && total(recv_rows) <= into.rows,
              "an exchange sends rows it holds and receives into rows it has");
  const std::size_t row_bytes = static_cast<std::size_t>(rows.cols) * dtype_size(rows.type);
  std::vector<std::size_t> send_bytes(send_rows.begin(), send_rows.end()), recv_bytes(recv_rows.begin(), recv_rows.end());
  for (std::size_t& b : send_bytes) b *= row_bytes;
  for (std::size_t& b : recv_bytes) b *= row_bytes;
  peers_.all_to_all_v(rows.data, send_bytes, into.data, recv_bytes, label);
}

tensor moe_exchange::to_experts(const plan& p, const mat_view& rows, const char* label) {
  tensor ordered = be_.allocate(mem_tag::activations, rows.type, {p.received, rows.cols}, "moe_ep_rows_in");
  tensor received = be_.allocate(mem_tag::activations, rows.type, {p.received, rows.cols}, "moe_ep_received");
  exchange(rows, p.send_rows, p.recv_rows, received.matrix(), label);
  ops::moe_permute(be_, {received.matrix(), p.position.matrix(), ordered.matrix()});
  return ordered;
}

tensor moe_exchange::to_sources(const plan& p, const mat_view& rows, std::int64_t m, const char* label) {
  tensor back = be_.allocate(mem_tag::activations, rows.type, {m, rows.cols}, "moe_ep_rows_back");
  tensor by_source = be_.allocate_zeroed(mem_tag::activations, rows.type, {p.received, rows.cols}, "moe_ep_rows_out");
  // by_source[i] = rows[position[i]]: the received order again (a sum of one term, exact).
  ops::moe_combine(be_, {rows, p.position.matrix(), {}, {}, {}, by_source.matrix()});
  exchange(by_source.matrix(), p.recv_rows, p.send_rows, back.matrix(), label);
  return back;
}

}  // namespace upipe
