// The workspace cuDNN's fused attention is given for one call, as the meta backend models
// it for the planner. The CUDA engine takes the larger of this and what its plan asks, so
// wherever the model holds both backends grow the workspace at the same calls by the same
// bytes and place the arena alike.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/op_args.hpp"

namespace upipe {

// A plan may ask a little more than the model: on the H200 the asks differed from it by
// 0.5 KiB to 8 MiB (docs/benchmarks.md), 512 KiB more at 1M tokens of llama3-8b.
inline constexpr std::size_t sdpa_workspace_margin = std::size_t{16} << 20;

// Forward: the packed row statistics (sq h floats), staged there when cuDNN cannot write
// the caller's.
inline std::size_t sdpa_forward_workspace_bytes(std::int64_t q_tokens, std::int64_t q_heads) {
  return static_cast<std::size_t>(q_tokens * q_heads) * sizeof(float) + sdpa_workspace_margin;
}

// Backward, as measured on the H200 (cuDNN 9.14 and 9.19, docs/benchmarks.md): the fp32 dQ
// accumulator (sq h d floats), doubled for causal self-attention over several heads of at
// least 8K tokens.
inline std::size_t sdpa_backward_workspace_bytes(std::int64_t q_tokens, std::int64_t q_heads, std::int64_t dim,
                                                 std::int64_t kv_tokens, attn_mask mask) {
  const bool doubled = q_heads > 1 && q_tokens >= 8192 && kv_tokens == q_tokens && mask == attn_mask::causal;
  return static_cast<std::size_t>((doubled ? 2 : 1) * dim * q_tokens * q_heads) * sizeof(float) +
         sdpa_workspace_margin;
}

// FP8 attention (ops/fp8_attention.hpp): the engine's buffer for one call, the E4M3/E5M2
// copies of its operands (one byte an element, each from a 256-byte boundary) after the
// amaxes and scales. Grown per call as the workspace, so the meta backend models it alike.
inline constexpr std::size_t sdpa_fp8_alignment = 256;
inline constexpr std::size_t sdpa_fp8_scalar_bytes = sdpa_fp8_alignment;  // amaxes and scales, f32
inline std::size_t sdpa_fp8_operand_bytes(const head_view& v) {
  const auto n = static_cast<std::size_t>(v.tokens * v.heads * v.dim);
  return (n + sdpa_fp8_alignment - 1) / sdpa_fp8_alignment * sdpa_fp8_alignment;
}
// Forward: Q, K, V, O.
inline std::size_t sdpa_fp8_forward_bytes(const sdpa_forward_args& a) {
  return sdpa_fp8_scalar_bytes + sdpa_fp8_operand_bytes(a.q) + sdpa_fp8_operand_bytes(a.k) +
         sdpa_fp8_operand_bytes(a.v) + sdpa_fp8_operand_bytes(a.out);
}
// Backward: Q, K, V, O, dO, then dQ, dK, dV as cuDNN writes them.
inline std::size_t sdpa_fp8_backward_bytes(const sdpa_backward_args& a) {
  return sdpa_fp8_scalar_bytes + sdpa_fp8_operand_bytes(a.q) + sdpa_fp8_operand_bytes(a.k) +
         sdpa_fp8_operand_bytes(a.v) + sdpa_fp8_operand_bytes(a.out) + sdpa_fp8_operand_bytes(a.d_out) +
         sdpa_fp8_operand_bytes(a.d_q) + sdpa_fp8_operand_bytes(a.d_k) + sdpa_fp8_operand_bytes(a.d_v);
}

}  // namespace upipe
