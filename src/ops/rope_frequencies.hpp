// RoPE's frequencies and the checks of its configuration: shared by the rope entry
// (backend/ops.hpp) and every backend's kernel, which derive their angles from them.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/op_args.hpp"

namespace upipe::ops {

// Throws naming the first value of `config` that no RoPE accepts (theta, the scaling's
// factor and its kind's parameters).
void check_rope_config(const rope_config& config);

// The per-pair inverse frequencies of RoPE for head dim d, in fp64, with Llama 3
// (llama3, linear, yarn) scaling applied. Every backend derives its angles from these.
std::vector<double> rope_inverse_frequencies(const rope_config& config, std::int64_t head_dim);
// The factor on cos and sin (yarn's attention factor; 1 for the other kinds), applied in
// both directions since the inverse direction is the gradient's transpose.
double rope_attention_factor(const rope_config& config);

}  // namespace upipe::ops
