// The step-time model's measured rates (plan/step_time.hpp), each with its source: one
// NVIDIA H200 (CUDA 13.0, cuDNN 9.14) and its host's 16 cores, as docs/benchmarks.md
// records them. scripts/step_time_check.py --calibrate derives each from measured rows
// (bench --phases JSON, train --phases metrics); when a rate is measured anew, change it
// here and name the new source.
#pragma once

namespace upipe::step_rates {

// The GEMMs as a step runs them, FLOPs counted as 2 m n k: the projections, the MLP's tiles
// (with their SwiGLU and norm) and the loss's chunks (with their softmax). One layer of
// llama3-8b at 128K, rank 0 of 8 emulated (16,384 tokens), `bench --phases`, tree f53aa47
// (docs/results/h200_rope_f53aa47/bench_phases.json, ulysses): mlp 31.74 + loss 80.54 +
// attn_project 2.89 + attn_out_proj 3.17 + attn_input_grads 6.53 = 124.87 ms for 7.83e13
// FLOPs (step_gemm_flops; upipe U = 8's row: 608). The bare projection GEMMs run at
// 778-919 (bench-kernels, 2026-11-29).
inline constexpr double gemm_tflops = 627;

// Causal fused attention (cuDNN, d = 128), forward and backward, FLOPs as
// docs/design.md section 7 counts them (4 H d a scored pair forward, twice that backward):
// the same row's attn_sdpa, 113.54 ms for 5.28e13 FLOPs (131,072 tokens, 4 heads of 32;
// upipe U = 8's row: 461).
inline constexpr double attention_tflops = 465;

// Head dim 64 runs the fused attention at this share of head dim 128's rate: half the FLOPs
// in 31.01 against 48.05 ms (bench-kernels, llama3-8b's shape at 32K, 2026-11-29).
inline constexpr double attention_d64_share = 0.775;

// The memory-bound rest of a layer (residual copies, norms outside the MLP, RoPE, packing,
// the casts): the same row's other + attn_rope + attn_pack = 6.97 ms over 16,384 tokens
// and one layer, ns per token and layer.
inline constexpr double elementwise_ns = 425;

// The device's own AdamW and its other streaming kernels: upipe's device-to-device copy,
// 4141 GB/s (bench-kernels --ops, docs/benchmarks.md 2026-11-29).
inline constexpr double device_gbytes = 4141;

// The host AdamW (optim/host_optimizer on the host pool) over the H200 host's 16 cores:
// 4.71 Gparams/s with the bf16 working copy, 30 bytes of state read and written per
// parameter (scripts/bench_adamw.py --backend cuda --params 1024M, docs/benchmarks.md
// 2026-12-02, docs/results/h200_offload_68cb632/adamw.json): 141 GB/s. The lean formats'
// q8 codes cost arithmetic beside their bytes; `bench-adamw --optimizer-state 8bit` times them.
inline constexpr double host_adamw_gbytes = 141;

// Host <-> device copies, each way: PCIe Gen5 x16's nominal 64 GB/s less its overheads (not
// yet measured here; the phase table's side copies give it: bytes over their time).
inline constexpr double pcie_gbytes = 50;

// The all-to-all's bus bandwidth inside a node (bench-comm, 2 x H200, 512K-2M tokens).
inline constexpr double nvlink_gbytes = 330;

// Per GPU across nodes: the paper's InfiniBand (not measured here).
inline constexpr double network_gbits = 400;

}  // namespace upipe::step_rates
