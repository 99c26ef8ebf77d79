#include "cp/ring.hpp"

#include <cmath>
#include <limits>

#include "backend/ops.hpp"
#include "core/error.hpp"
#include "cp/head_norm.hpp"

namespace upipe {

namespace {

head_view lse_view(const tensor& lse) {  // (H, s) f32 as (s, H, 1)
  return {lse.data(), dtype::f32, lse.dims()[1], lse.dims()[0], 1, 1, lse.dims()[1]};
}

// Part `which` (0: k, 1: v) of a (2, n, K, d) buffer as (n, K, d).
head_view kv_part(const tensor& kv, int which) {
  const auto& d = kv.dims();
  const head_view all = {kv.data(), kv.type(), 2 * d[1], d[2], d[3], d[2] * d[3], d[3]};
  return all.token_block(which * d[1], d[1]);
}

head_view half(const ring_shape& shape, const head_view& v, int which) {
  return v.token_block(which * shape.chunk, shape.chunk);
}

// A pair of local query half and visiting kv half that attend, and how.
struct block_pair {
  int q_half, kv_half;
  attn_mask mask;
  document_mask documents;
};

// Global chunk c attends to chunk b fully when b < c, causally when b == c, never after;
// a block wholly outside the window, or (with packed documents) none of whose pairs shares
// a document, is skipped.
std::vector<block_pair> pairs(const ring_shape& shape, int q_rank, int kv_owner,
                              const std::vector<std::int64_t>& docs) {
  const int c2 = 2 * shape.size;
  const int q_chunks[2] = {q_rank, c2 - 1 - q_rank}, kv_chunks[2] = {kv_owner, c2 - 1 - kv_owner};
  std::vector<block_pair> result;
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b) {
      if (kv_chunks[b] > q_chunks[a]) continue;
      const document_mask m{docs, q_chunks[a] * shape.chunk, kv_chunks[b] * shape.chunk};
      if (!m.shares_document(shape.chunk, shape.chunk, shape.window)) continue;
      result.push_back({a, b, kv_chunks[b] == q_chunks[a] ? attn_mask::causal : attn_mask::none, m});
    }
  return result;
}

std::vector<block_pair> pairs(const ring_shape& shape, int kv_owner) {
  static const std::vector<std::int64_t> none;
  return pairs(shape, shape.rank, kv_owner, shape.documents != nullptr ? *shape.documents : none);
}

// Either side of an exchange may be skipped.
const void* sent(bool send, const tensor& t) { return send ? t.data() : nullptr; }
std::size_t bytes_if(bool yes, const tensor& t) { return yes ? t.bytes() : 0; }

// Step `step`'s K/V exchange: this rank's go to step.to where they reach it, and the K/V of
// step.from arrive (an empty tensor where none do).
tensor exchange_kv(backend& be, communicator& ring, const ring_step& step, const tensor& kv) {
  tensor visiting = step.receive ? be.allocate(mem_tag::attention, kv.type(), kv.dims(), "ring_kv") : tensor();
  ring.send_recv(sent(step.send, kv), bytes_if(step.send, kv), step.to, visiting.data(), bytes_if(step.receive, kv),
                 step.from, "ring_kv");
  return visiting;
}

}  // namespace

bool ring_reaches(const ring_shape& shape, int q_rank, int kv_owner) {
  static const std::vector<std::int64_t> none;
  return !pairs(shape, q_rank, kv_owner, none).empty();
}

ring_step ring_step_at(const ring_shape& shape, int s) {
  const int R = shape.size, r = shape.rank;
  const int to = (r + s) % R, from = (r - s + R) % R;
  return {to, from, ring_reaches(shape, to, r), ring_reaches(shape, r, from)};
}

