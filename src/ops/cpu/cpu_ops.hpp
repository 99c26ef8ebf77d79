// The CPU reference implementations (fp32 math; plain loops). The cpu backend runs its
// ops here; the entries in ops/ops.hpp have already checked the arguments.
#pragma once

#include <cstdint>

#include "ops/op_args.hpp"

namespace upipe::cpu {

// One overload per op, named run so that the cpu backend dispatches an `op` with one
// std::visit.
void run(const gemm_args& args);
void run(const sdpa_forward_args& args);
void run(const sdpa_backward_args& args);
// FP8 attention (attention_fp8.cpp): run() hands a call with arithmetic fp8 to these.
void run_fp8(const sdpa_forward_args& args);
void run_fp8(const sdpa_backward_args& args);
void run(const rope_args& args);
void run(const rmsnorm_forward_args& args);
void run(const rmsnorm_backward_args& args);
void run(const copy_heads_args& args);
void run(const add_heads_args& args);
void run(const fill_heads_args& args);
void run(const lse_merge_args& args);
void run(const embedding_forward_args& args);
void run(const embedding_backward_args& args);
void run(const swiglu_forward_args& args);
void run(const swiglu_backward_args& args);
void run(const bias_add_args& args);
void run(const bias_grad_args& args);
void run(const moe_route_args& args);
void run(const moe_route_backward_args& args);
void run(const moe_gather_args& args);
void run(const moe_scatter_args& args);
void run(const moe_scatter_backward_args& args);
void run(const sigmoid_gate_forward_args& args);
void run(const sigmoid_gate_backward_args& args);
void run(const cross_entropy_args& args);
// Gated DeltaNet (gated_delta.cpp, causal_conv.cpp).
void run(const gated_delta_forward_args& args);
void run(const gated_delta_backward_args& args);
void run(const gated_delta_summary_args& args);
void run(const gated_delta_summary_backward_args& args);
void run(const gated_delta_scan_args& args);
void run(const causal_conv_forward_args& args);
void run(const causal_conv_backward_args& args);
void run(const gated_delta_gates_forward_args& args);
void run(const gated_delta_gates_backward_args& args);
void run(const adamw_args& args);
void run(const sum_squares_args& args);
// sum_squares adds the sums of blocks of this many elements in order; block_sums[b] gets
// block b's sum of x[0, n), so that the blocks of a long shard may be summed on several
// cores and added afterwards to the same value.
inline constexpr std::int64_t sum_squares_block = std::int64_t{1} << 16;
void sum_squares_blocks(const float* x, std::int64_t n, double* block_sums);
void sum_squares_blocks(const std::uint16_t* x, std::int64_t n, double* block_sums);  // bf16 bits
// dst[i] += src[i] (vectorized; the buffers do not overlap); a bf16 dst (its bits) takes
// the f32 sum rounded to nearest even.
void accumulate(float* dst, const float* src, std::int64_t n);
void accumulate(std::uint16_t* dst, const float* src, std::int64_t n);

}  // namespace upipe::cpu
