// The stage plans of the staged strategies over sequence chunks (staged_chunks.cpp):
// each part's host copies and the device set of part j a stage reads, in the executor's
// order; under a window the parts before query part i's first are neither fetched nor,
// once no later part reaches them, kept.
#include <algorithm>

#include "cp/stage_plan_builders.hpp"

namespace upipe::plan_building {

namespace {

// Sequence chunks (staged_chunks.cpp). A block's host copies per chunk, and the device
// set of part j a stage reads.
struct host_buffers {
  int block = -1;
  std::vector<std::size_t> k, v, dk, dv, k_pre, k_rstd;
  std::vector<bool> stored, has_grads;
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
  host_buffers arriving(int block) const {
    const std::size_t n = chunks.size();
    host_buffers h;
    h.block = block;
    h.k.assign(n, 0);
    h.v.assign(n, 0);
    h.dk.assign(n, 0);
    h.dv.assign(n, 0);
    h.k_pre.assign(n, 0);
    h.k_rstd.assign(n, 0);
    h.stored.assign(n, false);
    h.has_grads.assign(n, false);
    return h;
  }
  // store_kv_part(): part j of a block to host memory.
  void store_part(host_buffers& h, std::size_t j, bool backward) {
    const int n = b.kv_count(b.block(h.block));
    const std::int64_t rows = chunks[j].count;
    const std::size_t k = b.exchange(b.project("attn_k_send", rows, n), backward ? "bwd_a2a_k" : "a2a_k");
    shared_builder::norm_saved norm;
    if (b.c.qk_norm) {
      norm = b.head_norm(b.A * rows * n, backward);
      if (backward) {
        h.k_pre[j] = host("attn_k_pre_host", false, {b.A * rows * n, b.c.head_dim});
        h.k_rstd[j] = host("attn_k_rstd_host", true, {b.A * rows * n, 1});
      }
    }
    h.k[j] = host("attn_k_host", false, part_dims(j, n));
    const std::size_t v = b.exchange(b.project("attn_v_send", rows, n), backward ? "bwd_a2a_v" : "a2a_v");
    h.v[j] = host("attn_v_host", false, part_dims(j, n));
    h.stored[j] = true;
    b.release(v);
    if (b.c.qk_norm && backward) b.head_norm_backward(norm);
    b.release(k);
  }
  void drop_part(host_buffers& h, std::size_t j) {
    if (!h.stored[j]) return;
    b.release(h.k[j]);
    b.release(h.v[j]);
    h.stored[j] = false;
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
    const std::size_t first = b.p.first_part[i];
    if (first == i) {
      const chunk_buffers set = part_buffers(resident, step, false);
      fetch(resident, step, i, false);
      release(set);
      return;
    }
    const shape q_dims = part_dims(i, u);
    const std::size_t acc = b.alloc("attn_o_accum", true, q_dims);
    const std::size_t part = b.alloc("attn_o_part", false, q_dims);
    const std::size_t part_lse = b.alloc("attn_lse_part", true, {u, b.A * chunks[i].count});
    const chunk_buffers sets[2] = {part_buffers(resident, step, false), part_buffers(resident, step, false)};
    for (std::size_t j = first; j <= i; ++j) fetch(resident, step, j, false);
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
    for (std::size_t j = b.p.first_part[i]; j <= i; ++j) {
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
    drop_part(h, i);
    b.release(h.dk[i]);
    b.release(h.dv[i]);
  }
};

}  // namespace

void staged_builder::chunked_forward() {
  chunked_builder cb{*this, p.chunks, schedule.heads_per_stage()};
  std::vector<host_buffers> resident;
  const std::size_t n = p.chunks.size();
  for (int t = 0; t < schedule.stages(); ++t) {
    if (p.stages[t].arriving >= 0) resident.push_back(cb.arriving(p.stages[t].arriving));
    for (std::size_t i = 0; i < n; ++i) {
      for (host_buffers& h : resident)
        if (block(h.block).first_stage == t) cb.store_part(h, i, false);
      const std::size_t q = exchange(project("attn_q_send", p.chunks[i].count, cb.u), "a2a_q");
      if (c.qk_norm) head_norm(A * p.chunks[i].count * cb.u, false);
      const std::size_t o = alloc("attn_o_stage", false, cb.part_dims(i, cb.u));
      cb.attend(t, i, resident);
      release(q);
      release(exchange(o, "a2a_o"));
      const std::size_t reached = i + 1 < n ? p.first_part[i + 1] : n;
      for (host_buffers& h : resident)
        if (block(h.block).last_stage == t)
          for (std::size_t j = 0; j < reached; ++j) cb.drop_part(h, j);
    }
    std::erase_if(resident, [&](const host_buffers& h) { return block(h.block).last_stage == t; });
  }
}

void staged_builder::chunked_backward() {
  chunked_builder cb{*this, p.chunks, schedule.heads_per_stage()};
  std::vector<host_buffers> resident;
  const std::size_t n = p.chunks.size();
  for (int t = 0; t < schedule.stages(); ++t) {
    if (p.stages[t].arriving >= 0) resident.push_back(cb.arriving(p.stages[t].arriving));
    std::size_t stored = n;
    for (std::size_t i = n; i-- > 0;) {
      const std::size_t low = p.first_part[i];
      for (std::size_t j = low; j < stored; ++j)
        for (host_buffers& h : resident)
          if (block(h.block).first_stage == t) cb.store_part(h, j, true);
      stored = std::min(stored, low);
      cb.backward_chunk(t, i, resident);
      for (host_buffers& h : resident)
        if (block(h.block).last_stage == t) cb.send_back(h, i);
    }
    std::erase_if(resident, [&](const host_buffers& h) { return block(h.block).last_stage == t; });
  }
}

}  // namespace upipe::plan_building
