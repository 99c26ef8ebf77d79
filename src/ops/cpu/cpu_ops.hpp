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
// The roundings FP8's fused kernels make inside a call (ops/fp8_attention.hpp): P in E4M3 at
// fp8_probability_scale where it meets V (forward) or dO (backward), and dS in E5M2 at
// d_s_scale where it meets K and Q. Off: exact attention.
struct fp8_inner_rounding {
  bool on = false;
  float d_s_scale = 1.0f;
  // Other readings of the kernels' order, measured against the GPU by a test: P rounded
  // against the running max over key blocks of p_block (in reverse with p_block_reverse);
  // dS rounded before the attention scale multiplies it; either rounding left out.
  std::int64_t p_block = 0;
  bool p_block_reverse = false, d_s_unscaled = false, round_p = true, round_d_s = true, sum_rounded = false;
};
// run_fp8 with a reading of the kernels other than the definition's (its scales filled in).
void run_fp8(const sdpa_forward_args& args, const fp8_inner_rounding& reading);
void run_fp8(const sdpa_backward_args& args, const fp8_inner_rounding& reading);
// Attention on the arguments' values as they are (attention.cpp), with those roundings.
void run_attention(const sdpa_forward_args& args, const fp8_inner_rounding& fp8);
void run_attention(const sdpa_backward_args& args, const fp8_inner_rounding& fp8);
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
void run(const moe_dispatch_args& args);
void run(const moe_permute_args& args);
void run(const moe_combine_args& args);
void run(const moe_combine_backward_args& args);
void run(const moe_balance_args& args);
void run(const moe_grouped_gemm_args& args);
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
