// Views into the buffers of the staged strategies (staged_all_to_all.cpp, staged_chunks.cpp).
#pragma once

#include "core/tensor.hpp"

namespace upipe {

// (tokens, heads, d) view of part j of an (A, rows, n, d) all-to-all buffer: rank j's rows.
inline head_view chunk_heads(const tensor& t, int chunk) {
  const auto& d = t.dims();
  const head_view all = {t.data(), t.type(), d[0] * d[1], d[2], d[3], d[2] * d[3], d[3]};
  return all.token_block(chunk * d[1], d[1]);
}

// The f32 log-sum-exp of heads [first, first + n) of a (heads, S) tensor, as (S, n, 1).
inline head_view lse_heads(const tensor& lse, int first, int n) {
  const std::int64_t tokens = lse.dims()[1];
  const head_view all = {lse.data(), dtype::f32, tokens, lse.dims()[0], 1, 1, tokens};
  return all.head_block(first, n);
}

// Part `which` (0: k, 1: v) of a (2, n, K, d) buffer as (n, K, d).
inline head_view pair_part(const tensor& kv, int which) {
  const auto& d = kv.dims();
  const head_view all = {kv.data(), kv.type(), 2 * d[1], d[2], d[3], d[2] * d[3], d[3]};
  return all.token_block(which * d[1], d[1]);
}

}  // namespace upipe
