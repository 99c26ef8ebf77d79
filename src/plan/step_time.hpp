// The planner's step-time model: how long one training step of a configuration takes on C
// GPUs over M nodes (each of D replicas running one sequence at once), from the model's FLOPs at measured compute rates and the bytes the
// step moves (the attention's stage plan, ZeRO's gathers and reduce-scatters, the host
// copies) at stated link bandwidths. Every rate is a parameter the planner prints; the
// defaults are the H200 measurements in docs/benchmarks.md and the paper's 400 Gb/s per
// GPU across nodes. Nothing overlaps in this model (compute, then every transfer): it is
// the step time without overlap, an upper bound for the engine's schedule.
#pragma once

#include <cstdint>

#include "model/checkpoint_store.hpp"
#include "model/config.hpp"
#include "model/parameter_store.hpp"
#include "model/transformer.hpp"

namespace upipe {

struct throughput_rates {
  double gemm_tflops = 778;       // bf16 GEMM (bench-kernels, the H200's projection GEMMs: 778-919)
  double attention_tflops = 549;  // cuDNN causal attention forward + backward, d = 128 (bench-kernels, 32K)
  double nvlink_gbytes = 330;     // all-to-all bus bandwidth inside a node (bench-comm, 2 x H200, 512K-2M tokens)
  double network_gbits = 400;     // per GPU across nodes (the paper's InfiniBand)
  double pcie_gbytes = 50;        // host <-> device, each way (PCIe Gen5 x16; not measured here)
};

// Where the step's time goes, in seconds.
struct step_time {
  double gemm = 0, attention = 0;         // compute: the projections, MLP and head; the fused attention
  double all_to_all = 0, ring = 0;        // the attention's collectives
  double zero = 0;                        // ZeRO's weight gathers and gradient reduce-scatters in the CP group
  double data_parallel = 0;               // the same collectives' second level, across the replicas
  double host = 0;                        // copies between device and host memory
  double total() const { return gemm + attention + all_to_all + ring + zero + data_parallel + host; }
};

struct step_time_request {
  model_config model;
  cp_settings cp;
  int dp = 1;             // replicas of the CP group: ZeRO's collectives span dp x cp.cp ranks
  int gpus_per_node = 8;  // the CP group spans cp.cp / gpus_per_node nodes
  std::int64_t seq_len = 0;
  checkpoint_policy policy;
  zero_stage zero = zero_stage::three;
  bool offload_optimizer = false, offload_params = false;
  bool offload_master = false;  // the master alone on the host: each step's f32 direction goes out
  double grad_bytes = 4;        // a gradient element on its way to the host: f32, or a kept bf16 shard's 2
  bool lora = false;  // a frozen base: no weight gradients, no gradient reduce-scatter to speak of
};

step_time estimate_step_time(const step_time_request& request, const throughput_rates& rates);

// One layer's attention in that step: its fused attention's compute (the pairs of its
// causal, possibly windowed mask: a window W caps a query's keys, so the work grows as S W
// rather than S^2 / 2), and the messages and host copies of its stage plan (a window
// skips ring steps and chunk parts). `passes_forward` counts the forward and its
// recompute (1 + the share of layers recomputed).
step_time layer_attention_time(const attention_config& layer, const step_time_request& request,
                               const throughput_rates& rates, double passes_forward);

// One Gated DeltaNet layer of a hybrid (docs/design.md section 13): its recurrence's compute
// (three dk x dv products a token and value head, forward, twice in backward, at the
// attention's rate: its chunked kernels are tensor-core products of the same shapes), and
// its exchange: in the head layouts the all-to-alls of the projections (q, k, v, b, a) and of
// o, both ways; in the sequence layouts the summaries' all-gathers (fp32, Hv dk (dk + dv) a
// segment forward, Hv dk dv backward) and the halos'.
step_time layer_linear_time(const attention_config& layer, const step_time_request& request,
                            const throughput_rates& rates, double passes_forward);

}  // namespace upipe
