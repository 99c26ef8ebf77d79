// --checkpoint-policy for the commands that run steps (train, bench): a policy by its
// fields, or auto, the planner's fastest policy whose step fits the run's memory.
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>

#include "apps/sizes.hpp"
#include "core/error.hpp"
#include "cp/strategy_table.hpp"
#include "plan/planner.hpp"
#include "train/step_sizes.hpp"
#include "train/trainer.hpp"

namespace upipe::apps {

inline bool is_auto_policy(const std::string& text) { return text == "auto"; }

// The planner's request for o's step in a GPU arena of memory_gib per rank (beside the GPU
// context the planner adds) and the pinned host pool, 2% kept free; o must be resolved
// (resolve_step) for these budgets, so that the planned step is the one that runs.
inline plan_request fit_request(const train_options& o, double memory_gib, double host_memory_gib) {
  const step_request sizes = sizes_of(o, memory_gib, host_memory_gib);
  // As on the GPU whatever the backend, so that meta predicts the GPU's choice.
  step_request on_gpu = sizes;
  on_gpu.backend = backend_kind::cuda;
  on_gpu.step.policy.where = checkpoint_location::host_pinned;
  plan_request r;
  r.model = o.model;
  r.gpus = o.dp * o.cp.cp;
  r.dp = o.dp;
  r.zero = o.zero;
  r.offload_optimizer = o.offload_optimizer;
  r.lora = o.step.lora;
  r.offload_params = o.offload_params;
  r.offload_master = o.offload_master;
  r.state = state_options_of(o);
  r.max_grad_norm = o.optim.max_grad_norm;
  r.mlp_tile = o.step.mlp_tile;
  r.loss_chunk = o.step.loss_chunk;
  r.attention_arithmetic = o.step.attention_arithmetic;
  r.margin = 0.02;
  r.gpu_memory = gpu_arena_bytes(memory_gib) + gpu_context_bytes();
  r.host_memory = resolve_step(on_gpu).limits.host_bytes * static_cast<std::size_t>(r.gpus);
  return r;
}

// auto: sets o.step.policy and o.limits to the planner's fastest policy whose step fits
// (fit_request's budgets).
inline plan_point choose_checkpoint_policy(train_options& o, double memory_gib, double host_memory_gib) {
  step_request sizes = sizes_of(o, memory_gib, host_memory_gib);
  const plan_point chosen = fastest_fit(fit_request(o, memory_gib, host_memory_gib), o.cp, o.seq_len);
  if (!chosen.fits) {
    char gib[32];
    std::snprintf(gib, sizeof gib, "%g GiB", memory_gib);
    throw config_error("no checkpoint policy fits S = " + std::to_string(o.seq_len) + " in an arena of " + gib +
                       " per rank: raise --memory-gib or --host-memory-gib, shorten --seq-len, or run `upipe plan` "
                       "to see what fits");
  }
  sizes.step.policy = chosen.policy;
  o.step.policy = chosen.policy;
  o.limits = resolve_step(sizes).limits;
  return chosen;
}

// --head-chunk auto (the default) for a strategy that chooses U: the largest U whose step
// fits fit_request's budgets, at the fastest checkpoint policy that fits it (auto) or at
// o's policy; sets o.cp.head_chunk and returns the one line that says why. A strategy
// without a choice of U is left as it is ("").
inline std::string choose_head_chunk(train_options& o, double memory_gib, double host_memory_gib, bool auto_policy) {
  if (row_of(o.cp.strategy).heads != head_stages::chosen) return "";
  // No valid U (C does not divide the heads): the configuration's validation names the rule.
  if (valid_head_chunks(o.model.num_heads, o.cp.cp / std::max(o.cp.ring, 1)).empty()) return "";
  plan_request r = fit_request(o, memory_gib, host_memory_gib);
  if (!auto_policy) r.policy = o.step.policy;
  const head_chunk_choice c = largest_fitting_head_chunk(r, o.cp, o.seq_len);
  o.cp.head_chunk = c.head_chunk;
  const int H = o.model.num_heads;
  char line[256];
  if (c.point.fits)
    std::snprintf(line, sizeof line, "# head chunk U = %d (auto: the largest whose step fits%s; predicted arena high "
                  "water %.2f GiB)\n", c.head_chunk, c.head_chunk == H ? ", every head in one stage" : "",
                  static_cast<double>(c.point.arena_bytes) / (1 << 30));
  else
    std::snprintf(line, sizeof line, "# head chunk U = %d (auto: none fits S = %lld in %g GiB, so the smallest)\n",
                  c.head_chunk, static_cast<long long>(o.seq_len), memory_gib);
  return line;
}

// The help text of --checkpoint-policy.
inline const char* checkpoint_policy_help() {
  return "auto (the planner's fastest that fits --memory-gib and --host-memory-gib) or "
         "what=input|input+attention,every=K,where=device|host-pinned|host-pageable";
}

}  // namespace upipe::apps