void ring_core_forward(backend& be, communicator& ring, const ring_shape& shape, const head_view& q, tensor kv,
                       const head_view& out, const head_view& lse) {
  const std::int64_t n = q.heads, d = q.dim;
  tensor out_acc = be.allocate(mem_tag::attention, dtype::f32, {2 * shape.chunk, n, d}, "ring_out_accum");
  ops::fill_heads(be, out_acc.heads(), 0.0f);
  ops::fill_heads(be, lse, -std::numeric_limits<float>::infinity());
  tensor part = be.allocate(mem_tag::attention, be.work_dtype(), {shape.chunk, n, d}, "ring_out_part");
  tensor part_lse = be.allocate(mem_tag::attention, dtype::f32, {n, shape.chunk}, "ring_lse_part");
  const auto attend = [&](const tensor& block, int owner) {
    for (const block_pair& p : pairs(shape, owner)) {
      ops::sdpa_forward(be, {half(shape, q, p.q_half), half(shape, kv_part(block, 0), p.kv_half),
                             half(shape, kv_part(block, 1), p.kv_half), part.heads(), lse_view(part_lse), p.mask,
                             shape.scale, p.documents, shape.window, shape.arithmetic});
      ops::lse_merge(be, {half(shape, out_acc.heads(), p.q_half), half(shape, lse, p.q_half), part.heads(),
                          lse_view(part_lse)});
    }
  };
  attend(kv, shape.rank);
  for (int s = 1; s < shape.size; ++s) {
    const ring_step step = ring_step_at(shape, s);
    if (!step.send && !step.receive) continue;
    tensor visiting = exchange_kv(be, ring, step, kv);
    if (step.receive) attend(visiting, step.from);
  }
  ops::copy_heads(be, out, out_acc.heads());
}

ring_core_grads ring_core_backward(backend& be, communicator& ring, const ring_shape& shape, const head_view& q,
                                   tensor kv, const head_view& o, const head_view& d_o, const head_view& lse) {
  const std::int64_t n = q.heads, d = q.dim, n_kv = kv.dims()[2];
  ring_core_grads g;
  g.dq = be.allocate_zeroed(mem_tag::attention, dtype::f32, {2 * shape.chunk, n, d}, "ring_dq_accum");
  g.dkv = be.allocate_zeroed(mem_tag::attention, dtype::f32, kv.dims(), "ring_dkv");
  tensor dq_part = be.allocate(mem_tag::attention, be.work_dtype(), {shape.chunk, n, d}, "ring_dq_part");
  tensor dkv_part = be.allocate(mem_tag::attention, be.work_dtype(), {2, shape.chunk, n_kv, d}, "ring_dkv_part");
  const head_view dk_part = kv_part(dkv_part, 0), dv_part = kv_part(dkv_part, 1);
  // The pairs with `owner`'s K/V in `block`: dQ here, dK/dV into `grads` (f32, as block).
  const auto attend = [&](const tensor& block, int owner, const tensor& grads) {
    for (const block_pair& p : pairs(shape, owner)) {
      ops::sdpa_backward(be, {half(shape, q, p.q_half), half(shape, kv_part(block, 0), p.kv_half),
                              half(shape, kv_part(block, 1), p.kv_half), half(shape, o, p.q_half),
                              half(shape, d_o, p.q_half), half(shape, lse, p.q_half), dq_part.heads(), dk_part,
                              dv_part, p.mask, shape.scale, p.documents, shape.window, shape.arithmetic});
      ops::add_heads(be, half(shape, g.dq.heads(), p.q_half), dq_part.heads());
      ops::add_heads(be, half(shape, kv_part(grads, 0), p.kv_half), dk_part);
      ops::add_heads(be, half(shape, kv_part(grads, 1), p.kv_half), dv_part);
    }
  };
  attend(kv, shape.rank, g.dkv);
  // Step s: the K/V of the rank s places back arrive and their dK/dV (f32) go back to it;
  // those of this rank's K/V come home from the rank s places on and add up in fp32.
  for (int s = 1; s < shape.size; ++s) {
    const ring_step step = ring_step_at(shape, s);
    if (!step.send && !step.receive) continue;
    tensor visiting = exchange_kv(be, ring, step, kv);
    tensor visit_grads;
    if (step.receive) {
      visit_grads = be.allocate_zeroed(mem_tag::attention, dtype::f32, kv.dims(), "ring_dkv_visit");
      attend(visiting, step.from, visit_grads);
      visiting.reset();
    }
    tensor home = step.send ? be.allocate(mem_tag::attention, dtype::f32, kv.dims(), "ring_dkv") : tensor();
    ring.send_recv(sent(step.receive, visit_grads), bytes_if(step.receive, visit_grads), step.from, home.data(),
                   bytes_if(step.send, home), step.to, "ring_dkv");
    visit_grads.reset();
    if (step.send) {
      ops::add_heads(be, kv_part(g.dkv, 0), kv_part(home, 0));
      ops::add_heads(be, kv_part(g.dkv, 1), kv_part(home, 1));
    }
  }
  return g;
}

