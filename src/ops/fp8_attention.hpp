// FP8 attention's scales (docs/design.md section 6, "FP8 attention"): one definition that
// the cpu backend and the CUDA kernels both compute, so that both quantize with the same
// numbers. Every scale is a power of two (dequantizing is exact in fp32) and per tensor,
// from the current call's amax ("current scaling"): x8 = fp8(x * scale), x = x8 / scale.
//   forward: Q, K, V in E4M3 scaled to their amax; the softmax probabilities (at most 1) in
//            E4M3 at 256; O in E4M3 at V's scale (a convex combination of V's rows).
//   backward: Q, K, V, O in E4M3 at their amax; dO in E5M2 at its amax; cuDNN's dS =
//            scale P (dP - D) and the outputs dQ, dK, dV in E5M2 at scales from bounds
//            that the inputs' amaxes give, since Hopper's kernels write them in FP8 and their
//            amax is known only after the call (E5M2's range absorbs the bounds' slack).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define UPIPE_FP8_HOST_DEVICE __host__ __device__
#else
#define UPIPE_FP8_HOST_DEVICE
#endif

namespace upipe {

inline constexpr float fp8_e4m3_largest = 448.0f, fp8_e5m2_largest = 57344.0f;

// The head dims cuDNN's FP8 fused attention runs on Hopper (sm 9.x, the H100 and H200), as
// cudnn-frontend 1.32's support checks state them for every cuDNN 9 behind it: the forward
// at head dims up to 256 in multiples of 16, the backward at 128 alone. A newer cuDNN does not
// lift the backward's rule on Hopper (the frontend lifts it on Blackwell only).
// tests/gpu/sdpa_test.cpp asks the loaded cuDNN at every multiple of 16 up to 256 and holds it
// to these rows.
inline constexpr std::int64_t fp8_head_dim_multiple = 16, fp8_forward_max_head_dim = 256,
                              fp8_backward_head_dim = 128;
UPIPE_FP8_HOST_DEVICE inline bool fp8_attention_runs(std::int64_t head_dim, bool backward) {
  if (head_dim <= 0 || head_dim % fp8_head_dim_multiple != 0) return false;
  return backward ? head_dim == fp8_backward_head_dim : head_dim <= fp8_forward_max_head_dim;
}
inline constexpr float fp8_probability_scale = 256.0f;  // P <= 1 lands at most at 256 < 448

// The largest power of two s with amax s <= largest (1 for a zero or non-finite amax),
// its exponent kept within [-100, 100]. Read from the quotient's exponent bits, so that the
// host and the device compute it alike without library calls.
UPIPE_FP8_HOST_DEVICE inline float fp8_scale(float amax, float largest) {
  if (!(amax > 0.0f) || !(amax - amax == 0.0f)) return 1.0f;  // zero, negative, NaN or infinite
  const float ratio = largest / amax;                         // finite amax: a normal ratio, or infinity
  std::uint32_t bits = 0;
  std::memcpy(&bits, &ratio, sizeof bits);
  int exponent = static_cast<int>((bits >> 23) & 0xffu) - 127;  // floor(log2(ratio))
  exponent = exponent < -100 ? -100 : exponent > 100 ? 100 : exponent;
  bits = static_cast<std::uint32_t>(exponent + 127) << 23;
  float scale = 0.0f;
  std::memcpy(&scale, &bits, sizeof scale);
  return scale;
}

struct fp8_forward_scales {
  float q = 1, k = 1, v = 1;  // E4M3
  float s = fp8_probability_scale;
  float o = 1;  // E4M3, V's
};

UPIPE_FP8_HOST_DEVICE inline fp8_forward_scales fp8_forward_scales_of(float amax_q, float amax_k, float amax_v) {
  fp8_forward_scales s;
  s.q = fp8_scale(amax_q, fp8_e4m3_largest);
  s.k = fp8_scale(amax_k, fp8_e4m3_largest);
  s.v = fp8_scale(amax_v, fp8_e4m3_largest);
  s.o = s.v;
  return s;
}

// The amaxes of a backward call's inputs (the working-dtype tensors, before quantizing).
struct fp8_backward_amax {
  float q = 0, k = 0, v = 0, o = 0, d_o = 0;
};

struct fp8_backward_scales {
  float q = 1, k = 1, v = 1, o = 1;  // E4M3
  float d_o = 1;                     // E5M2
  float s = fp8_probability_scale;   // E4M3
  float d_s = 1;                     // E5M2 (cuDNN names it dP)
  float d_q = 1, d_k = 1, d_v = 1;   // E5M2
};

// Bounds, with x the amax of a dequantized tensor (at most 1.125 times the amax given,
// covered by the factor 2), D_i = dO_i . O_i and sum_j P_ij <= 1:
//   |dS_ij| <= |scale| P_ij d x_dO (x_V + x_O),   |dQ| <= that without P times x_K,
//   |dK| <= that times x_Q sq,                    |dV| <= x_dO sq.
UPIPE_FP8_HOST_DEVICE inline fp8_backward_scales fp8_backward_scales_of(const fp8_backward_amax& a,
                                                                       std::int64_t q_tokens, std::int64_t dim,
                                                                       float attn_scale) {
  fp8_backward_scales s;
  s.q = fp8_scale(a.q, fp8_e4m3_largest);
  s.k = fp8_scale(a.k, fp8_e4m3_largest);
  s.v = fp8_scale(a.v, fp8_e4m3_largest);
  s.o = fp8_scale(a.o, fp8_e4m3_largest);
  s.d_o = fp8_scale(a.d_o, fp8_e5m2_largest);
  const float rows = static_cast<float>(q_tokens), headroom = 2.0f;
  const float magnitude = attn_scale < 0 ? -attn_scale : attn_scale;
  const float d_s = headroom * magnitude * static_cast<float>(dim) * a.d_o * (a.v + a.o);
  s.d_s = fp8_scale(d_s, fp8_e5m2_largest);
  s.d_q = fp8_scale(d_s * a.k, fp8_e5m2_largest);
  s.d_k = fp8_scale(d_s * a.q * rows, fp8_e5m2_largest);
  s.d_v = fp8_scale(headroom * a.d_o * rows, fp8_e5m2_largest);
  return s;
}

}  // namespace upipe
