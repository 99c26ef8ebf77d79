// An independent single-device attention layer in float64: plain loops, no stages, no
// communication, no shared ops but the RoPE frequencies. The oracle every strategy is
// measured against (max|a-b| / max|b| per tensor).
#pragma once

#include <span>
#include <vector>

#include "cp/attention_config.hpp"

namespace upipe {

struct attention_inputs {
  std::vector<float> x;   // (S, D)
  std::vector<float> wq;  // (H*d, D)
  std::vector<float> wk;  // (K*d, D)
  std::vector<float> wv;  // (K*d, D)
  std::vector<float> wo;  // (D, H*d)
  std::vector<float> d_y; // (S, D)
  std::vector<float> q_norm, k_norm;  // (d) each, with config.qk_norm
};

struct attention_outputs {
  std::vector<double> y;         // (S, D)
  std::vector<double> attn_out;  // (S, H*d)
  std::vector<double> d_x;       // (S, D)
  std::vector<double> d_wq, d_wk, d_wv, d_wo;
  std::vector<double> d_q_norm, d_k_norm;  // with config.qk_norm
};

// Random normal inputs; every weight drawn independently (asymmetric).
attention_inputs random_attention_inputs(const attention_config& config, unsigned long long seed);

// With `documents` (the indices where packed documents begin, the first 0), a token
// attends only to earlier tokens of its own document and its RoPE position counts from
// the document's start; with config.window W > 0 only to the last W of them.
attention_outputs reference_attention_layer(const attention_config& config, const attention_inputs& in,
                                            std::span<const std::int64_t> documents = {});

// max|a - b| / max|b|; 0 when both are all zero.
double relative_error(std::span<const double> a, std::span<const double> b);

}  // namespace upipe