ring_attention::ring_attention(const attention_config& config, backend& be, communicator& comm)
    : config_(config), be_(be), comm_(comm), plan_(make_stage_plan(config, comm.rank())), tokens_(config.local_tokens()),
      chunk_(config.seq_len / (2 * config.cp)),
      dim_(config.head_dim), scale_(config.softmax_scale()) {
  UPIPE_CHECK(comm.size() == config.cp, "communicator size must equal cp");
  positions_ = local_positions(comm.rank());
  rope_positions_ = positions_;
}

std::vector<position_run> ring_attention::local_positions(int rank) const {
  return zigzag_positions(config_.seq_len, config_.cp, rank);
}

tensor ring_attention::project_q(const normed_input& x, const attention_weights& w, norm_keep keep,
                                 head_norm_saved& saved) {
  tensor q = be_.allocate(mem_tag::attention, be_.work_dtype(), {tokens_, config_.heads, dim_}, "ring_q");
  for_each_input_tile(be_, x, [&](std::int64_t first, const mat_view& rows) {
    linear_forward(be_, rows, w.wq, q.matrix().row_block(first, rows.rows));
  });
  if (config_.qk_norm) saved = head_norm_forward(be_, head_rows(q, dim_), w.q_norm, config_.head_norm(), keep);
  ops::rope(be_, {q.heads(), rope_positions_, config_.rope, rope_direction::forward});
  return q;
}

tensor ring_attention::project_kv(const normed_input& x, const attention_weights& w, norm_keep keep,
                                  head_norm_saved& saved) {
  tensor kv = be_.allocate(mem_tag::attention, be_.work_dtype(), {2, tokens_, config_.kv_heads, dim_}, "ring_kv");
  const std::int64_t kd = std::int64_t{config_.kv_heads} * dim_;
  for_each_input_tile(be_, x, [&](std::int64_t first, const mat_view& rows) {
    for (int which = 0; which < 2; ++which) {
      const head_view part = kv_part(kv, which);
      linear_forward(be_, rows, which == 0 ? w.wk : w.wv,
                     mat_view{part.data, part.type, tokens_, kd, kd}.row_block(first, rows.rows));
    }
  });
  const head_view k = kv_part(kv, 0);
  if (config_.qk_norm)
    saved = head_norm_forward(be_, head_rows(k.data, k.type, tokens_ * kd, dim_), w.k_norm, config_.head_norm(), keep);
  ops::rope(be_, {k, rope_positions_, config_.rope, rope_direction::forward});
  return kv;
}

attention_saved ring_attention::forward(const mat_view& x, const attention_weights& w, const mat_view& out) {
  plan_check check(be_.ledger(), plan_.forward, be_.work_dtype(), "forward");
  const int H = config_.heads;
  head_norm_saved unused;
  tensor q = project_q(x, w, norm_keep::nothing, unused);
  tensor kv = project_kv(x, w, norm_keep::nothing, unused);
  attention_saved saved;
  saved.lse = be_.allocate(mem_tag::activations, dtype::f32, {H, tokens_}, "attn_lse");
  const head_view out_heads = {out.data, out.type, tokens_, H, dim_, out.ld, dim_};
  ring_core_forward(be_, comm_, shape(), q.heads(), std::move(kv), out_heads, lse_view(saved.lse));
  q.reset();
  check.finish();
  return saved;
}

