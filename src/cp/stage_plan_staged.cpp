// The stage plans of ring attention and of the staged strategies without sequence chunks:
// each builder walks its executor's passes in order (ring.cpp, staged_all_to_all.cpp).
#include <algorithm>

#include "core/error.hpp"
#include "cp/stage_plan_builders.hpp"

namespace upipe::plan_building {

namespace {

// Groups a stage's query slots into fused attention calls: slots sharing a kv head form
// one grouped-query call, and neighbouring equal groups over consecutive kv slots of one
// block merge into a single call.
std::vector<sdpa_call> stage_calls(const head_schedule& schedule, int rank, int stage,
                                   const std::vector<const kv_block*>& resident) {
  std::vector<sdpa_call> groups;
  const auto heads = schedule.stage_heads(rank, stage);
  for (int slot = 0; slot < static_cast<int>(heads.size()); ++slot) {
    const int kv = schedule.kv_of(heads[slot]);
    std::size_t b = 0;
    int kv_slot = -1;
    for (; b < resident.size() && kv_slot < 0; ++b) {
      const auto& list = resident[b]->kv_heads;
      if (auto it = std::find(list.begin(), list.end(), kv); it != list.end())
        kv_slot = static_cast<int>(it - list.begin());
    }
    UPIPE_CHECK(kv_slot >= 0, "kv head " + std::to_string(kv) + " not resident at stage " + std::to_string(stage));
    --b;
    if (!groups.empty() && groups.back().block == b && groups.back().kv_slot == kv_slot)
      ++groups.back().n_q;
    else
      groups.push_back({slot, 1, b, kv_slot, 1});
  }
  std::vector<sdpa_call> calls;
  for (const sdpa_call& g : groups) {
    if (!calls.empty()) {
      sdpa_call& last = calls.back();
      const int ratio = last.n_q / last.n_kv;
      if (last.block == g.block && last.kv_slot + last.n_kv == g.kv_slot && g.n_q == ratio &&
          last.q_slot + last.n_q == g.q_slot) {
        last.n_q += g.n_q;
        ++last.n_kv;
        continue;
      }
    }
    calls.push_back(g);
  }
  return calls;
}

// The stages of a staged strategy and their fused attention calls.
void plan_stages(stage_plan& p) {
  const head_schedule& schedule = *p.schedule;
  std::vector<const kv_block*> resident;
  const auto blocks = schedule.blocks(p.group_rank);
  for (int t = 0; t < schedule.stages(); ++t) {
    stage_step step;
    for (std::size_t b = 0; b < blocks.size(); ++b)
      if (blocks[b].first_stage == t) {
        step.arriving = static_cast<int>(b);
        resident.push_back(&blocks[b]);
      }
    step.calls = stage_calls(schedule, p.group_rank, t, resident);
    for (const sdpa_call& c : step.calls)
      if (std::find(step.used_blocks.begin(), step.used_blocks.end(), c.block) == step.used_blocks.end())
        step.used_blocks.push_back(c.block);
    std::sort(step.used_blocks.begin(), step.used_blocks.end());
    p.stages.push_back(std::move(step));
    std::erase_if(resident, [t](const kv_block* b) { return b->last_stage == t; });
  }
}

}  // namespace

// Ring attention over the whole CP group (ring_attention in ring.cpp).
void plan_ring(stage_plan& p) {
  const attention_config& c = p.config;
  const std::int64_t s = c.local_tokens(), H = c.heads, K = c.kv_heads, d = c.head_dim;
  ring_builder b{{c}, {}};
  b.geometry = {c.cp, p.rank, c.seq_len / (2 * c.cp), 1.0f, nullptr, c.window};
  // Forward.
  b.pass = &p.forward;
  std::size_t q = b.alloc("ring_q", false, {s, H, d});
  if (c.qk_norm) b.head_norm(s * H, false);
  std::size_t kv = b.alloc("ring_kv", false, {2, s, K, d});
  if (c.qk_norm) b.head_norm(s * K, false);
  b.core_forward(H, kv);
  b.release(q);
  // Backward.
  b.pass = &p.backward;
  b.tiled = c.tiled_backward();
  q = b.alloc("ring_q", false, {s, H, d});
  b.input_tiles(s);
  shared_builder::norm_saved q_norm, k_norm;
  if (c.qk_norm) q_norm = b.head_norm(s * H, true);
  kv = b.alloc("ring_kv", false, {2, s, K, d});
  b.input_tiles(s);
  if (c.qk_norm) k_norm = b.head_norm(s * K, true);
  const ring_builder::grads g = b.core_backward(H, kv);
  b.release(q);
  if (c.qk_norm) {
    b.head_norm_backward(q_norm);
    b.head_norm_backward(k_norm);
  }
  const std::size_t dq_work = b.alloc("ring_grad_work", false, {s, H, d});
  b.release(g.dq);
  if (!c.frozen_q) b.input_tiles(s);
  b.release(dq_work);
  const std::size_t dkv_work = b.alloc("ring_dkv_work", false, {2, s, K, d});
  b.release(g.dkv);
  if (!c.frozen_k || !c.frozen_v) b.input_tiles(s);
  b.release(dkv_work);
}

struct resident_buffers {
  int block = -1;
  std::size_t k = 0, v = 0, dk = 0, dv = 0;
  shared_builder::norm_saved k_norm;
  bool norm_kept = false, has_grads = false;
};

void staged_builder::forward() {
  const int u = schedule.heads_per_stage();
  std::vector<resident_buffers> resident;
  struct {
    std::size_t send = 0, recv = 0;
    bool active = false;
  } previous;
  const auto finish_previous = [&] {
    if (!previous.active) return;
    release(previous.send);
    release(previous.recv);
    previous.active = false;
  };
  for (int t = 0; t < schedule.stages(); ++t) {
    const stage_step& step = p.stages[t];
    if (step.arriving >= 0) {
      const int n = kv_count(block(step.arriving));
      resident_buffers r;
      r.block = step.arriving;
      r.k = exchange(project("attn_k_send", s, n), "a2a_k");
      if (c.qk_norm) head_norm(A * s * n, false);
      r.v = exchange(project("attn_v_send", s, n), "a2a_v");
      resident.push_back(r);
    }
    const std::size_t q_send = project("attn_q_send", s, u);
    finish_previous();
    const std::size_t q = exchange(q_send, "a2a_q");
    if (c.qk_norm) head_norm(A * s * u, false);
    const std::size_t o = alloc("attn_o_stage", false, {A, s, u, c.head_dim});
    for (const sdpa_call& call : step.calls) {
      if (!c.meshed()) continue;
      const std::size_t kv = alloc("hybrid_ring_kv", false, {2, A * s, call.n_kv, c.head_dim});
      ring.core_forward(call.n_q, kv);
    }
    release(q);
    if (c.overlap_comm && A > 1 && t + 1 < schedule.stages()) {
      previous.recv = alloc("a2a_o", false, {A, s, u, c.head_dim});
      pass->send("a2a_o", plan_link::all_to_all, A, A * s * u * c.head_dim, false);
      previous.send = o;
      previous.active = true;
    } else {
      release(exchange(o, "a2a_o"));
    }
    std::erase_if(resident, [&](const resident_buffers& r) {
      if (block(r.block).last_stage != t) return false;
      release(r.k);
      release(r.v);
      return true;
    });
  }
  finish_previous();
}

void staged_builder::backward() {
  const int u = schedule.heads_per_stage();
  std::vector<resident_buffers> resident;
  for (int t = 0; t < schedule.stages(); ++t) {
    const stage_step& step = p.stages[t];
    if (step.arriving >= 0) {
      const kv_block& kb = block(step.arriving);
      const int n = kv_count(kb);
      resident_buffers r;
      r.block = step.arriving;
      r.k = exchange(project("attn_k_send", s, n), "bwd_a2a_k");
      if (c.qk_norm) r.k_norm = head_norm(A * s * n, true);
      r.norm_kept = c.qk_norm;
      r.v = exchange(project("attn_v_send", s, n), "bwd_a2a_v");
      const bool spans = kb.spans_stages();
      r.dk = alloc(spans ? "attn_dk_accum" : "attn_dk", spans, {A, s, n, c.head_dim});
      r.dv = alloc(spans ? "attn_dv_accum" : "attn_dv", spans, {A, s, n, c.head_dim});
      r.has_grads = true;
      resident.push_back(r);
    }
    // backward_stage
    const std::size_t q = exchange(project("attn_q_send", s, u), "bwd_a2a_q");
    norm_saved q_norm;
    if (c.qk_norm) q_norm = head_norm(A * s * u, true);
    const std::size_t o = exchange(alloc("attn_o_send", false, {A, s, u, c.head_dim}), "bwd_a2a_o");
    const std::size_t d_o = exchange(alloc("attn_do_send", false, {A, s, u, c.head_dim}), "bwd_a2a_do");
    const std::size_t dq = alloc("attn_dq", false, {A, s, u, c.head_dim});
    for (const sdpa_call& call : step.calls) {
      const bool spans = block(resident[call.block].block).spans_stages();
      if (c.meshed()) {
        const std::size_t kv = alloc("hybrid_ring_kv", false, {2, A * s, call.n_kv, c.head_dim});
        const ring_builder::grads g = ring.core_backward(call.n_q, kv);
        release(g.dkv);
        release(g.dq);
        continue;
      }
      if (spans) {
        const std::size_t dk = alloc("attn_dk_stage", false, {A * s, call.n_kv, c.head_dim});
        const std::size_t dv = alloc("attn_dv_stage", false, {A * s, call.n_kv, c.head_dim});
        release(dv);
        release(dk);
      }
    }
    release(q);
    release(o);
    release(d_o);
    if (c.qk_norm) head_norm_backward(q_norm);
    const std::size_t dq_back = exchange(dq, "bwd_a2a_dq");
    input_grads(s, c.frozen_q);
    release(dq_back);
    // send_back_kv of the blocks whose last stage this is
    for (resident_buffers& r : resident) {
      const kv_block& kb = block(r.block);
      if (kb.last_stage != t) continue;
      if (r.norm_kept) head_norm_backward(r.k_norm);
      release(r.k);
      release(r.v);
      const int n = kv_count(kb);
      const auto to_send = [&](std::size_t grad, const char* label) {
        if (!pass->buffers()[grad].f32) return grad;
        const std::size_t send = alloc(label, false, {A, s, n, c.head_dim});
        release(grad);
        return send;
      };
      const std::size_t dk_back = exchange(to_send(r.dk, "attn_dk_send"), "bwd_a2a_dk");
      input_grads(s, c.frozen_k);
      release(dk_back);
      const std::size_t dv_back = exchange(to_send(r.dv, "attn_dv_send"), "bwd_a2a_dv");
      input_grads(s, c.frozen_v);
      release(dv_back);
      r.has_grads = false;
    }
    std::erase_if(resident, [&](const resident_buffers& r) { return block(r.block).last_stage == t; });
  }
}

void plan_staged(stage_plan& p) {
  const attention_config& c = p.config;
  p.schedule.emplace(c.heads, c.kv_heads, c.all_to_all_size(), c.head_chunk);
  plan_stages(p);
  staged_builder b(c, p);
  b.use(p.forward, false);
  c.chunked() ? b.chunked_forward() : b.forward();
  b.use(p.backward, true);
  c.chunked() ? b.chunked_backward() : b.backward();
}

}  // namespace upipe::plan_building
