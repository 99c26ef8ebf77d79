#include "train/step_sizes.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "core/error.hpp"
#include "core/limits.hpp"
#include "cp/stage_plan.hpp"
#include "cp/strategy_table.hpp"
#include "train/run_memory.hpp"

namespace upipe {
namespace {

std::size_t gib_bytes(double gib) { return static_cast<std::size_t>(gib * (1 << 30)); }

dtype working_dtype(backend_kind kind) { return kind == backend_kind::cpu ? dtype::f32 : dtype::bf16; }

// The host pool's margin for the arena's alignment, beside what the offload or the chunks
// keep there.
constexpr std::size_t host_margin = std::size_t{64} << 20;
// The pinned staging a pool keeps when checkpoints stay on the GPU.
constexpr std::size_t staging_bytes = std::size_t{16} << 20;

// --offload: the pool grows by what the offload holds there for one rank, whatever the rest
// of the pool is for. Under LoRA the optimizer is the adapters' (a micro-batch's gradients
// fit in the margin).
std::size_t offload_host_bytes(const step_request& r) {
  if (!r.offload.master_on_host()) return 0;
  const dtype work = working_dtype(r.backend);
  const int ranks = r.dp * r.cp.cp;  // ZeRO's shards span every replica
  return (r.step.lora.enabled() ? lora_offloaded_optimizer_bytes(r.model, r.step.lora, ranks, work)
                                : offloaded_bytes(r.model, ranks, work, r.zero, r.offload, r.batch, r.state)) +
         host_margin;
}

// Sequence chunks: the pool grows by what the attention's plan keeps in host memory at the
// longest length (the earlier chunks' K/V and their gradients).
std::size_t chunk_host_bytes(const step_request& r) {
  if (row_of(r.cp.strategy).chunks != sequence_chunking::required && r.cp.seq_chunks <= 1) return 0;
  const std::int64_t unit = layout_unit(r.cp);
  const attention_config c = attention_config_for(r.model, r.cp, (r.seq_len + unit - 1) / unit * unit);
  if (!c.chunked()) return 0;
  return make_stage_plan(c, 0).host_peak(working_dtype(r.backend)) + host_margin;
}

// A rank's host pool under a --host-memory-gib budget: what remains of the budget beside
// the pools, shared by the process's ranks; refused when that leaves less than the offload
// and the chunks need there with the staging buffers.
std::size_t budgeted_pool(const step_request& r, const pool_parts& parts) {
  const std::size_t budget = gib_bytes(r.host_memory_gib), ranks = static_cast<std::size_t>(std::max(r.ranks, 1));
  const std::size_t need = pool_floor(parts);
  const std::size_t pool = budget > r.host_beside_pools ? (budget - r.host_beside_pools) / ranks : 0;
  if (pool >= need) return pool;
  throw out_of_memory_error(
      "--host-memory-gib " + real_text(r.host_memory_gib) + " (everything the run may hold in host memory) leaves " +
      gib_text(pool) + " per rank for the host pool of each of " + std::to_string(ranks) + " rank(s), beside " +
      gib_text(r.host_beside_pools) + " outside the pools (the weights' files or host copies, the sequences, the "
      "libraries), and each pool must hold " + gib_text(need) + " (the offloaded state " + gib_text(parts.offload) +
      ", the sequence chunks' K/V " + gib_text(parts.chunks) + ", staging " + gib_text(staging_bytes) +
      "): give --host-memory-gib " + real_text(std::ceil(static_cast<double>(need * ranks + r.host_beside_pools) /
                                                         (1 << 30) * 10) / 10) +
      " or more, less --offload, a shorter --seq-len, or --lora");
}

}  // namespace

pool_parts pool_parts_of(const step_request& r) { return {offload_host_bytes(r), chunk_host_bytes(r)}; }

std::size_t pool_floor(const pool_parts& parts) { return parts.offload + parts.chunks + staging_bytes; }

std::size_t gpu_arena_bytes(double memory_gib) {
  return run_limits(backend_kind::cuda, memory_gib, checkpoint_location::device).device_bytes;
}

memory_limits run_limits(backend_kind kind, double memory_gib, checkpoint_location checkpoints, double host_gib) {
  if (!(memory_gib > 0 && memory_gib <= limits::max_memory_gib))
    throw config_error("--memory-gib " + real_text(memory_gib) +
                       " must be positive and at most 1048576 (a pebibyte) (for example 8)");
  if (!(host_gib >= 0 && host_gib <= limits::max_memory_gib))
    throw config_error("--host-memory-gib " + real_text(host_gib) +
                       " must lie between 0 (the default) and 1048576 (a pebibyte) (for example 16)");
  if (kind == backend_kind::meta) return {std::size_t{1} << 50, std::size_t{1} << 50, true};
  const bool small_host = kind == backend_kind::cuda && checkpoints == checkpoint_location::device;
  memory_limits limits{gib_bytes(memory_gib), small_host ? staging_bytes : gib_bytes(memory_gib)};
  limits.host_pageable = kind == backend_kind::cuda && checkpoints == checkpoint_location::host_pageable;
  (void)host_gib;  // the budget is the whole process's: resolve_step sizes the pools from it
  return limits;
}

step_request sizes_of(const train_options& o, double memory_gib, double host_memory_gib) {
  step_request r;
  r.model = o.model;
  r.cp = o.cp;
  r.seq_len = o.seq_len;
  r.batch = o.batch;
  r.dp = o.dp;
  r.zero = o.zero;
  r.offload = offload_of(o);
  r.state = state_options_of(o);
  r.backend = o.backend;
  r.memory_gib = memory_gib;
  r.host_memory_gib = host_memory_gib;
  r.ranks = process_ranks(o);
  if (host_memory_gib > 0)
    for (const memory_part& p : host_beside_pools(o)) r.host_beside_pools += p.bytes;
  r.step = o.step;
  return r;
}

step_request sizes_of(const model_step_request& req, std::int64_t seq_len, double memory_gib,
                      double host_memory_gib) {
  step_request r;
  r.model = req.model;
  r.cp = req.cp;
  r.seq_len = seq_len;
  r.backend = req.backend;
  r.memory_gib = memory_gib;
  r.host_memory_gib = host_memory_gib;
  r.step = req.options;
  return r;
}

resolved_step resolve_step(const step_request& r) {
  resolved_step out;
  out.step = with_default_sizes(r.step, r.model, gpu_arena_bytes(r.memory_gib));
  out.limits = run_limits(r.backend, r.memory_gib, r.step.policy.where, r.host_memory_gib);
  const pool_parts parts = pool_parts_of(r);
  if (r.host_memory_gib > 0) {
    const std::size_t pool = budgeted_pool(r, parts);
    if (r.backend != backend_kind::meta) out.limits.host_bytes = pool;
  } else if (r.backend != backend_kind::meta) {  // meta's pool is unbounded
    out.limits.host_bytes += parts.offload + parts.chunks;
  }
  return out;
}

}  // namespace upipe
