// The CPU reference implementations (fp32 math; plain loops). The cpu backend forwards
// its op calls here; the entries in ops/ops.hpp have already checked the arguments.
#pragma once

#include <cstdint>

#include "ops/op_args.hpp"

namespace upipe::cpu {

void gemm(const gemm_args& args);
void sdpa_forward(const sdpa_forward_args& args);
void sdpa_backward(const sdpa_backward_args& args);
void rope(const rope_args& args);
void rmsnorm_forward(const rmsnorm_forward_args& args);
void rmsnorm_backward(const rmsnorm_backward_args& args);
void copy_heads(const head_view& dst, const head_view& src);
void add_heads(const head_view& dst, const head_view& src);
void fill_heads(const head_view& dst, float value);
void lse_merge(const lse_merge_args& args);
void embedding_forward(const embedding_forward_args& args);
void embedding_backward(const embedding_backward_args& args);
void swiglu_forward(const swiglu_forward_args& args);
void swiglu_backward(const swiglu_backward_args& args);
void cross_entropy(const cross_entropy_args& args);
void adamw(const adamw_args& args);
double sum_squares(const mat_view& x);
// sum_squares adds the sums of blocks of this many elements in order; block_sums[b] gets
// block b's sum of x[0, n), so that the blocks of a long shard may be summed on several
// cores and added afterwards to the same value.
inline constexpr std::int64_t sum_squares_block = std::int64_t{1} << 16;
void sum_squares_blocks(const float* x, std::int64_t n, double* block_sums);
// dst[i] += src[i] (f32, vectorized; the buffers do not overlap).
void accumulate(float* dst, const float* src, std::int64_t n);

}  // namespace upipe::cpu
