// --checkpoint-policy for the commands that run steps (train, bench): a policy by its
// fields, or auto, the planner's fastest policy whose step fits the run's memory.
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>

#include "apps/run_config.hpp"
#include "apps/sizes.hpp"
#include "core/error.hpp"
#include "cp/strategy_table.hpp"
#include "plan/planner.hpp"
#include "train/run_memory.hpp"
#include "train/step_sizes.hpp"
#include "train/trainer.hpp"

namespace upipe::apps {

inline bool is_auto_policy(const std::string& text) { return text == "auto"; }

// The planner's request for o's step in the run configuration's GPU arena (--memory-gib per
// rank, beside the GPU context the planner adds) and host budget (--host-memory-gib), 2% kept
// free; o must be resolved (resolve_step) for these budgets, so that the planned step is the
// one that runs.
inline plan_request fit_request(const train_options& o, const run_config& c) {
  const double memory_gib = c.memory_gib;
  const step_request sizes = sizes_of(o, memory_gib, c.host_memory_gib);
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
  r.arena_gib = memory_gib;  // the tile and chunk of the run's own arena
  r.model_dir = o.model_dir;
  // The run's pools as the GPU sizes them (what a --host-memory-gib leaves them), and what
  // lies beside them as the planner's meta probe counts it: the policy moves the pools alone.
  train_options as_probed = o;
  as_probed.backend = backend_kind::meta;
  std::size_t beside = 0;
  for (const memory_part& part : host_beside_pools(as_probed)) beside += part.bytes;
  r.host_memory = resolve_step(on_gpu).limits.host_bytes * static_cast<std::size_t>(r.gpus) + beside;
  return r;
}

// auto: sets o.step.policy and o.limits to the planner's fastest policy whose step fits
// (fit_request's budgets).
inline plan_point choose_checkpoint_policy(train_options& o, const run_config& c) {
  const double memory_gib = c.memory_gib;
  step_request sizes = sizes_of(o, memory_gib, c.host_memory_gib);
  const plan_point chosen = fastest_fit(fit_request(o, c), o.cp, o.seq_len);
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

// The step of `o` sized once for the run configuration's budgets (--memory-gib,
// --host-memory-gib): its tile, loss chunk and arenas into o.step and o.limits.
inline void size_step(train_options& o, const run_config& c) {
  const resolved_step sized = resolve_step(sizes_of(o, c.memory_gib, c.host_memory_gib));
  o.step = sized.step;
  o.limits = sized.limits;
  o.host_memory_gib = c.host_memory_gib;
}

// --checkpoint-policy auto where the command measures whatever the plan says (step, bench):
// the planner's choice, else the default policy; either said aloud after `what`.
inline checkpoint_policy auto_policy_or_default(train_options& o, const run_config& c, const std::string& what) {
  try {
    const plan_point chosen = choose_checkpoint_policy(o, c);
    std::printf("# %scheckpoint policy %s (auto: the fastest that fits; predicted arena high water %.2f GiB)\n",
                what.c_str(), chosen.policy.str().c_str(), static_cast<double>(chosen.arena_bytes) / (1 << 30));
    return chosen.policy;
  } catch (const config_error& e) {
    // Measured anyway (on meta, to see what it would take): the device has the last word.
    std::printf("# %scheckpoint policy %s (the default: auto found none that fits: %s)\n", what.c_str(),
                checkpoint_policy{}.str().c_str(), e.what());
    return checkpoint_policy{};
  }
}

// --head-chunk auto (the default) for a strategy that chooses U: the largest U whose step
// fits fit_request's budgets, at the fastest checkpoint policy that fits it (auto) or at
// o's policy; sets o.cp.head_chunk and returns the one line that says why. A strategy
// without a choice of U is left as it is ("").
inline std::string choose_head_chunk(train_options& o, const run_config& cfg, bool auto_policy) {
  if (row_of(o.cp.strategy).heads != head_stages::chosen) return "";
  // No valid U (C does not divide the heads): the configuration's validation names the rule.
  if (valid_head_chunks(o.model.num_heads, o.cp.cp / std::max(o.cp.ring, 1)).empty()) return "";
  plan_request r = fit_request(o, cfg);
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
                  c.head_chunk, static_cast<long long>(o.seq_len), cfg.memory_gib);
  return line;
}

// The help text of --checkpoint-policy.
inline const char* checkpoint_policy_help() {
  return "auto (the planner's fastest that fits --memory-gib and --host-memory-gib) or "
         "what=input|input+attention,every=K,where=device|host-pinned|host-pageable";
}

}  // namespace upipe::apps
