// The CPU reference implementations (fp32 math; plain loops). The cpu backend forwards
// its op calls here; the entries in ops/ops.hpp have already checked the arguments.
#pragma once

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

}  // namespace upipe::cpu
