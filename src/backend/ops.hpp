// The op entries: each checks shapes, dtypes and strides, then runs the op on the
// backend (backend::run with its argument struct). Only the entries check; implementations trust their arguments.
#pragma once

#include "backend/backend.hpp"
#include "ops/op_args.hpp"
#include "ops/rope_frequencies.hpp"

namespace upipe::ops {

void gemm(backend& be, const gemm_args& args);
void sdpa_forward(backend& be, const sdpa_forward_args& args);
void sdpa_backward(backend& be, const sdpa_backward_args& args);
void rope(backend& be, const rope_args& args);
void rmsnorm_forward(backend& be, const rmsnorm_forward_args& args);
void rmsnorm_backward(backend& be, const rmsnorm_backward_args& args);
// dst = src elementwise (pack/unpack of the all-to-all layouts, dtype conversion).
void copy_heads(backend& be, const head_view& dst, const head_view& src);
// dst += src elementwise; dst is f32 or the working dtype.
void add_heads(backend& be, const head_view& dst, const head_view& src);
void fill_heads(backend& be, const head_view& dst, float value);
void lse_merge(backend& be, const lse_merge_args& args);
void embedding_forward(backend& be, const embedding_forward_args& args);
void embedding_backward(backend& be, const embedding_backward_args& args);
void swiglu_forward(backend& be, const swiglu_forward_args& args);
void swiglu_backward(backend& be, const swiglu_backward_args& args);
void bias_add(backend& be, const bias_add_args& args);
void bias_grad(backend& be, const bias_grad_args& args);
// Mixture of experts (ops/op_args.hpp).
void moe_route(backend& be, const moe_route_args& args);
void moe_route_backward(backend& be, const moe_route_backward_args& args);
void moe_dispatch(backend& be, const moe_dispatch_args& args);
void moe_permute(backend& be, const moe_permute_args& args);
void moe_combine(backend& be, const moe_combine_args& args);
void moe_combine_backward(backend& be, const moe_combine_backward_args& args);
void moe_balance(backend& be, const moe_balance_args& args);
// Counts 2 m n k over all of the tile's rows (the dropless work; a bound under a capacity).
void moe_grouped_gemm(backend& be, const moe_grouped_gemm_args& args);
void sigmoid_gate_backward(backend& be, const sigmoid_gate_backward_args& args);
void cross_entropy(backend& be, const cross_entropy_args& args);
// Gated DeltaNet (ops/op_args.hpp; backend/ops_gated_delta.cpp): the gated delta rule, its
// context-parallel summaries and their scan, the causal conv, the gates.
void gated_delta_forward(backend& be, const gated_delta_forward_args& args);
void gated_delta_backward(backend& be, const gated_delta_backward_args& args);
void gated_delta_summary(backend& be, const gated_delta_summary_args& args);
void gated_delta_summary_backward(backend& be, const gated_delta_summary_backward_args& args);
void gated_delta_scan(backend& be, const gated_delta_scan_args& args);
void causal_conv_forward(backend& be, const causal_conv_forward_args& args);
void causal_conv_backward(backend& be, const causal_conv_backward_args& args);
void gated_delta_gates_forward(backend& be, const gated_delta_gates_forward_args& args);
void gated_delta_gates_backward(backend& be, const gated_delta_gates_backward_args& args);
void adamw(backend& be, const adamw_args& args);
double sum_squares(backend& be, const mat_view& x);

// A matrix as a (rows, 1, cols) head view, so the head ops copy, convert, add and fill
// matrices too.
inline head_view as_heads(const mat_view& m) { return {m.data, m.type, m.rows, 1, m.cols, m.ld, m.cols}; }

}  // namespace upipe::ops
