// Ulysses and UPipe over N sequence chunks: fpdt (DeepSpeed's FPDT, all heads in one stage)
// and upipe with seq_chunks > 1 (docs/design.md section 4, "Sequence chunks"). Rank r's
// chunk i is the r-th piece of the sequence's part i, so that a chunk's all-to-all gathers
// part i whole and in order. A stage runs its query chunks in order; query part i attends
// to the earlier parts fully and to itself causally, and the parts' results merge in fp32
// by their log-sum-exp (ring attention's merge). The stage's K/V are projected and
// exchanged a chunk at a time when their block arrives and kept in host memory; part j
// comes back to the device on the copy stream while part j - 1 is attended.
// Backward runs the query chunks from the last to the first. Query part i reads parts
// 0..i, so once its pass is done its dQ is complete, and so are part i's dK/dV (only
// query parts i and later read it): each goes home as soon as it is complete. Between
// passes a part's dK/dV accumulate in fp32 in host memory. The device holds U heads of
// S / N tokens at a time.
#include <algorithm>
#include <cmath>
#include <limits>

#include "backend/ops.hpp"
#include "core/error.hpp"
#include "cp/head_norm.hpp"
#include "cp/stage_views.hpp"
#include "cp/staged_all_to_all.hpp"

namespace upipe {

struct staged_all_to_all::host_block {
  int block = -1;                   // its index in the schedule's blocks
  const kv_block* plan = nullptr;
  std::vector<tensor> k, v;         // per chunk (A, n_j, n, d) working dtype, host; k normed and roped
  std::vector<tensor> dk, dv;       // backward: per chunk, f32, host, from the first pass that wrote them
  std::vector<tensor> k_pre, k_rstd;  // backward with qk-norm: k before its norm, and its 1/rms, host
};

// Part j of the blocks one stage reads, on the device: per used block, k and v, and in
// backward their f32 gradient accumulators.
struct staged_all_to_all::chunk_set {
  std::vector<tensor> k, v, dk, dv;
};

namespace {

// A side copy between device and host memory, on a backend with data.
void copy_side(backend& be, const tensor& dst, const tensor& src) {
  if (be.has_data()) be.copy_bytes_side(dst.data(), src.data(), src.bytes(), "chunks_kv");
}

tensor to_host(backend& be, const tensor& src, const char* label) {
  tensor host = be.allocate(mem_tag::attention_host, src.type(), src.dims(), label);
  copy_side(be, host, src);
  return host;
}

tensor to_device(backend& be, const tensor& host, const char* label) {
  tensor t = be.allocate(mem_tag::attention, host.type(), host.dims(), label);
  copy_side(be, t, host);
  return t;
}

// The position of block `b` among a stage's used blocks.
std::size_t used_index(const stage_step& step, std::size_t b) {
  for (std::size_t i = 0; i < step.used_blocks.size(); ++i)
    if (step.used_blocks[i] == b) return i;
  throw internal_error("a call reads a block its stage does not use");
}

}  // namespace

staged_all_to_all::host_block staged_all_to_all::arriving_block(int stage) const {
  host_block h;
  h.block = plan_.stages[stage].arriving;
  h.plan = schedule().arriving(comm_.rank(), stage);
  const std::size_t n = plan_.chunks.size();
  h.k.resize(n);
  h.v.resize(n);
  h.dk.resize(n);
  h.dv.resize(n);
  if (config_.qk_norm) {
    h.k_pre.resize(n);
    h.k_rstd.resize(n);
  }
  return h;
}

// Part j of a block: its rows of K and V projected, exchanged, normed and rotated, and kept
// in host memory (with what the k norm's backward needs).
void staged_all_to_all::store_kv_part(host_block& h, const normed_input& x, const attention_weights& w,
                                      std::size_t j, pass which) {
  const bool fwd = which == pass::forward;
  const head_lists lists = arriving_lists(h.plan->first_stage);
  const row_chunk& c = plan_.chunks[j];
  const normed_input rows = x.rows(c.first, c.count);
  tensor k_send = project_to_send(rows, w.wk, lists, "attn_k_send");
  tensor k = exchange(k_send, fwd ? "a2a_k" : "bwd_a2a_k");
  head_norm_saved k_norm;
  if (config_.qk_norm) {
    k_norm = head_norm_forward(be_, head_rows(k, dim_), w.k_norm, config_.head_norm(),
                               fwd ? norm_keep::nothing : norm_keep::for_backward);
    if (!fwd) {
      h.k_pre[j] = to_host(be_, k_norm.pre, "attn_k_pre_host");
      h.k_rstd[j] = to_host(be_, k_norm.rstd, "attn_k_rstd_host");
    }
  }
  rope(sequence_heads(k), chunk_rope_positions_[j], rope_direction::forward);
  h.k[j] = to_host(be_, k, "attn_k_host");
  tensor v_send = project_to_send(rows, w.wv, lists, "attn_v_send");
  tensor v = exchange(v_send, fwd ? "a2a_v" : "bwd_a2a_v");
  h.v[j] = to_host(be_, v, "attn_v_host");
  be_.join_side_copies();  // the device copies may go once the host has them
}

staged_all_to_all::chunk_set staged_all_to_all::part_buffers(const std::vector<host_block>& resident,
                                                             const stage_step& step, pass which) {
  chunk_set set;
  for (const std::size_t b : step.used_blocks) {
    const std::int64_t n_kv = static_cast<std::int64_t>(resident[b].plan->kv_heads.size());
    const shape dims = {group_, plan_.chunks.front().count, n_kv, dim_};  // part 0 is the longest
    set.k.push_back(be_.allocate(mem_tag::attention, be_.work_dtype(), dims, "attn_k_chunk"));
    set.v.push_back(be_.allocate(mem_tag::attention, be_.work_dtype(), dims, "attn_v_chunk"));
    if (which == pass::forward) continue;
    set.dk.push_back(be_.allocate(mem_tag::attention, dtype::f32, dims, "attn_dk_chunk"));
    set.dv.push_back(be_.allocate(mem_tag::attention, dtype::f32, dims, "attn_dv_chunk"));
  }
  return set;
}

void staged_all_to_all::fetch_part(const std::vector<host_block>& resident, const stage_step& step, std::size_t j,
                                   chunk_set& set) {
  if (!be_.has_data()) return;
  for (std::size_t n = 0; n < step.used_blocks.size(); ++n) {
    const host_block& h = resident[step.used_blocks[n]];
    be_.copy_bytes_side(set.k[n].data(), h.k[j].data(), h.k[j].bytes(), "chunks_kv");
    be_.copy_bytes_side(set.v[n].data(), h.v[j].data(), h.v[j].bytes(), "chunks_kv");
    if (set.dk.empty()) continue;
    const std::size_t grad_bytes = static_cast<std::size_t>(h.k[j].numel()) * sizeof(float);
    if (h.dk[j].empty()) {
      be_.fill_bytes(set.dk[n].data(), 0, grad_bytes);
      be_.fill_bytes(set.dv[n].data(), 0, grad_bytes);
    } else {
      be_.copy_bytes_side(set.dk[n].data(), h.dk[j].data(), grad_bytes, "chunks_kv");
      be_.copy_bytes_side(set.dv[n].data(), h.dv[j].data(), grad_bytes, "chunks_kv");
    }
  }
}

// Query part i of stage `stage` (q, its output o) against parts 0..i; the log-sum-exp of its
// rows goes to lse. Two part buffers take turns: part j + 1 arrives in one while part j is
// attended in the other.
void staged_all_to_all::attend_chunk(int stage, std::size_t i, const std::vector<host_block>& resident,
                                     const tensor& q, const tensor& o, const tensor& lse) {
  const phase_scope phase(be_, "attn_sdpa");
  const stage_step& step = plan_.stages[stage];
  const int u = schedule().heads_per_stage();
  const std::int64_t q_first = group_ * plan_.chunks[i].first, q_rows = group_ * plan_.chunks[i].count;
  const head_view qh = sequence_heads(q), oh = sequence_heads(o);
  const auto lse_of = [&](const sdpa_call& c) { return lse_rows(lse, stage * u + c.q_slot, c.n_q, q_first, q_rows); };
  // Call c's kv heads of part j (its first k_rows rows) in a part buffer.
  const auto kv_of = [&](const chunk_set& set, const sdpa_call& c, int which, std::int64_t k_rows) {
    const tensor& t = (which == 0 ? set.k : set.v)[used_index(step, c.block)];
    return sequence_heads(t).token_block(0, k_rows).head_block(c.kv_slot, c.n_kv);
  };
  const std::size_t first = plan_.first_part[i];  // the window's first part (0 without one)
  if (first == i) {  // one part: its own, written directly
    chunk_set set = part_buffers(resident, step, pass::forward);
    fetch_part(resident, step, i, set);
    be_.join_side_copies();
    for (const sdpa_call& c : step.calls)
      ops::sdpa_forward(be_, {qh.head_block(c.q_slot, c.n_q), kv_of(set, c, 0, q_rows), kv_of(set, c, 1, q_rows),
                              oh.head_block(c.q_slot, c.n_q), lse_of(c), attn_mask::causal, scale_,
                              document_rows(q_first, q_first), config_.window, config_.arithmetic});
    return;
  }
  tensor acc = be_.allocate(mem_tag::attention, dtype::f32, q.dims(), "attn_o_accum");
  ops::fill_heads(be_, sequence_heads(acc), 0.0f);
  ops::fill_heads(be_, lse_rows(lse, stage * u, u, q_first, q_rows), -std::numeric_limits<float>::infinity());
  tensor part = be_.allocate(mem_tag::attention, be_.work_dtype(), q.dims(), "attn_o_part");
  tensor part_lse = be_.allocate(mem_tag::attention, dtype::f32, {u, q_rows}, "attn_lse_part");
  const head_view ah = sequence_heads(acc), ph = sequence_heads(part);
  chunk_set sets[2] = {part_buffers(resident, step, pass::forward), part_buffers(resident, step, pass::forward)};
  fetch_part(resident, step, first, sets[first % 2]);
  for (std::size_t j = first; j <= i; ++j) {
    const chunk_set& cur = sets[j % 2];
    be_.join_side_copies();  // part j is here; the other buffer is free
    if (j < i) fetch_part(resident, step, j + 1, sets[(j + 1) % 2]);
    const std::int64_t k_first = group_ * plan_.chunks[j].first, k_rows = group_ * plan_.chunks[j].count;
    const document_mask mask = document_rows(q_first, k_first);
    // Without data (meta) the N^2 / 2 calls would only check shapes the runs with data check.
    if (!be_.has_data() || !mask.shares_document(q_rows, k_rows, config_.window)) continue;
    for (const sdpa_call& c : step.calls) {
      ops::sdpa_forward(be_, {qh.head_block(c.q_slot, c.n_q), kv_of(cur, c, 0, k_rows), kv_of(cur, c, 1, k_rows),
                              ph.head_block(c.q_slot, c.n_q), lse_heads(part_lse, c.q_slot, c.n_q),
                              j == i ? attn_mask::causal : attn_mask::none, scale_, mask, config_.window, config_.arithmetic});
      ops::lse_merge(be_, {ah.head_block(c.q_slot, c.n_q), lse_of(c), ph.head_block(c.q_slot, c.n_q),
                           lse_heads(part_lse, c.q_slot, c.n_q)});
    }
  }
  ops::copy_heads(be_, oh, ah);
}

// A stage's query parts in order. A block's part i is projected when query part i first
// needs it (at the block's first stage), and at its last stage a part leaves host memory as
// soon as no later query part's window reaches it: with a window the host keeps the
// window's parts, not the sequence's.
attention_saved staged_all_to_all::chunked_forward(const mat_view& x, const attention_weights& w,
                                                   const mat_view& out) {
  attention_saved saved;
  saved.lse = be_.allocate(mem_tag::activations, dtype::f32, {config_.heads / group_, gathered_}, "attn_lse");
  std::vector<host_block> resident;
  const std::size_t n = plan_.chunks.size();
  for (int t = 0; t < schedule().stages(); ++t) {
    if (plan_.stages[t].arriving >= 0) resident.push_back(arriving_block(t));
    for (std::size_t i = 0; i < n; ++i) {
      for (host_block& h : resident)
        if (h.plan->first_stage == t) store_kv_part(h, x, w, i, pass::forward);
      const row_chunk& c = plan_.chunks[i];
      tensor q_send = project_to_send(normed_input(x).rows(c.first, c.count), w.wq, stage_lists(t), "attn_q_send");
      tensor q = exchange(q_send, "a2a_q");
      if (config_.qk_norm) head_norm_forward(be_, head_rows(q, dim_), w.q_norm, config_.head_norm(), norm_keep::nothing);
      rope(sequence_heads(q), chunk_rope_positions_[i], rope_direction::forward);
      tensor o = be_.allocate(mem_tag::attention, be_.work_dtype(), q.dims(), "attn_o_stage");
      attend_chunk(t, i, resident, q, o, saved.lse);
      q.reset();
      tensor o_back = exchange(o, "a2a_o");
      unpack_heads(o_back, t, out.row_block(c.first, c.count));
      const std::size_t reached = i + 1 < n ? plan_.first_part[i + 1] : n;  // parts before it are done with
      for (host_block& h : resident)
        if (h.plan->last_stage == t)
          for (std::size_t j = 0; j < reached; ++j) {
            h.k[j].reset();
            h.v[j].reset();
          }
    }
    std::erase_if(resident, [t](const host_block& h) { return h.plan->last_stage == t; });
  }
  return saved;
}

// Query parts from the last to the first. At a block's first stage its parts are projected
// as the window reaches down to them, so that part i's dK/dV are complete after query part
// i (only it and later parts read part i) and, at the block's last stage, go home then.
void staged_all_to_all::chunked_backward(const attention_saved& saved, const normed_input& x,
                                         const attention_weights& w, const mat_view& out, const mat_view& d_out,
                                         const mat_view& d_x, const attention_grads& grads) {
  std::vector<host_block> resident;
  const std::size_t n = plan_.chunks.size();
  for (int t = 0; t < schedule().stages(); ++t) {
    if (plan_.stages[t].arriving >= 0) resident.push_back(arriving_block(t));
    std::size_t stored = n;  // the lowest part projected at this stage
    for (std::size_t i = n; i-- > 0;) {
      const std::size_t low = plan_.first_part[i];
      for (std::size_t j = low; j < stored; ++j)
        for (host_block& h : resident)
          if (h.plan->first_stage == t) store_kv_part(h, x, w, j, pass::backward);
      stored = std::min(stored, low);
      backward_chunk(t, i, resident, saved, x, w, out, d_out, d_x, grads);
      for (host_block& h : resident)
        if (h.plan->last_stage == t) send_back_chunk(h, i, x, w, d_x, grads);
    }
    std::erase_if(resident, [t](const host_block& h) { return h.plan->last_stage == t; });
  }
}

void staged_all_to_all::backward_chunk(int t, std::size_t i, std::vector<host_block>& resident,
                                       const attention_saved& saved, const normed_input& x, const attention_weights& w,
                                       const mat_view& out, const mat_view& d_out, const mat_view& d_x,
                                       const attention_grads& grads) {
  const stage_step& step = plan_.stages[t];
  const int u = schedule().heads_per_stage();
  const row_chunk& rc = plan_.chunks[i];
  const normed_input rows = x.rows(rc.first, rc.count);
  const std::int64_t q_first = group_ * rc.first, q_rows = group_ * rc.count;
  tensor q_send = project_to_send(rows, w.wq, stage_lists(t), "attn_q_send");
  tensor q = exchange(q_send, "bwd_a2a_q");
  head_norm_saved q_norm;
  if (config_.qk_norm)
    q_norm = head_norm_forward(be_, head_rows(q, dim_), w.q_norm, config_.head_norm(), norm_keep::for_backward);
  rope(sequence_heads(q), chunk_rope_positions_[i], rope_direction::forward);
  tensor o_send = pack_heads(out.row_block(rc.first, rc.count), t, "attn_o_send");
  tensor o = exchange(o_send, "bwd_a2a_o");
  tensor do_send = pack_heads(d_out.row_block(rc.first, rc.count), t, "attn_do_send");
  tensor d_o = exchange(do_send, "bwd_a2a_do");
  tensor dq_acc = be_.allocate_zeroed(mem_tag::attention, dtype::f32, q.dims(), "attn_dq_accum");
  tensor dq_part = be_.allocate(mem_tag::attention, be_.work_dtype(), q.dims(), "attn_dq_part");
  {
    const phase_scope phase(be_, "attn_sdpa");
    const head_view qh = sequence_heads(q), oh = sequence_heads(o), doh = sequence_heads(d_o);
    const head_view acc = sequence_heads(dq_acc), part = sequence_heads(dq_part);
    // Each call's dK/dV of a part, sized for the longest part (part 0).
    const std::int64_t longest = group_ * plan_.chunks[0].count;
    std::vector<tensor> dk_parts, dv_parts;
    for (const sdpa_call& c : step.calls) {
      dk_parts.push_back(be_.allocate(mem_tag::attention, be_.work_dtype(), {longest, c.n_kv, dim_}, "attn_dk_part"));
      dv_parts.push_back(be_.allocate(mem_tag::attention, be_.work_dtype(), {longest, c.n_kv, dim_}, "attn_dv_part"));
    }
    chunk_set sets[2] = {part_buffers(resident, step, pass::backward), part_buffers(resident, step, pass::backward)};
    const std::size_t first = plan_.first_part[i];  // the window's first part (0 without one)
    fetch_part(resident, step, first, sets[first % 2]);
    for (std::size_t j = first; j <= i; ++j) {
      chunk_set& cur = sets[j % 2];
      be_.join_side_copies();  // part j is here, and part j - 1's gradients have left the other buffer
      if (j < i) fetch_part(resident, step, j + 1, sets[(j + 1) % 2]);
      const std::int64_t k_first = group_ * plan_.chunks[j].first, k_rows = group_ * plan_.chunks[j].count;
      const document_mask mask = document_rows(q_first, k_first);
      if (be_.has_data() && mask.shares_document(q_rows, k_rows, config_.window))  // meta: as in attend_chunk
        for (std::size_t n = 0; n < step.calls.size(); ++n) {
          const sdpa_call& c = step.calls[n];
          const std::size_t b = used_index(step, c.block);
          const auto part_of = [&](const std::vector<tensor>& set) {
            return sequence_heads(set[b]).token_block(0, k_rows).head_block(c.kv_slot, c.n_kv);
          };
          const head_view dk = dk_parts[n].heads().token_block(0, k_rows), dv = dv_parts[n].heads().token_block(0, k_rows);
          ops::sdpa_backward(be_, {qh.head_block(c.q_slot, c.n_q), part_of(cur.k), part_of(cur.v),
                                   oh.head_block(c.q_slot, c.n_q), doh.head_block(c.q_slot, c.n_q),
                                   lse_rows(saved.lse, t * u + c.q_slot, c.n_q, q_first, q_rows),
                                   part.head_block(c.q_slot, c.n_q), dk, dv,
                                   j == i ? attn_mask::causal : attn_mask::none, scale_, mask, config_.window, config_.arithmetic});
          ops::add_heads(be_, acc.head_block(c.q_slot, c.n_q), part.head_block(c.q_slot, c.n_q));
          ops::add_heads(be_, part_of(cur.dk), dk);
          ops::add_heads(be_, part_of(cur.dv), dv);
        }
      // The part's gradients go back to host memory, beside the next part's attention.
      for (std::size_t n = 0; n < step.used_blocks.size(); ++n) {
        host_block& h = resident[step.used_blocks[n]];
        if (h.dk[j].empty()) {
          h.dk[j] = be_.allocate(mem_tag::attention_host, dtype::f32, h.k[j].dims(), "attn_dk_host");
          h.dv[j] = be_.allocate(mem_tag::attention_host, dtype::f32, h.k[j].dims(), "attn_dv_host");
        }
        if (be_.has_data()) {
          be_.copy_bytes_side(h.dk[j].data(), cur.dk[n].data(), h.dk[j].bytes(), "chunks_kv");  // part j's rows
          be_.copy_bytes_side(h.dv[j].data(), cur.dv[n].data(), h.dv[j].bytes(), "chunks_kv");
        }
      }
    }
    be_.join_side_copies();
  }
  q.reset();
  o.reset();
  d_o.reset();
  dq_part.reset();
  tensor dq = be_.allocate(mem_tag::attention, be_.work_dtype(), dq_acc.dims(), "attn_dq");
  ops::copy_heads(be_, sequence_heads(dq), sequence_heads(dq_acc));
  dq_acc.reset();
  rope(sequence_heads(dq), chunk_rope_positions_[i], rope_direction::inverse);
  if (config_.qk_norm) head_norm_backward(be_, q_norm, head_rows(dq, dim_), w.q_norm, grads.q_norm);
  tensor dq_back = exchange(dq, "bwd_a2a_dq");
  accumulate_input_grads(dq_back, stage_lists(t), w.wq, grads.wq, rows, d_x.row_block(rc.first, rc.count));
}

// Part i of a block's dK/dV is complete: home to the ranks that projected it, as input and
// weight gradients of rows i; the part's host copies go.
void staged_all_to_all::send_back_chunk(host_block& h, std::size_t i, const normed_input& x,
                                        const attention_weights& w, const mat_view& d_x, const attention_grads& grads) {
  const row_chunk& rc = plan_.chunks[i];
  const normed_input rows = x.rows(rc.first, rc.count);
  const head_lists lists = arriving_lists(h.plan->first_stage);
  for (int g = 0; g < 2; ++g) {
    tensor grad = to_device(be_, g == 0 ? h.dk[i] : h.dv[i], g == 0 ? "attn_dk_home" : "attn_dv_home");
    be_.join_side_copies();
    if (g == 0) {
      rope(sequence_heads(grad), chunk_rope_positions_[i], rope_direction::inverse);
      if (config_.qk_norm) {
        head_norm_saved k_norm;
        k_norm.weight_offset = config_.norm_offset;
        k_norm.pre = to_device(be_, h.k_pre[i], "head_norm_pre");
        k_norm.rstd = to_device(be_, h.k_rstd[i], "head_norm_rstd");
        be_.join_side_copies();
        head_norm_backward(be_, k_norm, head_rows(grad, dim_), w.k_norm, grads.k_norm);
        h.k_pre[i].reset();
        h.k_rstd[i].reset();
      }
    }
    tensor send = be_.allocate(mem_tag::attention, be_.work_dtype(), grad.dims(), g == 0 ? "attn_dk_send" : "attn_dv_send");
    ops::copy_heads(be_, sequence_heads(send), sequence_heads(grad));
    grad.reset();
    tensor back = exchange(send, g == 0 ? "bwd_a2a_dk" : "bwd_a2a_dv");
    accumulate_input_grads(back, lists, g == 0 ? w.wk : w.wv, g == 0 ? grads.wk : grads.wv, rows,
                           d_x.row_block(rc.first, rc.count));
  }
  h.k[i].reset();
  h.v[i].reset();
  h.dk[i].reset();
  h.dv[i].reset();
}

}  // namespace upipe
