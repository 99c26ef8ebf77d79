// The stage plans: each builder below walks a strategy's passes in the order its executor
// does (staged_all_to_all.cpp, staged_chunks.cpp, ring.cpp) and notes each allocation,
// release and message; plan_check holds the executors to them while they run.
#include "cp/stage_plan.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "cp/ring.hpp"

namespace upipe {

std::string_view link_name(plan_link link) {
  switch (link) {
    case plan_link::all_to_all: return "all_to_all";
    case plan_link::ring: return "ring";
    case plan_link::device_to_host: return "device_to_host";
    case plan_link::host_to_device: return "host_to_device";
  }
  return "unknown";
}

std::size_t pass_plan::allocate(const char* label, mem_tag tag, bool f32, const shape& dims) {
  buffers_.push_back({label, tag, f32, dims});
  events_.push_back({event::kind::allocate, buffers_.size() - 1});
  return buffers_.size() - 1;
}

void pass_plan::release(std::size_t buffer) { events_.push_back({event::kind::release, buffer}); }

void pass_plan::send(const char* label, plan_link link, int ranks, std::int64_t elements, bool f32) {
  messages_.push_back({label, link, ranks, elements, f32});
  events_.push_back({event::kind::message, messages_.size() - 1});
}

void pass_plan::skip(const char* label, plan_link link, int ranks, std::int64_t elements, bool f32) {
  skipped_.push_back({label, link, ranks, elements, f32});
}

std::map<std::string, std::uint64_t> pass_plan::saved_bytes_by_label(dtype work) const {
  std::map<std::string, std::uint64_t> out;
  for (const plan_message& m : skipped_) out[m.label] += m.bytes(work);
  return out;
}

std::size_t pass_plan::peak(mem_tag tag, dtype work) const {
  std::size_t live = 0, most = 0;
  for (const event& e : events_) {
    if (e.what == event::kind::message || buffers_[e.index].tag != tag) continue;
    const std::size_t b = buffers_[e.index].bytes(work);
    if (e.what == event::kind::allocate) {
      live += b;
      most = std::max(most, live);
    } else {
      live -= b;
    }
  }
  return most;
}

std::map<std::string, std::uint64_t> pass_plan::bytes_by_label(dtype work) const {
  std::map<std::string, std::uint64_t> out;
  for (const plan_message& m : messages_) out[m.label] += m.bytes(work);
  return out;
}

std::map<plan_link, std::uint64_t> pass_plan::bytes_by_link(dtype work) const {
  std::map<plan_link, std::uint64_t> out;
  for (const plan_message& m : messages_) out[m.link] += m.bytes(work);
  return out;
}

std::size_t stage_plan::peak(dtype work) const { return std::max(forward_peak(work), backward_peak(work)); }

std::size_t stage_plan::host_peak(dtype work) const {
  return std::max(forward.peak(mem_tag::attention_host, work), backward.peak(mem_tag::attention_host, work));
}

std::map<std::string, std::uint64_t> stage_plan::bytes_by_label(dtype work) const {
  std::map<std::string, std::uint64_t> out = forward.bytes_by_label(work);
  for (const auto& [label, bytes] : backward.bytes_by_label(work)) out[label] += bytes;
  return out;
}

std::map<plan_link, std::uint64_t> stage_plan::bytes_by_link(dtype work) const {
  std::map<plan_link, std::uint64_t> out = forward.bytes_by_link(work);
  for (const auto& [link, bytes] : backward.bytes_by_link(work)) out[link] += bytes;
  return out;
}

std::map<std::string, std::uint64_t> stage_plan::saved_bytes_by_label(dtype work) const {
  std::map<std::string, std::uint64_t> out = forward.saved_bytes_by_label(work);
  for (const auto& [label, bytes] : backward.saved_bytes_by_label(work)) out[label] += bytes;
  return out;
}

std::uint64_t stage_plan::saved_bytes(dtype work) const {
  std::uint64_t total = 0;
  for (const auto& [label, bytes] : saved_bytes_by_label(work)) total += bytes;
  return total;
}

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

// The allocations of helpers every executor shares: the tiles of a normed input
// (for_each_input_tile) and Qwen3's head norm (head_norm_forward/backward).
struct shared_builder {
  const attention_config& c;
  pass_plan* pass = nullptr;
  bool tiled = false;  // the pass's input is normed in tiles (backward, long shards)

