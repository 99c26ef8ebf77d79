// The stage plans' builders (stage_plan_staged.cpp, stage_plan_chunks.cpp), shared by
// their files only: each walks a strategy's passes in the order its executor does
// (staged_all_to_all.cpp, staged_chunks.cpp, ring.cpp) and notes each allocation, release
// and message.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cp/ring.hpp"
#include "cp/stage_plan.hpp"

namespace upipe::plan_building {

// The strategies' plan builders (their rows' `plan`): ring attention over the whole CP
// group (ring_attention in ring.cpp), and the staged strategies, with or without sequence
// chunks (staged_all_to_all.cpp, staged_chunks.cpp).
void plan_ring(stage_plan& p);
void plan_staged(stage_plan& p);

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

  // A step's message, where the step sends one.
  void message(const char* label, bool sent, const shape& dims, bool f32) {
    if (sent) pass->send(label, plan_link::ring, geometry.size, dims.numel(), f32);
  }
};

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

}  // namespace upipe::plan_building
