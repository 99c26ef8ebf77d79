// The registered ops in float64 on the host: naive loops written from the ops' definitions
// (not from any backend's code), the oracle the op harness holds the cpu backend to, so
// that the reference backend is itself checked (backend/op_harness.hpp). Each reads a
// case's inputs as the backend filled them and writes the outputs' expected values in
// place, over the whole allocation (what the op must leave untouched stays as it was).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ops/op_args.hpp"

namespace upipe::f64 {

// A case's tensors on the host, by name, flattened row-major.
using host_case = std::map<std::string, std::vector<double>>;

// c (m, n) = alpha op(a) op(b) + beta c; a is (m, k), or (k, m) transposed; b likewise.
void gemm(host_case& t, std::int64_t m, std::int64_t n, std::int64_t k, bool a_transposed, bool b_transposed,
          double alpha, double beta);
// out (sq, hq, d) = softmax(scale q k^T) v per head, query head h reading kv head h / (hq / hk);
// lse (sq, hq) the natural log-sum-exp of the scaled scores. Query i and key j sit at global
// positions q_first + i and k_first + j: causal, a query sees keys at or before it; a window
// W > 0, only keys less than W positions before it.
struct attention_rows {
  std::int64_t q_first = 0, k_first = 0, window = 0;
};
// With fp8_probabilities, P meets v as FP8's fused kernels multiply it (E4M3 at
// fp8_probability_scale, the row's max at 1; the sum stays exact): inputs already quantized.
void sdpa_forward(host_case& t, std::int64_t sq, std::int64_t skv, std::int64_t hq, std::int64_t hk, std::int64_t d,
                  bool causal, double scale, attention_rows rows = {}, bool fp8_probabilities = false);
// FP8 attention's backward on quantized q, k, v, out, d_out and the forward's lse: d_v = P^T
// d_out with P = exp(scale q k^T - lse) in E4M3 at fp8_probability_scale; dS = scale P (d_out
// v^T - rowsum(d_out out)) in E5M2 at d_s_scale; d_q = dS k, d_k = dS^T q (before the outputs'
// own quantization).
void sdpa_backward_fp8(host_case& t, std::int64_t sq, std::int64_t skv, std::int64_t hq, std::int64_t hk,
                       std::int64_t d, bool causal, double scale, double d_s_scale);
// out and lse (f32 accumulators) merged with a block's (out_part, lse_part): lse' = log(e^lse +
// e^lse_part), out' = out e^(lse - lse') + out_part e^(lse_part - lse'); a -inf side adds nothing.
void lse_merge(host_case& t, std::int64_t tokens, std::int64_t heads, std::int64_t dim);
// x rotated in place, rotate-half pairs (i, i + dim / 2), at the positions of `runs` (tokens
// outside every run untouched), by the angle position x inv_freq (the inverse: the transpose).
void rope(host_case& t, std::int64_t heads, std::int64_t dim, std::int64_t token_stride, std::int64_t head_stride,
          const std::vector<position_run>& runs, const rope_config& config, bool inverse);
// y = x / sqrt(mean(x^2) + eps) * (weight + weight_offset) on columns [first, first + cols)
// of (rows, width) buffers; rstd (rows, 2): column 0 the 1 / sqrt(...).
void rmsnorm_forward(host_case& t, std::int64_t rows, std::int64_t cols, std::int64_t width, std::int64_t first,
                     double eps, double weight_offset = 0);
// dst (tokens, heads + 2, dim), heads [1, 1 + heads): src's (a head-major (heads + 2, tokens,
// dim) buffer) copied, added, or `value` (fill, without src).
enum class heads_op { copy, add, fill };
void heads(host_case& t, heads_op op, std::int64_t tokens, std::int64_t heads, std::int64_t dim, double value = 0);
// out (n, dim) = table[ids] rows x scale.
void embedding_forward(host_case& t, std::int64_t n, std::int64_t dim, double scale = 1);
// out = act(gate) up on columns [first, first + cols) of (rows, width) buffers; act is silu
// (x sigmoid(x)) or gelu_tanh (0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))).
void swiglu_forward(host_case& t, std::int64_t rows, std::int64_t cols, std::int64_t width, std::int64_t first,
                    gate_activation activation = gate_activation::silu);
// y (rows, width) += bias (1, cols) on columns [first, first + cols).
void bias_add(host_case& t, std::int64_t rows, std::int64_t cols, std::int64_t width, std::int64_t first);
// Each row of logits (n, vocab): a masked row (label < 0) becomes 0 with loss 0; else loss =
// logsumexp - logit[label] and the row becomes (softmax - onehot) x grad_scale.
void cross_entropy(host_case& t, std::int64_t n, std::int64_t vocab, double grad_scale);
// PyTorch's AdamW (torch.optim.AdamW, decoupled decay) on master, exp_avg, exp_avg_sq from
// grad x grad_scale; weights (when it has n elements) the new master.
void adamw(host_case& t, const adamw_args& a, std::int64_t n);
// sum = the sum of squares of x's columns [0, cols) of (rows, width).
void sum_squares(host_case& t, std::int64_t rows, std::int64_t cols, std::int64_t width);

// Gated DeltaNet (op_float64_gated_delta.cpp). The gated delta rule token by token
// (ops/gated_delta/recurrent.hpp in double), on contiguous q, k (tokens, k_heads, d_k), v
// (tokens, v_heads, d_v), g and beta (tokens, v_heads), states (v_heads, d_k, d_v); the
// documents as sequence_documents (starts, the segment's first row).
struct gated_delta_case {
  std::int64_t tokens = 0, k_heads = 0, v_heads = 0, d_k = 0, d_v = 0;
  bool initial_state = false;      // the case has an "initial_state" tensor
  std::vector<std::int64_t> starts;
  std::int64_t first = 0;
  double scale = 0;  // 0: d_k^-0.5
  bool l2 = true;    // q and k L2-normalized
};
// out and final_state.
void gated_delta_forward(host_case& t, const gated_delta_case& c);
// d_q, d_k, d_v, d_g, d_beta, d_initial_state from d_out and d_final_state.
void gated_delta_backward(host_case& t, const gated_delta_case& c);
// transition (the final state from the identity on zero values) and local_state.
void gated_delta_summary(host_case& t, const gated_delta_case& c);
// local_d_initial: d_initial_state from d_out on zero values and a zero d_final_state.
void gated_delta_summary_backward(host_case& t, const gated_delta_case& c);
// states from transitions and locals, R segments of `heads` heads, forward or backward.
void gated_delta_scan(host_case& t, std::int64_t segments, std::int64_t heads, std::int64_t d_k, std::int64_t d_v,
                      bool backward);
// y (rows, channels) = silu(causal depthwise conv of x with weight (channels, taps)), rows
// before 0 from halo (taps - 1, channels) where `halo`; no row reads an earlier document.
struct causal_conv_case {
  std::int64_t rows = 0, channels = 0, taps = 0;
  bool halo = false;
  std::vector<std::int64_t> starts;
  std::int64_t first = 0;
};
void causal_conv_forward(host_case& t, const causal_conv_case& c);
// d_x, d_halo (where `halo`) written and d_weight accumulated, from d_y.
void causal_conv_backward(host_case& t, const causal_conv_case& c);
// g = -exp(a_log) softplus(a + dt_bias), beta = sigmoid(b), (rows, heads).
void gated_delta_gates_forward(host_case& t, std::int64_t rows, std::int64_t heads);
// d_a, d_b written; d_a_log, d_dt_bias accumulated.
void gated_delta_gates_backward(host_case& t, std::int64_t rows, std::int64_t heads);

}  // namespace upipe::f64