  std::size_t alloc(const char* label, bool f32, const shape& dims) {
    return pass->allocate(label, mem_tag::attention, f32, dims);
  }
  void release(std::size_t b) { pass->release(b); }
  // for_each_input_tile over `rows` rows of the input.
  void input_tiles(std::int64_t rows) {
    if (!tiled) return;
    const std::int64_t n = std::min(c.input_tile, rows);
    const std::size_t t = alloc("attn_norm_tile", false, {n, c.model_dim});
    const std::size_t r = alloc("attn_norm_tile_rstd", true, {n, 1});
    release(r);
    release(t);
  }
  struct norm_saved {
    std::size_t pre = 0, rstd = 0;
  };
  // head_norm_forward over `rows` rows of d; keeps pre and rstd when asked.
  norm_saved head_norm(std::int64_t rows, bool keep) {
    norm_saved s;
    if (keep) s.pre = alloc("head_norm_pre", false, {rows, c.head_dim});
    s.rstd = alloc("head_norm_rstd", true, {rows, 1});
    if (!keep) release(s.rstd);
    return s;
  }
  void head_norm_backward(const norm_saved& s) {
    release(s.pre);
    release(s.rstd);
  }
};

// Ring attention's core (ring.cpp): `kv` is this rank's (2, 2 chunk, n_kv, d) buffer,
// consumed here (released at the end, as the executor's parameter is). Step s sends and
// receives only where the window lets a query reach the keys (ring_step_at).
struct ring_builder : shared_builder {
  ring_shape geometry;  // size, rank, chunk and window; no documents

  void core_forward(std::int64_t n, std::size_t kv) {
    const plan_buffer own = pass->buffers()[kv];
    const std::size_t acc = alloc("ring_out_accum", true, {2 * geometry.chunk, n, c.head_dim});
    const std::size_t part = alloc("ring_out_part", false, {geometry.chunk, n, c.head_dim});
    const std::size_t part_lse = alloc("ring_lse_part", true, {n, geometry.chunk});
    for (int s = 1; s < geometry.size; ++s) {
      const ring_step step = ring_step_at(geometry, s);
      const std::size_t visiting = step.receive ? alloc("ring_kv", false, own.dims) : 0;
      message("ring_kv", step.send, own.dims, false);
      if (step.receive) release(visiting);
    }
    release(part_lse);
    release(part);
    release(acc);
    release(kv);
  }
  struct grads {
    std::size_t dq, dkv;
  };
  grads core_backward(std::int64_t n, std::size_t kv) {
    const plan_buffer own = pass->buffers()[kv];
    const std::int64_t n_kv = own.dims[2];
    grads g;
    g.dq = alloc("ring_dq_accum", true, {2 * geometry.chunk, n, c.head_dim});
    g.dkv = alloc("ring_dkv", true, own.dims);
    const std::size_t dq_part = alloc("ring_dq_part", false, {geometry.chunk, n, c.head_dim});
    const std::size_t dkv_part = alloc("ring_dkv_part", false, {2, geometry.chunk, n_kv, c.head_dim});
    for (int s = 1; s < geometry.size; ++s) {
      const ring_step step = ring_step_at(geometry, s);
      std::size_t visit = 0;
      if (step.receive) {
        const std::size_t visiting = alloc("ring_kv", false, own.dims);
        message("ring_kv", step.send, own.dims, false);
        visit = alloc("ring_dkv_visit", true, own.dims);
        release(visiting);
      } else {
        message("ring_kv", step.send, own.dims, false);
      }
      const std::size_t home = step.send ? alloc("ring_dkv", true, own.dims) : 0;
      message("ring_dkv", step.receive, own.dims, true);
      if (step.receive) release(visit);
      if (step.send) release(home);
    }
    release(dkv_part);
    release(dq_part);
    release(kv);
    return g;
  }

