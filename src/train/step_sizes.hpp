// The sizes of a step, resolved once: what a run asks for (model, strategy, length, memory
// budgets, checkpoint policy, tiles, chunks, offload, LoRA) becomes the MLP tile, the loss
// chunk and the arenas every layer below uses. `train`, `step`, `eval`, `bench`, the
// checkpoint-policy choice and the planner's meta probe all take a resolved_step; nothing
// below re-derives these sizes (the transformer fills in a tile or chunk only where a
// direct caller, a test, gives none).
#pragma once

#include <cstdint>

#include "backend/backend.hpp"
#include "model/lora.hpp"
#include "model/model_step.hpp"
#include "model/parameter_store.hpp"
#include "model/transformer.hpp"
#include "train/trainer.hpp"

namespace upipe {

struct step_request {
  model_config model;
  cp_settings cp;
  std::int64_t seq_len = 0;  // the longest sequence the run takes (rounded up to the layout's unit)
  std::int64_t batch = 1;    // sequences a step accumulates (the offloaded gradients' size)
  int dp = 1;                // data-parallel replicas: the optimizer state shards over dp x cp ranks
  zero_stage zero = zero_stage::two;
  offload_options offload;
  optimizer_state_options state;  // the trained store's format and kept gradients (the offload's host bytes)
  backend_kind backend = backend_kind::cpu;
  // The GPU arena per rank, GiB: the tile and chunk are sized for it whatever the backend,
  // so that a meta or cpu run takes the sizes the GPU run would.
  double memory_gib = 8;
  // Everything the process may hold in host memory, GiB (--host-memory-gib: its ranks'
  // pools with the offloaded state, the weights' files, the sequences, the libraries): each
  // rank's pool is what remains of it, shared evenly. 0: no budget; then each rank's pool
  // is 16 MiB on the GPU with checkpoints on the device, else memory_gib, plus what the
  // offload and the chunks keep there.
  double host_memory_gib = 0;
  int ranks = 1;  // the ranks the process runs, which share the budget (sizes_of: dp x cp)
  std::size_t host_beside_pools = 0;  // the process's host bytes outside the pools (run_memory.hpp)
  // The step as asked: its checkpoint policy, LoRA and the rest; a tile or loss chunk of 0
  // is sized for the arena (with_default_sizes).
  step_options step;
};

struct resolved_step {
  step_options step;     // the request's, with the tile and the loss chunk
  memory_limits limits;  // the arenas the backend reserves: the pool, the offload, the chunks' K/V
};

// What a rank's host pool holds beside the checkpoints: the offloaded state and the
// sequence chunks' K/V (each with the arena's alignment margin; 0 where there is none).
struct pool_parts {
  std::size_t offload = 0, chunks = 0;
};
pool_parts pool_parts_of(const step_request& r);
// What a --host-memory-gib budget must leave each rank's pool: its parts and the staging.
std::size_t pool_floor(const pool_parts& parts);

// What a training run's options ask of its sizes (their step as it stands), and what a
// model step's ask for sequences of up to seq_len tokens.
step_request sizes_of(const train_options& o, double memory_gib, double host_memory_gib);
step_request sizes_of(const model_step_request& req, std::int64_t seq_len, double memory_gib,
                      double host_memory_gib);

// Checks the budgets (--memory-gib, --host-memory-gib: positive, at most a pebibyte, named
// in the error) and resolves every size. A --host-memory-gib budget too small for what the
// pools must hold (the offloaded state, the chunks) and what lies beside them is
// out_of_memory_error (exit 3) naming the parts, on every backend (meta too, so that a
// meta run refuses what the GPU's would).
resolved_step resolve_step(const step_request& r);

// The arenas alone, before the offload and the chunks are added: `memory_gib` per rank;
// unbounded on meta, which takes the GPU libraries' workspaces as the cuda backend would so
// that its peak is the GPU's; on the GPU a host pool of `host_gib` when given, else 16 MiB
// unless checkpoints go to the host (then `memory_gib`): pinned memory is taken (and counted
// in the process's RSS) at start, so a pool nothing uses costs each rank its size;
// pageable (and only reserved) when checkpoints go to pageable host memory.
memory_limits run_limits(backend_kind kind, double memory_gib, checkpoint_location checkpoints, double host_gib = 0);

// The bytes of a GPU arena of `memory_gib` (what the tile and chunk are sized for).
std::size_t gpu_arena_bytes(double memory_gib);

}  // namespace upipe
