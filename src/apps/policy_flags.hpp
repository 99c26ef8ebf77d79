// --checkpoint-policy for the commands that run steps (train, bench): a policy by its
// fields, or auto, the planner's fastest policy whose step fits the run's memory.
#pragma once

#include <cstdio>
#include <string>

#include "apps/sizes.hpp"
#include "core/error.hpp"
#include "plan/planner.hpp"
#include "train/trainer.hpp"

namespace upipe::apps {

inline bool is_auto_policy(const std::string& text) { return text == "auto"; }

// auto: sets o.step.policy and o.limits to the planner's fastest policy whose step fits a
// GPU arena of memory_gib per rank (beside the GPU context the planner adds) and the pinned
// host pool, 2% kept free; o.cp, o.zero, o.model and o.seq_len must be set, and o.step's tile
// and chunk sized for that arena (sized_for_gpu), so that the planned step is the one that runs.
inline plan_point choose_checkpoint_policy(train_options& o, double memory_gib, double host_memory_gib) {
  // As on the GPU whatever the backend, so that meta predicts the GPU's choice.
  const std::size_t arena =
      run_limits(backend_kind::cuda, memory_gib, checkpoint_location::device, host_memory_gib).device_bytes;
  plan_request r;
  r.model = o.model;
  r.gpus = o.cp.cp;
  r.zero = o.zero;
  r.offload_optimizer = o.offload_optimizer;
  r.lora = o.step.lora;
  r.offload_params = o.offload_params;
  r.mlp_tile = o.step.mlp_tile;
  r.loss_chunk = o.step.loss_chunk;
  r.margin = 0.02;
  r.gpu_memory = arena + gpu_context_bytes();
  memory_limits host = run_limits(backend_kind::cuda, memory_gib, checkpoint_location::host_pinned, host_memory_gib);
  const offload_options offload{o.offload_optimizer, o.offload_params};
  host = with_offload(host, o.model, o.cp.cp, backend_kind::cuda, o.zero, offload, o.batch, o.step.lora);
  host = with_chunked_attention(host, o.model, o.cp, o.seq_len, backend_kind::cuda);
  r.host_memory = host.host_bytes * static_cast<std::size_t>(r.gpus);
  const plan_point chosen = fastest_fit(r, o.cp, o.seq_len);
  if (!chosen.fits) {
    char gib[32];
    std::snprintf(gib, sizeof gib, "%g GiB", memory_gib);
    throw config_error("no checkpoint policy fits S = " + std::to_string(o.seq_len) + " in an arena of " + gib +
                       " per rank: raise --memory-gib or --host-memory-gib, shorten --seq-len, or run `upipe plan` "
                       "to see what fits");
  }
  o.step.policy = chosen.policy;
  o.limits = run_limits(o.backend, memory_gib, chosen.policy.where, host_memory_gib);
  o.limits = with_offload(o.limits, o.model, o.cp.cp, o.backend, o.zero, offload, o.batch, o.step.lora);
  o.limits = with_chunked_attention(o.limits, o.model, o.cp, o.seq_len, o.backend);
  return chosen;
}

// The help text of --checkpoint-policy.
inline const char* checkpoint_policy_help() {
  return "auto (the planner's fastest that fits --memory-gib and --host-memory-gib) or "
         "what=input|input+attention,every=K,where=device|host-pinned|host-pageable";
}

}  // namespace upipe::apps