  // A step's message, or the bytes a window saved where the step sends nothing.
  void message(const char* label, bool sent, const shape& dims, bool f32) {
    if (sent)
      pass->send(label, plan_link::ring, geometry.size, dims.numel(), f32);
    else
      pass->skip(label, plan_link::ring, geometry.size, dims.numel(), f32);
  }
};

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

// Ulysses, UPipe and hybrid without sequence chunks (staged_all_to_all.cpp), and with them
// (staged_chunks.cpp).
struct staged_builder : shared_builder {
  const stage_plan& p;
  const head_schedule& schedule;
  int A;
  std::int64_t s;
  ring_builder ring{{c}, {}};

  staged_builder(const attention_config& config, const stage_plan& plan)
      : shared_builder{config}, p(plan), schedule(*plan.schedule), A(config.all_to_all_size()),
        s(config.local_tokens()) {
    ring.geometry = {c.ring, plan.rank / A, s * A / 2, 1.0f, nullptr, c.window};
  }
  void use(pass_plan& pass, bool backward) {
    this->pass = &pass;
    ring.pass = &pass;
    tiled = ring.tiled = backward && c.tiled_backward();
  }
  const kv_block& block(int index) const { return schedule.blocks(p.group_rank)[index]; }
  int kv_count(const kv_block& b) const { return static_cast<int>(b.kv_heads.size()); }

  std::size_t project(const char* label, std::int64_t rows, int n) {
    const std::size_t send = alloc(label, false, {A, rows, n, c.head_dim});
    input_tiles(rows);
    return send;
  }
  // exchange(): the receive buffer, and the send buffer released; with one rank, the send
  // buffer itself.
  std::size_t exchange(std::size_t send, const char* label) {
    if (A == 1) return send;
    const plan_buffer b = pass->buffers()[send];
    const std::size_t recv = alloc(label, b.f32, b.dims);
    pass->send(label, plan_link::all_to_all, A, b.dims.numel(), b.f32);
    release(send);
    return recv;
  }
  // accumulate_input_grads(): the weight-gradient gemms read x a tile at a time, unless the
  // projection trains nothing.
  void input_grads(std::int64_t rows, bool frozen) {
    if (!frozen) input_tiles(rows);
  }

