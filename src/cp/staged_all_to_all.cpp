// Ulysses and UPipe: all-to-all attention in H/U stages of U query heads (U = H is
// Ulysses, the honest baseline with full-size buffers). docs/design.md section 4: each stage
// projects its query heads straight into the all-to-all send layout with the heads' own
// weight rows; kv heads cross to each rank once per pass and stay resident over the
// stages that use them; the stage output goes back into `out` at the heads' true indices.
#include "cp/staged_all_to_all.hpp"

#include <algorithm>
#include <limits>
#include <cmath>
#include <string>

#include "backend/ops.hpp"
#include "core/error.hpp"
#include "cp/head_norm.hpp"
#include "cp/stage_views.hpp"

namespace upipe {


struct staged_all_to_all::resident_block {
  const kv_block* plan = nullptr;
  tensor k, v;    // (C, s, n, d) = (S, n, d), working dtype; k normed (Qwen3) and roped
  tensor dk, dv;  // backward: f32 accumulators when the block spans stages, else final
  head_norm_saved k_norm;  // backward with qk-norm: k before its norm
};

staged_all_to_all::staged_all_to_all(const attention_config& config, backend& be, communicator& comm)
    : config_(config), be_(be), comm_(comm), ring_(nullptr), world_rank_(comm.rank()), group_(config.cp),
      plan_(make_stage_plan(config, comm.rank())), tokens_(config.local_tokens()), gathered_(config.seq_len),
      dim_(config.head_dim), scale_(config.softmax_scale()) {
  UPIPE_CHECK(comm.size() == config.cp, "communicator size must equal cp");
  UPIPE_CHECK(config.ring == 1, "a ring of all-to-all groups needs the mesh's groups");
  config_ = plan_.config;
  // The ranks' shards in order make the whole sequence; with chunks, each chunk's pieces in
  // order make the sequence's part i.
  gathered_positions_ = {{0, 0, config_.seq_len}};
  documents_changed();
}

staged_all_to_all::staged_all_to_all(const attention_config& config, backend& be, mesh_groups mesh, int world_rank)
    : config_(config), be_(be), mesh_(std::move(mesh)), comm_(*mesh_.all_to_all), ring_(mesh_.ring.get()),
      world_rank_(world_rank), group_(config.all_to_all_size()), plan_(make_stage_plan(config, world_rank)),
      tokens_(config.local_tokens()), gathered_(config.local_tokens() * group_), dim_(config.head_dim),
      scale_(config.softmax_scale()) {
  UPIPE_CHECK(comm_.size() == group_ && ring_ != nullptr && ring_->size() == config.ring,
              "hybrid's groups must be A = C / R ranks and a ring of R");
  config_ = plan_.config;
  // The group's ranks in order hold the group's tokens: its zigzag halves, in order.
  const int first = world_rank / group_ * group_;
  for (int j = 0; j < group_; ++j)
    for (const auto& run : local_positions(first + j))
      gathered_positions_.push_back({j * tokens_ + run.token_begin, run.position_begin, run.count});
  documents_changed();
}

void staged_all_to_all::documents_changed() {
  rope_positions_ = document_positions(gathered_positions_, documents());
  chunk_rope_positions_.clear();
  for (const row_chunk& c : plan_.chunks)
    chunk_rope_positions_.push_back(document_positions({{0, group_ * c.first, group_ * c.count}}, documents()));
}

staged_all_to_all::~staged_all_to_all() = default;

// Ulysses and UPipe: contiguous shards; with N sequence chunks, rank r's chunk i is the
// r-th piece of the sequence's part i (parts of C n_i tokens, n_i the chunk's rows), so
// that a chunk's all-to-all gathers a contiguous part of the sequence. Hybrid: group g
// holds zigzag halves g and 2R - 1 - g (ring attention's layout over the R groups), and
// its A ranks split those S / R tokens in order.
std::vector<position_run> staged_all_to_all::local_positions(int rank) const {
  if (!config_.meshed()) {
    std::vector<position_run> runs;
    for (const row_chunk& c : plan_.chunks) runs.push_back({c.first, config_.cp * c.first + rank * c.count, c.count});
    return runs;
  }
  const int g = rank / group_, a = rank % group_;
  const std::int64_t begin = a * tokens_, end = begin + tokens_;
  std::vector<position_run> out;
  for (const position_run& run : zigzag_positions(config_.seq_len, config_.ring, g)) {
    const std::int64_t lo = std::max(begin, run.token_begin), hi = std::min(end, run.token_begin + run.count);
    if (lo < hi) out.push_back({lo - begin, run.position_begin + (lo - run.token_begin), hi - lo});
  }
  return out;
}

staged_all_to_all::head_lists staged_all_to_all::stage_lists(int stage) const {
  head_lists lists;
  for (int j = 0; j < group_; ++j) lists.push_back(schedule().stage_heads(j, stage));
  return lists;
}

staged_all_to_all::head_lists staged_all_to_all::arriving_lists(int stage) const {
  head_lists lists;
  for (int j = 0; j < group_; ++j) lists.push_back(schedule().arriving(j, stage)->kv_heads);
  return lists;
}

// Chunk j of the send buffer gets the heads rank j computes, each projected with its
// own weight rows (the pairing trap of docs/design.md section 4 cannot happen here).
tensor staged_all_to_all::project_to_send(const normed_input& x, const projection& weight, const head_lists& lists,
                                          const char* label) {
  const phase_scope phase(be_, "attn_project");
  const int n = static_cast<int>(lists[0].size());
  tensor send = be_.allocate(mem_tag::attention, be_.work_dtype(), {group_, x.row_count(), n, dim_}, label);
  const std::int64_t d = dim_;
  for_each_input_tile(be_, x, [&](std::int64_t first, const mat_view& rows) {
    const projection_forward project(be_, weight, rows);
    for (int j = 0; j < group_; ++j) {
      const head_view chunk = chunk_heads(send, j).token_block(first, rows.rows);
      const mat_view dst = {chunk.data, chunk.type, rows.rows, n * d, chunk.token_stride};
      for (const head_run& run : consecutive_runs(lists[j]))
        project.rows(run.first * d, run.count * d, dst.col_block(run.slot * d, run.count * d));
    }
  });
  return send;
}

// All-to-all of equal chunks; the send buffer is freed as soon as the exchange is done.
// With one rank the exchange is the identity: the send buffer is the result, uncopied.
tensor staged_all_to_all::exchange(tensor& send, const char* label) {
  if (group_ == 1) return std::move(send);
  const phase_scope phase(be_, "attn_a2a");
  tensor recv = be_.allocate(mem_tag::attention, send.type(), send.dims(), label);
  comm_.all_to_all(send.data(), recv.data(), send.bytes() / group_, label);
  send.reset();
  return recv;
}

// A received (A, rows, n, d) buffer holds the ranks' shards (or chunks) in order: the whole
// sequence (or its part).
head_view staged_all_to_all::sequence_heads(const tensor& t) const {
  const auto& d = t.dims();
  return {t.data(), t.type(), d[0] * d[1], d[2], d[3], d[2] * d[3], d[3]};
}

void staged_all_to_all::rope(const head_view& x, const std::vector<position_run>& positions,
                             rope_direction direction) {
  const phase_scope phase(be_, "attn_rope");
  ops::rope(be_, {x, positions, config_.rope, direction});
}

head_view staged_all_to_all::lse_rows(const tensor& lse, int first, int n, std::int64_t row, std::int64_t rows) const {
  return lse_heads(lse, first, n).token_block(row, rows);
}

// Chunk j of the result gets, for this rank's rows, the stage heads of rank j.
tensor staged_all_to_all::pack_heads(const mat_view& src, int stage, const char* label) {
  const phase_scope phase(be_, "attn_pack");
  const int u = schedule().heads_per_stage();
  tensor send = be_.allocate(mem_tag::attention, be_.work_dtype(), {group_, src.rows, u, dim_}, label);
  const head_view all = {src.data, src.type, src.rows, config_.heads, dim_, src.ld, dim_};
  for (int j = 0; j < group_; ++j)
    for (const head_run& run : consecutive_runs(schedule().stage_heads(j, stage)))
      ops::copy_heads(be_, chunk_heads(send, j).head_block(run.slot, run.count), all.head_block(run.first, run.count));
  return send;
}

void staged_all_to_all::unpack_heads(const tensor& recv, int stage, const mat_view& dst) {
  const phase_scope phase(be_, "attn_pack");
  const head_view all = {dst.data, dst.type, dst.rows, config_.heads, dim_, dst.ld, dim_};
  for (int j = 0; j < group_; ++j)
    for (const head_run& run : consecutive_runs(schedule().stage_heads(j, stage)))
      ops::copy_heads(be_, all.head_block(run.first, run.count), chunk_heads(recv, j).head_block(run.slot, run.count));
}

staged_all_to_all::resident_block staged_all_to_all::receive_kv(const normed_input& x, const attention_weights& w,
                                                                int stage, pass which) {
  const bool fwd = which == pass::forward;
  const head_lists lists = arriving_lists(stage);
  resident_block block;
  block.plan = schedule().arriving(comm_.rank(), stage);
  tensor k_send = project_to_send(x, w.wk, lists, "attn_k_send");
  block.k = exchange(k_send, fwd ? "a2a_k" : "bwd_a2a_k");
  if (config_.qk_norm)
    block.k_norm = head_norm_forward(be_, head_rows(block.k, dim_), w.k_norm, config_.head_norm(),
                                     fwd ? norm_keep::nothing : norm_keep::for_backward);
  rope(sequence_heads(block.k), rope_positions_, rope_direction::forward);
  tensor v_send = project_to_send(x, w.wv, lists, "attn_v_send");
  block.v = exchange(v_send, fwd ? "a2a_v" : "bwd_a2a_v");
  if (!fwd) {
    // A kv head used by several stages accumulates its gradient in fp32; one used by a
    // single stage (always so for Ulysses) gets it written once by the attention kernel.
    if (block.plan->spans_stages()) {
      block.dk = be_.allocate_zeroed(mem_tag::attention, dtype::f32, block.k.dims(), "attn_dk_accum");
      block.dv = be_.allocate_zeroed(mem_tag::attention, dtype::f32, block.v.dims(), "attn_dv_accum");
    } else {
      block.dk = be_.allocate(mem_tag::attention, be_.work_dtype(), block.k.dims(), "attn_dk");
      block.dv = be_.allocate(mem_tag::attention, be_.work_dtype(), block.v.dims(), "attn_dv");
    }
  }
  return block;
}

tensor staged_all_to_all::ring_kv(const resident_block& b, const sdpa_call& c) {
  tensor kv = be_.allocate(mem_tag::attention, be_.work_dtype(), {2, gathered_, c.n_kv, dim_}, "hybrid_ring_kv");
  ops::copy_heads(be_, pair_part(kv, 0), sequence_heads(b.k).head_block(c.kv_slot, c.n_kv));
  ops::copy_heads(be_, pair_part(kv, 1), sequence_heads(b.v).head_block(c.kv_slot, c.n_kv));
  return kv;
}

ring_shape staged_all_to_all::ring_geometry() const {
  return {config_.ring, ring_->rank(), gathered_ / 2, scale_, &documents(), config_.window, config_.arithmetic};
}

void staged_all_to_all::release_finished(std::vector<resident_block>& resident, int stage) {
  std::erase_if(resident, [stage](const resident_block& b) { return b.plan->last_stage == stage; });
}

attention_saved staged_all_to_all::forward(const mat_view& x, const attention_weights& w, const mat_view& out) {
  plan_check check(be_.ledger(), plan_.forward, be_.work_dtype(), "forward");
  if (config_.chunked()) {
    attention_saved saved = chunked_forward(x, w, out);
    check.finish();
    return saved;
  }
  const int u = schedule().heads_per_stage();
  attention_saved saved;
  saved.lse = be_.allocate(mem_tag::activations, dtype::f32, {config_.heads / group_, gathered_}, "attn_lse");
  std::vector<resident_block> resident;
  // The previous stage's output exchange, in flight while this stage projects.
  struct in_flight {
    tensor send, recv;
    comm_request request;
    int stage = -1;
  } previous;
  const auto finish_previous = [&] {
    if (previous.stage < 0) return;
    previous.request.wait();
    previous.send.reset();
    unpack_heads(previous.recv, previous.stage, out);
    previous = {};
  };
  for (int t = 0; t < schedule().stages(); ++t) {
    const stage_step& step = plan_.stages[t];
    if (step.arriving >= 0) resident.push_back(receive_kv(x, w, t, pass::forward));
    tensor q_send = project_to_send(x, w.wq, stage_lists(t), "attn_q_send");
    finish_previous();
    tensor q = exchange(q_send, "a2a_q");
    if (config_.qk_norm) head_norm_forward(be_, head_rows(q, dim_), w.q_norm, config_.head_norm(), norm_keep::nothing);
    rope(sequence_heads(q), rope_positions_, rope_direction::forward);
    tensor o = be_.allocate(mem_tag::attention, be_.work_dtype(), q.dims(), "attn_o_stage");
    {
      const head_view qh = sequence_heads(q), oh = sequence_heads(o);
      const phase_scope phase(be_, "attn_sdpa");
      for (const sdpa_call& c : step.calls) {
        const resident_block& b = resident[c.block];
        if (ring_ != nullptr) {
          ring_core_forward(be_, *ring_, ring_geometry(), qh.head_block(c.q_slot, c.n_q), ring_kv(b, c),
                            oh.head_block(c.q_slot, c.n_q), lse_heads(saved.lse, t * u + c.q_slot, c.n_q));
          continue;
        }
        ops::sdpa_forward(be_, {qh.head_block(c.q_slot, c.n_q), sequence_heads(b.k).head_block(c.kv_slot, c.n_kv),
                                sequence_heads(b.v).head_block(c.kv_slot, c.n_kv), oh.head_block(c.q_slot, c.n_q),
                                lse_heads(saved.lse, t * u + c.q_slot, c.n_q), attn_mask::causal, scale_,
                                document_rows(0, 0), config_.window, config_.arithmetic});
      }
    }
    q.reset();
    if (config_.overlap_comm && group_ > 1 && t + 1 < schedule().stages()) {
      const phase_scope phase(be_, "attn_a2a");
      previous.recv = be_.allocate(mem_tag::attention, o.type(), o.dims(), "a2a_o");
      previous.request = comm_.all_to_all_start(o.data(), previous.recv.data(), o.bytes() / group_, "a2a_o");
      previous.send = std::move(o);
      previous.stage = t;
    } else {
      tensor o_back = exchange(o, "a2a_o");
      unpack_heads(o_back, t, out);
    }
    release_finished(resident, t);
  }
  finish_previous();
  check.finish();
  return saved;
}

void staged_all_to_all::backward(const attention_saved& saved, const normed_input& x, const attention_weights& w,
                                 const mat_view& out, const mat_view& d_out, const mat_view& d_x,
                                 const attention_grads& grads) {
  plan_check check(be_.ledger(), plan_.backward, be_.work_dtype(), "backward");
  if (config_.chunked()) {
    chunked_backward(saved, x, w, out, d_out, d_x, grads);
    check.finish();
    return;
  }
  std::vector<resident_block> resident;
  for (int t = 0; t < schedule().stages(); ++t) {
    if (plan_.stages[t].arriving >= 0) resident.push_back(receive_kv(x, w, t, pass::backward));
    backward_stage(t, resident, saved, x, w, out, d_out, d_x, grads);
    for (auto& b : resident)
      if (b.plan->last_stage == t) send_back_kv(b, x, w, d_x, grads);
    release_finished(resident, t);
  }
  check.finish();
}

void staged_all_to_all::backward_stage(int t, std::vector<resident_block>& resident, const attention_saved& saved,
                                       const normed_input& x, const attention_weights& w, const mat_view& out,
                                       const mat_view& d_out, const mat_view& d_x, const attention_grads& grads) {
  const int u = schedule().heads_per_stage();
  tensor q_send = project_to_send(x, w.wq, stage_lists(t), "attn_q_send");
  tensor q = exchange(q_send, "bwd_a2a_q");
  head_norm_saved q_norm;
  if (config_.qk_norm)
    q_norm = head_norm_forward(be_, head_rows(q, dim_), w.q_norm, config_.head_norm(), norm_keep::for_backward);
  rope(sequence_heads(q), rope_positions_, rope_direction::forward);
  tensor o_send = pack_heads(out, t, "attn_o_send");
  tensor o = exchange(o_send, "bwd_a2a_o");
  tensor do_send = pack_heads(d_out, t, "attn_do_send");
  tensor d_o = exchange(do_send, "bwd_a2a_do");
  tensor dq = be_.allocate(mem_tag::attention, be_.work_dtype(), q.dims(), "attn_dq");
  {
    const phase_scope phase(be_, "attn_sdpa");
    for (const sdpa_call& c : plan_.stages[t].calls) {
      resident_block& b = resident[c.block];
      const bool spans = b.plan->spans_stages();
      if (ring_ != nullptr) {
        // The ring brings the kv gradients home in f32: into the block's accumulators
        // (kv heads that span stages) or written once.
        ring_core_grads g = ring_core_backward(
            be_, *ring_, ring_geometry(), sequence_heads(q).head_block(c.q_slot, c.n_q), ring_kv(b, c),
            sequence_heads(o).head_block(c.q_slot, c.n_q), sequence_heads(d_o).head_block(c.q_slot, c.n_q),
            lse_heads(saved.lse, t * u + c.q_slot, c.n_q));
        ops::copy_heads(be_, sequence_heads(dq).head_block(c.q_slot, c.n_q), g.dq.heads());
        for (int which = 0; which < 2; ++which) {
          const head_view into = sequence_heads(which == 0 ? b.dk : b.dv).head_block(c.kv_slot, c.n_kv);
          const head_view grad = pair_part(g.dkv, which);
          if (spans)
            ops::add_heads(be_, into, grad);
          else
            ops::copy_heads(be_, into, grad);
        }
        continue;
      }
      const head_view k = sequence_heads(b.k).head_block(c.kv_slot, c.n_kv);
      tensor dk_stage, dv_stage;
      if (spans) {
        dk_stage = be_.allocate(mem_tag::attention, be_.work_dtype(), {gathered_, c.n_kv, dim_}, "attn_dk_stage");
        dv_stage = be_.allocate(mem_tag::attention, be_.work_dtype(), {gathered_, c.n_kv, dim_}, "attn_dv_stage");
      }
      const head_view dk = spans ? dk_stage.heads() : sequence_heads(b.dk).head_block(c.kv_slot, c.n_kv);
      const head_view dv = spans ? dv_stage.heads() : sequence_heads(b.dv).head_block(c.kv_slot, c.n_kv);
      ops::sdpa_backward(
          be_, {sequence_heads(q).head_block(c.q_slot, c.n_q), k, sequence_heads(b.v).head_block(c.kv_slot, c.n_kv),
                sequence_heads(o).head_block(c.q_slot, c.n_q), sequence_heads(d_o).head_block(c.q_slot, c.n_q),
                lse_heads(saved.lse, t * u + c.q_slot, c.n_q), sequence_heads(dq).head_block(c.q_slot, c.n_q), dk, dv,
                attn_mask::causal, scale_, document_rows(0, 0), config_.window, config_.arithmetic});
      if (spans) {
        ops::add_heads(be_, sequence_heads(b.dk).head_block(c.kv_slot, c.n_kv), dk);
        ops::add_heads(be_, sequence_heads(b.dv).head_block(c.kv_slot, c.n_kv), dv);
      }
    }
  }
  q.reset();
  o.reset();
  d_o.reset();
  rope(sequence_heads(dq), rope_positions_, rope_direction::inverse);
  if (config_.qk_norm) head_norm_backward(be_, q_norm, head_rows(dq, dim_), w.q_norm, grads.q_norm);
  tensor dq_back = exchange(dq, "bwd_a2a_dq");
  accumulate_input_grads(dq_back, stage_lists(t), w.wq, grads.wq, x, d_x);
}

// Sends a block's kv gradients home once, after the block's last stage; the source rank
// turns them into input and weight gradients (replicas' partials sum in the gemms).
void staged_all_to_all::send_back_kv(resident_block& block, const normed_input& x, const attention_weights& w,
                                     const mat_view& d_x, const attention_grads& grads) {
  const head_lists lists = arriving_lists(block.plan->first_stage);
  rope(sequence_heads(block.dk), rope_positions_, rope_direction::inverse);
  if (config_.qk_norm) head_norm_backward(be_, block.k_norm, head_rows(block.dk, dim_), w.k_norm, grads.k_norm);
  block.k.reset();
  block.v.reset();
  auto to_send = [&](tensor& grad, const char* label) {
    if (!block.plan->spans_stages()) return std::move(grad);  // written once in the working dtype
    tensor send = be_.allocate(mem_tag::attention, be_.work_dtype(), grad.dims(), label);
    ops::copy_heads(be_, sequence_heads(send), sequence_heads(grad));
    grad.reset();
    return send;
  };
  tensor dk_send = to_send(block.dk, "attn_dk_send");
  tensor dk_back = exchange(dk_send, "bwd_a2a_dk");
  accumulate_input_grads(dk_back, lists, w.wk, grads.wk, x, d_x);
  dk_back.reset();
  tensor dv_send = to_send(block.dv, "attn_dv_send");
  tensor dv_back = exchange(dv_send, "bwd_a2a_dv");
  accumulate_input_grads(dv_back, lists, w.wv, grads.wv, x, d_x);
}

namespace {

// The heads of a stage's lists as one block of W's rows [first, first + count): every head
// once and no gap (count 0 otherwise: kv heads replicated over ranks appear more than once).
head_run one_block(const std::vector<std::span<const int>>& lists) {
  int lo = std::numeric_limits<int>::max(), hi = -1;
  std::size_t total = 0;
  for (const auto& list : lists)
    for (const int h : list) {
      lo = std::min(lo, h);
      hi = std::max(hi, h);
      ++total;
    }
  if (hi < lo || static_cast<std::size_t>(hi - lo + 1) != total) return {};
  std::vector<bool> seen(static_cast<std::size_t>(hi - lo + 1), false);
  for (const auto& list : lists)
    for (const int h : list) {
      if (seen[static_cast<std::size_t>(h - lo)]) return {};
      seen[static_cast<std::size_t>(h - lo)] = true;
    }
  return {lo, 0, hi - lo + 1};
}

}  // namespace

// For each chunk j of a received gradient (A, rows, n, d), whose heads are lists[j]:
// d_x += g W_rows and dW_rows += g^T x (x a tile of rows at a time), both accumulated in
// f32; an adapter's B rows are those of the same heads (cp/projection.hpp). Where a stage's
// heads are one block of W's rows (UPipe's stages), the chunks' columns are first gathered in
// W's order, so that d_x takes one GEMM of the stage's width instead of one per chunk, each
// of which reads and writes the whole f32 d_x (issue #35: UPipe's d_x cost 12.3 ms against
// Ulysses' 6.6 at 128K); the gathered copy is one stage's gradient, U/H of Ulysses'.
void staged_all_to_all::accumulate_input_grads(const tensor& recv, const head_lists& lists, const projection& weight,
                                               const projection_grads& d_weight, const normed_input& x,
                                               const mat_view& d_x) {
  const phase_scope phase(be_, "attn_input_grads");
  const std::int64_t d = dim_;
  const std::int64_t n = recv.dims()[2], count = recv.dims()[1];
  const auto grad_rows = [&](int j) {
    const head_view chunk = chunk_heads(recv, j);
    return mat_view{chunk.data, chunk.type, count, n * d, chunk.token_stride};
  };
  const head_run block = schedule().stages() > 1 && group_ > 1 ? one_block(lists) : head_run{};
  tensor gathered;
  if (block.count > 0) {
    gathered = be_.allocate(mem_tag::activations, be_.work_dtype(), {count, block.count * d}, "attn_grad_gathered");
    for (int j = 0; j < group_; ++j)
      for (const head_run& run : consecutive_runs(lists[j]))
        ops::copy_heads(be_, ops::as_heads(gathered.matrix().col_block((run.first - block.first) * d, run.count * d)),
                        ops::as_heads(grad_rows(j).col_block(run.slot * d, run.count * d)));
  }
  // Calls f(gradient columns, first row of W) for each block of the stage's gradient.
  const auto for_each_block = [&](const auto& f) {
    if (block.count > 0) {
      f(gathered.matrix(), std::int64_t{block.first} * d);
      return;
    }
    for (int j = 0; j < group_; ++j)
      for (const head_run& run : consecutive_runs(lists[j]))
        f(grad_rows(j).col_block(run.slot * d, run.count * d), std::int64_t{run.first} * d);
  };
  projection_backward pass(be_, weight, d_weight, count);
  for_each_block([&](const mat_view& g, std::int64_t first) { pass.input_grad(g, first, d_x); });
  pass.finish_input_grad(d_x);
  if (!pass.trains()) return;
  for_each_input_tile(be_, x, [&](std::int64_t first, const mat_view& rows) {
    pass.start_tile(first, rows);
    for_each_block([&](const mat_view& g, std::int64_t w_first) {
      pass.weight_grad(g.row_block(first, rows.rows), w_first);
    });
  });
}

}  // namespace upipe