void ring_attention::backward(const attention_saved& saved, const normed_input& x, const attention_weights& w,
                              const mat_view& out, const mat_view& d_out, const mat_view& d_x,
                              const attention_grads& grads) {
  plan_check check(be_.ledger(), plan_.backward, be_.work_dtype(), "backward");
  const int H = config_.heads, K = config_.kv_heads;
  head_norm_saved q_norm, k_norm;
  tensor q = project_q(x, w, norm_keep::for_backward, q_norm);
  tensor kv = project_kv(x, w, norm_keep::for_backward, k_norm);
  const head_view o = {out.data, out.type, tokens_, H, dim_, out.ld, dim_};
  const head_view d_o = {d_out.data, d_out.type, tokens_, H, dim_, d_out.ld, dim_};
  ring_core_grads core = ring_core_backward(be_, comm_, shape(), q.heads(), std::move(kv), o, d_o, lse_view(saved.lse));
  tensor dq = std::move(core.dq), dkv = std::move(core.dkv);
  q.reset();
  ops::rope(be_, {dq.heads(), rope_positions_, config_.rope, rope_direction::inverse});
  ops::rope(be_, {kv_part(dkv, 0), rope_positions_, config_.rope, rope_direction::inverse});
  if (config_.qk_norm) {
    const std::int64_t kd = std::int64_t{K} * dim_;
    head_norm_backward(be_, q_norm, head_rows(dq, dim_), w.q_norm, grads.q_norm);
    head_norm_backward(be_, k_norm, head_rows(dkv.data(), dkv.type(), tokens_ * kd, dim_), w.k_norm, grads.k_norm);
  }
  accumulate_input_grads(dq, w.wq, grads.wq, x, d_x);
  // dkv (2, s, K, d): rows of the k part then the v part.
  const std::int64_t kd = std::int64_t{K} * dim_;
  tensor dkv_work = be_.allocate(mem_tag::attention, be_.work_dtype(), dkv.dims(), "ring_dkv_work");
  ops::copy_heads(be_, {dkv_work.data(), dkv_work.type(), 2 * tokens_, K, dim_, kd, dim_},
                  {dkv.data(), dkv.type(), 2 * tokens_, K, dim_, kd, dim_});
  dkv.reset();
  const mat_view g = {dkv_work.data(), dkv_work.type(), 2 * tokens_, kd, kd};
  projection_backward passes[2] = {{be_, w.wk, grads.wk, tokens_}, {be_, w.wv, grads.wv, tokens_}};
  for (int which = 0; which < 2; ++which) {
    passes[which].input_grad(g.row_block(which * tokens_, tokens_), 0, d_x);
    passes[which].finish_input_grad(d_x);
  }
  if (passes[0].trains() || passes[1].trains())
    for_each_input_tile(be_, x, [&](std::int64_t first, const mat_view& rows) {
      for (int which = 0; which < 2; ++which) {
        passes[which].start_tile(first, rows);
        passes[which].weight_grad(g.row_block(which * tokens_ + first, rows.rows), 0);
      }
    });
  check.finish();
}

// grad (s, heads, d) f32 -> working dtype, then d_x += g W and dW += g^T x (and the
// adapter's share, cp/projection.hpp).
void ring_attention::accumulate_input_grads(tensor& grad, const projection& weight, const projection_grads& d_weight,
                                            const normed_input& x, const mat_view& d_x) {
  tensor g = be_.allocate(mem_tag::attention, be_.work_dtype(), grad.dims(), "ring_grad_work");
  ops::copy_heads(be_, g.heads(), grad.heads());
  grad.reset();
  projection_backward pass(be_, weight, d_weight, tokens_);
  pass.input_grad(g.matrix(), 0, d_x);
  pass.finish_input_grad(d_x);
  if (!pass.trains()) return;
  for_each_input_tile(be_, x, [&](std::int64_t first, const mat_view& rows) {
    pass.start_tile(first, rows);
    pass.weight_grad(g.matrix().row_block(first, rows.rows), 0);
  });
}

}  // namespace upipe