  void forward();
  void backward();
  void chunked_forward();
  void chunked_backward();
};

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
      if (c.strategy != strategy_kind::hybrid) continue;
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
      if (c.strategy == strategy_kind::hybrid) {
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

// Sequence chunks (staged_chunks.cpp). A block's host copies per chunk, and the device
// set of part j a stage reads.
struct host_buffers {
  int block = -1;
  std::vector<std::size_t> k, v, dk, dv, k_pre, k_rstd;
  std::vector<bool> has_grads;
};

struct chunk_buffers {
  std::vector<std::size_t> all;  // in allocation order
};

struct chunked_builder {
  staged_builder& b;
  const std::vector<row_chunk>& chunks;
  int u;

  shape part_dims(std::size_t j, int n) const { return {b.A, chunks[j].count, n, b.c.head_dim}; }
  std::size_t host(const char* label, bool f32, const shape& dims) {
    const std::size_t id = b.pass->allocate(label, mem_tag::attention_host, f32, dims);
    b.pass->send(label, plan_link::device_to_host, 1, dims.numel(), f32);
    return id;
  }
  std::size_t device(const char* label, bool f32, const shape& dims) {
    const std::size_t id = b.alloc(label, f32, dims);
    b.pass->send(label, plan_link::host_to_device, 1, dims.numel(), f32);
    return id;
  }
  host_buffers store_kv(int arriving, bool backward) {
    const int n = b.kv_count(b.block(arriving));
    host_buffers h;
    h.block = arriving;
    for (std::size_t j = 0; j < chunks.size(); ++j) {
      const std::int64_t rows = chunks[j].count;
      const std::size_t k = b.exchange(b.project("attn_k_send", rows, n), backward ? "bwd_a2a_k" : "a2a_k");
      shared_builder::norm_saved norm;
      if (b.c.qk_norm) {
        norm = b.head_norm(b.A * rows * n, backward);
        if (backward) {
          h.k_pre.push_back(host("attn_k_pre_host", false, {b.A * rows * n, b.c.head_dim}));
          h.k_rstd.push_back(host("attn_k_rstd_host", true, {b.A * rows * n, 1}));
        }
      }
      h.k.push_back(host("attn_k_host", false, part_dims(j, n)));
      const std::size_t v = b.exchange(b.project("attn_v_send", rows, n), backward ? "bwd_a2a_v" : "a2a_v");
      h.v.push_back(host("attn_v_host", false, part_dims(j, n)));
      b.release(v);
      if (b.c.qk_norm && backward) b.head_norm_backward(norm);
      b.release(k);
    }
    h.dk.assign(chunks.size(), 0);
    h.dv.assign(chunks.size(), 0);
    h.has_grads.assign(chunks.size(), false);
    return h;
  }
  // part_buffers(): one part of each used block on the device, sized for part 0.
  chunk_buffers part_buffers(const std::vector<host_buffers>& resident, const stage_step& step, bool backward) {
    chunk_buffers set;
    for (const std::size_t blk : step.used_blocks) {
      const int n = b.kv_count(b.block(resident[blk].block));
      set.all.push_back(b.alloc("attn_k_chunk", false, part_dims(0, n)));
      set.all.push_back(b.alloc("attn_v_chunk", false, part_dims(0, n)));
      if (!backward) continue;
      set.all.push_back(b.alloc("attn_dk_chunk", true, part_dims(0, n)));
      set.all.push_back(b.alloc("attn_dv_chunk", true, part_dims(0, n)));
    }
    return set;
  }
  // fetch_part(): part j's copies into them.
  void fetch(const std::vector<host_buffers>& resident, const stage_step& step, std::size_t j, bool backward) {
    for (const std::size_t blk : step.used_blocks) {
      const std::int64_t elements = part_dims(j, b.kv_count(b.block(resident[blk].block))).numel();
      b.pass->send("attn_k_chunk", plan_link::host_to_device, 1, elements, false);
      b.pass->send("attn_v_chunk", plan_link::host_to_device, 1, elements, false);
      if (backward && resident[blk].has_grads[j]) {
        b.pass->send("attn_dk_chunk", plan_link::host_to_device, 1, elements, true);
        b.pass->send("attn_dv_chunk", plan_link::host_to_device, 1, elements, true);
      }
    }
  }
  void release(const chunk_buffers& set) {
    for (const std::size_t id : set.all) b.release(id);
  }
  void attend(int t, std::size_t i, const std::vector<host_buffers>& resident) {
    const stage_step& step = b.p.stages[t];
    if (i == 0) {
      const chunk_buffers set = part_buffers(resident, step, false);
      fetch(resident, step, 0, false);
      release(set);
      return;
    }
    const shape q_dims = part_dims(i, u);
    const std::size_t acc = b.alloc("attn_o_accum", true, q_dims);
    const std::size_t part = b.alloc("attn_o_part", false, q_dims);
    const std::size_t part_lse = b.alloc("attn_lse_part", true, {u, b.A * chunks[i].count});
    const chunk_buffers sets[2] = {part_buffers(resident, step, false), part_buffers(resident, step, false)};
    for (std::size_t j = 0; j <= i; ++j) fetch(resident, step, j, false);
    release(sets[1]);
    release(sets[0]);
    b.release(part_lse);
    b.release(part);
    b.release(acc);
  }
  void backward_chunk(int t, std::size_t i, std::vector<host_buffers>& resident) {
    const stage_step& step = b.p.stages[t];
    const std::int64_t rows = chunks[i].count;
    const std::size_t q = b.exchange(b.project("attn_q_send", rows, u), "bwd_a2a_q");
    shared_builder::norm_saved q_norm;
    if (b.c.qk_norm) q_norm = b.head_norm(b.A * rows * u, true);
    const std::size_t o = b.exchange(b.alloc("attn_o_send", false, part_dims(i, u)), "bwd_a2a_o");
    const std::size_t d_o = b.exchange(b.alloc("attn_do_send", false, part_dims(i, u)), "bwd_a2a_do");
    const std::size_t dq_acc = b.alloc("attn_dq_accum", true, part_dims(i, u));
    const std::size_t dq_part = b.alloc("attn_dq_part", false, part_dims(i, u));
    std::vector<std::size_t> parts;
    for (const sdpa_call& call : step.calls) {
      parts.push_back(b.alloc("attn_dk_part", false, {b.A * chunks[0].count, call.n_kv, b.c.head_dim}));
      parts.push_back(b.alloc("attn_dv_part", false, {b.A * chunks[0].count, call.n_kv, b.c.head_dim}));
    }
    const chunk_buffers sets[2] = {part_buffers(resident, step, true), part_buffers(resident, step, true)};
    for (std::size_t j = 0; j <= i; ++j) {
      fetch(resident, step, j, true);
      for (const std::size_t blk : step.used_blocks) {
        host_buffers& h = resident[blk];
        const int n = b.kv_count(b.block(h.block));
        if (!h.has_grads[j]) {
          h.dk[j] = b.pass->allocate("attn_dk_host", mem_tag::attention_host, true, part_dims(j, n));
          h.dv[j] = b.pass->allocate("attn_dv_host", mem_tag::attention_host, true, part_dims(j, n));
          h.has_grads[j] = true;
        }
        b.pass->send("attn_dk_host", plan_link::device_to_host, 1, part_dims(j, n).numel(), true);
        b.pass->send("attn_dv_host", plan_link::device_to_host, 1, part_dims(j, n).numel(), true);
      }
    }
    release(sets[1]);
    release(sets[0]);
    for (auto it = parts.rbegin(); it != parts.rend(); ++it) b.release(*it);
    b.release(q);
    b.release(o);
    b.release(d_o);
    b.release(dq_part);
    const std::size_t dq = b.alloc("attn_dq", false, part_dims(i, u));
    b.release(dq_acc);
    if (b.c.qk_norm) b.head_norm_backward(q_norm);
    const std::size_t dq_back = b.exchange(dq, "bwd_a2a_dq");
    b.input_grads(rows, b.c.frozen_q);
    b.release(dq_back);
  }
  void send_back(host_buffers& h, std::size_t i) {
    const int n = b.kv_count(b.block(h.block));
    for (int g = 0; g < 2; ++g) {
      const std::size_t grad = device(g == 0 ? "attn_dk_home" : "attn_dv_home", true, part_dims(i, n));
      if (g == 0 && b.c.qk_norm) {
        const std::size_t pre = device("head_norm_pre", false, {b.A * chunks[i].count * n, b.c.head_dim});
        const std::size_t rstd = device("head_norm_rstd", true, {b.A * chunks[i].count * n, 1});
        b.release(pre);
        b.release(rstd);
        b.release(h.k_pre[i]);
        b.release(h.k_rstd[i]);
      }
      const std::size_t send = b.alloc(g == 0 ? "attn_dk_send" : "attn_dv_send", false, part_dims(i, n));
      b.release(grad);
      const std::size_t back = b.exchange(send, g == 0 ? "bwd_a2a_dk" : "bwd_a2a_dv");
      b.input_grads(chunks[i].count, g == 0 ? b.c.frozen_k : b.c.frozen_v);
      b.release(back);
    }
    b.release(h.k[i]);
    b.release(h.v[i]);
    b.release(h.dk[i]);
    b.release(h.dv[i]);
  }
};

void staged_builder::chunked_forward() {
  chunked_builder cb{*this, p.chunks, schedule.heads_per_stage()};
  std::vector<host_buffers> resident;
  for (int t = 0; t < schedule.stages(); ++t) {
    if (p.stages[t].arriving >= 0) resident.push_back(cb.store_kv(p.stages[t].arriving, false));
    for (std::size_t i = 0; i < p.chunks.size(); ++i) {
      const std::size_t q = exchange(project("attn_q_send", p.chunks[i].count, cb.u), "a2a_q");
      if (c.qk_norm) head_norm(A * p.chunks[i].count * cb.u, false);
      const std::size_t o = alloc("attn_o_stage", false, cb.part_dims(i, cb.u));
      cb.attend(t, i, resident);
      release(q);
      release(exchange(o, "a2a_o"));
    }
    std::erase_if(resident, [&](const host_buffers& h) {
      if (block(h.block).last_stage != t) return false;
      for (std::size_t j = 0; j < p.chunks.size(); ++j) {
        release(h.k[j]);
        release(h.v[j]);
      }
      return true;
    });
  }
}

void staged_builder::chunked_backward() {
  chunked_builder cb{*this, p.chunks, schedule.heads_per_stage()};
  std::vector<host_buffers> resident;
  for (int t = 0; t < schedule.stages(); ++t) {
    if (p.stages[t].arriving >= 0) resident.push_back(cb.store_kv(p.stages[t].arriving, true));
    for (std::size_t i = p.chunks.size(); i-- > 0;) {
      cb.backward_chunk(t, i, resident);
      for (host_buffers& h : resident)
        if (block(h.block).last_stage == t) cb.send_back(h, i);
    }
    std::erase_if(resident, [&](const host_buffers& h) { return block(h.block).last_stage == t; });
  }
}

}  // namespace

stage_plan make_stage_plan(attention_config config, int rank) {
  validate(config);
  stage_plan p;
  p.config = config;
  p.rank = rank;
  const int A = config.all_to_all_size();
  p.group_rank = config.strategy == strategy_kind::hybrid ? rank % A : rank;
  p.chunks = sequence_chunks(config.local_tokens(), config.seq_chunks);
  if (!config.staged()) {
    plan_ring(p);
    return p;
  }
  p.schedule.emplace(config.heads, config.kv_heads, A, config.head_chunk);
  plan_stages(p);
  staged_builder b(p.config, p);
  b.use(p.forward, false);
  config.chunked() ? b.chunked_forward() : b.forward();
  b.use(p.backward, true);
  config.chunked() ? b.chunked_backward() : b.backward();
  return p;
}

plan_check::plan_check(memory_ledger& ledger, const pass_plan& pass, dtype work, const char* what)
    : ledger_(ledger), previous_(ledger.observer()), pass_(pass), work_(work), what_(what) {
  ledger_.set_observer(this);
}

plan_check::~plan_check() { ledger_.set_observer(previous_); }

void plan_check::fail(const std::string& message) {
  if (error_.empty()) error_ = message;
}

void plan_check::allocated(mem_tag tag, std::size_t bytes, std::string_view label) {
  if (!watched(tag) || !error_.empty()) return;
  live_[tag] += static_cast<std::int64_t>(bytes);
  const auto& events = pass_.events();
  // The plan's releases up to its next allocation.
  while (next_ < events.size() && events[next_].what != pass_plan::event::kind::allocate) {
    if (events[next_].what == pass_plan::event::kind::release) {
      const plan_buffer& b = pass_.buffers()[events[next_].index];
      plan_live_[b.tag] -= static_cast<std::int64_t>(b.bytes(work_));
    }
    ++next_;
  }
  if (next_ == events.size())
    return fail(std::string(label) + " (" + std::to_string(bytes) + " bytes) is past the end of the plan");
  const plan_buffer& b = pass_.buffers()[events[next_].index];
  ++next_;
  plan_live_[b.tag] += static_cast<std::int64_t>(b.bytes(work_));
  if (label != b.label || b.bytes(work_) != bytes || b.tag != tag)
    return fail(std::string(label) + " of " + std::to_string(bytes) + " bytes (" + std::string(mem_tag_name(tag)) +
                ") where the plan allocates " + std::string(b.label) + " of " + std::to_string(b.bytes(work_)) + " bytes (" +
                std::string(mem_tag_name(b.tag)) + ")");
  if (plan_live_[tag] != live_[tag])
    fail("after " + std::string(label) + ", " + std::to_string(live_[tag]) + " bytes are live where the plan has " +
         std::to_string(plan_live_[tag]));
}

void plan_check::freed(mem_tag tag, std::size_t bytes, std::string_view /*label*/) {
  if (watched(tag)) live_[tag] -= static_cast<std::int64_t>(bytes);
}

void plan_check::finish() {
  if (error_.empty())
    for (std::size_t i = next_; i < pass_.events().size(); ++i)
      if (pass_.events()[i].what == pass_plan::event::kind::allocate) {
        fail("the plan's " + std::string(pass_.buffers()[pass_.events()[i].index].label) + " was never allocated");
        break;
      }
  if (!error_.empty()) throw internal_error(std::string("the attention ") + what_ + " left its stage plan: " + error_);
}

}  // namespace upipe
