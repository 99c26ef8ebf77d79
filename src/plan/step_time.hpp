// The planner's step-time model: how long one training step of a configuration takes on C
// GPUs over M nodes (each of D replicas running one sequence at once), from the model's
// FLOPs at measured compute rates (every forward the step runs: the first, each layer's
// recompute in its backward, a block's re-forward under checkpoints every k > 1 layers),
// the memory-bound rest per token, and the bytes the step moves (the attention's stage
// plan, ZeRO's gathers and reduce-scatters, the host copies, expert parallelism's token
// exchanges) at stated link bandwidths.
// The offloaded update (docs/design.md section 5) adds the host's AdamW and its copies,
// less what the overlap hides beside the next forward (or beside the backward without
// clipping). The rates are plan/step_rates.hpp's, each measured and named with its source;
// the planner prints them. The collectives and the other host copies are not overlapped
// here: an upper bound for them.
#pragma once

#include <cstdint>

#include "model/checkpoint_store.hpp"
#include "model/config.hpp"
#include "model/parameter_store.hpp"
#include "model/transformer.hpp"
#include "plan/step_rates.hpp"

namespace upipe {

struct throughput_rates {
  double gemm_tflops = step_rates::gemm_tflops;            // the step's GEMMs as they run
  double attention_tflops = step_rates::attention_tflops;  // causal fused attention, forward + backward
  double elementwise_ns = step_rates::elementwise_ns;      // the memory-bound rest, per token and layer
  double device_gbytes = step_rates::device_gbytes;        // the device's AdamW (streaming)
  double host_adamw_gbytes = step_rates::host_adamw_gbytes;  // the host's AdamW over its cores
  double nvlink_gbytes = step_rates::nvlink_gbytes;  // all-to-all bus bandwidth inside a node
  double network_gbits = step_rates::network_gbits;  // per GPU across nodes
  double pcie_gbytes = step_rates::pcie_gbytes;      // host <-> device, each way
};

// Where the step's time goes, in seconds.
struct step_time {
  double gemm = 0, attention = 0;         // compute: the projections, MLP and head; the fused attention
  double elementwise = 0;                 // the memory-bound rest of the layers
  double all_to_all = 0, ring = 0;        // the attention's collectives
  double zero = 0;                        // ZeRO's weight gathers and gradient reduce-scatters in the CP group
  double data_parallel = 0;               // the same collectives' second level, across the replicas
  double host = 0;                        // copies between device and host memory (checkpoints, chunks)
  double experts = 0;                     // expert parallelism's token exchanges
  double update = 0;                      // the device's AdamW (or its moments' half)
  // The offloaded update: its copies on the step's stream (gradient shards or the master's
  // steps out, the optimizer's weights back), the weights' side copies where the compute
  // does not hide them, and the part of the host's AdamW the step waits for.
  double offload_copies = 0, weights_in = 0, host_adamw_exposed = 0;
  // Not in the total: the host's AdamW whole (beside the compute), the forward's compute
  // (what the next step's forward offers the overlap), and what a step with no next step
  // adds (its whole update waited for: train --steps 1).
  double host_adamw = 0, forward = 0, lone_step_extra = 0;
  double compute() const { return gemm + attention + elementwise + update; }
  double total() const {
    return compute() + all_to_all + ring + zero + data_parallel + host + experts + offload_copies + weights_in +
           host_adamw_exposed;
  }
};

struct step_time_request {
  model_config model;
  cp_settings cp;
  int dp = 1;             // replicas of the CP group: ZeRO's collectives span dp x cp.cp ranks
  int ep = 1;             // expert parallelism: EP groups of ep consecutive ranks
  int gpus_per_node = 8;  // the CP group spans cp.cp / gpus_per_node nodes
  std::int64_t seq_len = 0;
  checkpoint_policy policy;
  zero_stage zero = zero_stage::three;
  bool offload_optimizer = false, offload_params = false;
  bool offload_master = false;  // the master alone on the host: each step's f32 direction goes out
  double grad_bytes = 4;        // a gradient element on its way to the host: f32, or a kept bf16 shard's 2
  bool lora = false;  // a frozen base: no weight gradients, no gradient reduce-scatter to speak of
  adamw_state_format state;   // the moments' and the master's formats
  bool streamed = false;      // no clipping at one sequence a step: each unit updated as it arrives
  bool overlap = true;        // the offloaded update beside the next step's work (--offload-overlap)
};

step_time estimate_step_time(const step_time_request& request, const throughput_rates& rates);

// One layer's attention in that step: its fused attention's compute (the pairs of its
// causal, possibly windowed mask: a window W caps a query's keys, so the work grows as S W
// rather than S^2 / 2), and the messages and host copies of its stage plan (a window
// skips ring steps and chunk parts). `passes_forward` counts the forward and its
// recomputes (layer_passes).
step_time layer_attention_time(const attention_config& layer, const step_time_request& request,
                               const throughput_rates& rates, double passes_forward);

// How often a step runs the parts of layer l's forward under a checkpoint policy: once,
// again in its own backward (the fused attention and q, k, v's projections but where its
// attention output is kept; o's projection and the MLP's gate and up always, the MLP's tiles
// recomputing them; never the MLP's down projection, whose output its backward needs not),
// q, k, v's projections once more in the attention's backward (from its input), and
// everything once more in its block's re-forward when checkpoints are k > 1 layers apart
// and it is not its block's last.
struct layer_passes {
  double attention = 1;  // the fused attention's forward
  double inputs = 2;     // q, k and v's projections
  double rest = 2;       // o's projection, the MLP's gate and up
  double down = 1;       // the MLP's down projection
};
layer_passes forward_passes(const checkpoint_policy& policy, int layers, int layer);

// The GEMM FLOPs of one rank's step as the engine runs them (2 m n k each): every forward
// (forward_passes), the backward's input and weight gradients (the weight gradients but the
// adapters' under LoRA), the lm head's forward and backward.
double step_gemm_flops(const step_time_request& request);

// One Gated DeltaNet layer of a hybrid (docs/design.md section 13): its recurrence's compute
// (three dk x dv products a token and value head, forward, twice in backward, at the
// attention's rate: its chunked kernels are tensor-core products of the same shapes), and
// its exchange: in the head layouts the all-to-alls of the projections (q, k, v, b, a) and of
// o, both ways; in the sequence layouts the summaries' all-gathers (fp32, Hv dk (dk + dv) a
// segment forward, Hv dk dv backward) and the halos'.
step_time layer_linear_time(const attention_config& layer, const step_time_request& request,
                            const throughput_rates& rates, double passes_forward);

}  // namespace upipe
