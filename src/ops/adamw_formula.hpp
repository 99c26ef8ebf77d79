// The one AdamW arithmetic of every backend: the cpu backend's op, the host optimizer of
// --offload (the same function, called from host threads) and the GPU kernel all run
// these functions in fp32, with the step's scalars formed once in fp64 and rounded to
// float. Each product, sum, quotient and square root is rounded on its own (no fused
// multiply-add: the files that include this compile with contraction off), and all of
// them are IEEE operations on both sides, so one element gets the same bits wherever it
// is updated, whatever the vector width or the split into pieces.
//
// An element's update is two halves: adamw_moments (the moments and the step taken) and
// adamw_master or adamw_master_kahan (the decay and the step applied to the master
// weights). Run together or apart (the direction crossing between GPU and host), the
// master gets the same bits. Stored moments are decoded to fp32 before the update and
// encoded after it (bf16: round to nearest even; q8: ops/q8_map.hpp), and the master's
// step uses the fp32 moments before encoding, as bitsandbytes' 8-bit optimizers do.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "ops/op_args.hpp"

#if defined(__CUDACC__)
#define UPIPE_HOST_DEVICE __host__ __device__
#else
#define UPIPE_HOST_DEVICE
#endif

namespace upipe {

// The step's scalars. PyTorch's term order (torch/optim/adamw.py):
//   p *= 1 - lr wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
//   denom = sqrt(v) / sqrt(1 - b2^t) + eps;  p -= lr / (1 - b1^t) * m / denom.
struct adamw_coefficients {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, grad_scale;
  float decay;                  // 1 - lr * weight_decay
  float decay_rate;             // lr * weight_decay (bf16-kahan takes the decay as a term of the update)
  float step_size;              // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
};

inline adamw_coefficients adamw_coefficients_of(const adamw_args& a) {
  const double lr = a.lr, beta1 = a.beta1, beta2 = a.beta2;
  const auto t = static_cast<double>(a.step);
  return {a.beta1,
          a.beta2,
          static_cast<float>(1.0 - beta1),
          static_cast<float>(1.0 - beta2),
          a.eps,
          a.grad_scale,
          static_cast<float>(1.0 - lr * static_cast<double>(a.weight_decay)),
          static_cast<float>(lr * static_cast<double>(a.weight_decay)),
          static_cast<float>(lr / (1.0 - std::pow(beta1, t))),
          static_cast<float>(std::sqrt(1.0 - std::pow(beta2, t)))};
}

// The decay of an element outside a decaying run: none.
struct adamw_decay {
  float decay, rate;
};
UPIPE_HOST_DEVICE inline adamw_decay decay_of(const adamw_coefficients& c, bool decays) {
  return decays ? adamw_decay{c.decay, c.decay_rate} : adamw_decay{1.0f, 0.0f};
}

// The moments updated in place from the gradient g; returns the step the master takes,
// lr / (1 - b1^t) * m / denom.
UPIPE_HOST_DEVICE inline float adamw_moments(const adamw_coefficients& c, float& m, float& v, float g) {
  const float grad = g * c.grad_scale;
  m = c.beta1 * m + c.one_minus_beta1 * grad;
  v = c.beta2 * v + c.one_minus_beta2 * grad * grad;
#if defined(__CUDA_ARCH__)
  const float root = sqrtf(v);
#else
  const float root = std::sqrt(v);
#endif
  const float denom = root / c.bias_correction2_sqrt + c.eps;
  return c.step_size * m / denom;
}

// An fp32 master: the decay, then the step.
UPIPE_HOST_DEVICE inline float adamw_master(float master, adamw_decay d, float step) { return master * d.decay - step; }

// The fp32 bits of a float and back, on both sides.
UPIPE_HOST_DEVICE inline std::uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
#endif
}
UPIPE_HOST_DEVICE inline float bits_float(std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
#endif
}

// core/dtype.hpp's float_to_bf16 without the branch (it vectorizes and runs on the GPU):
// round to nearest even, a NaN stays a quiet NaN.
UPIPE_HOST_DEVICE inline std::uint16_t bf16_bits(float value) {
  const std::uint32_t bits = float_bits(value);
  const auto rounded = static_cast<std::uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  const auto quiet = static_cast<std::uint16_t>((bits >> 16) | 0x0040u);
  const bool nan = (bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0;
  return nan ? quiet : rounded;
}
UPIPE_HOST_DEVICE inline float bf16_value(std::uint16_t bits) { return bits_float(static_cast<std::uint32_t>(bits) << 16); }

// bf16 master weights w with a bf16 compensation c (Kahan summation): the update
// u = -(w lr wd) - step is added to c, w takes what of c + u bf16 can hold, and c keeps
// the rest, so that the steps too small for bf16 accumulate in c until w can take them.
UPIPE_HOST_DEVICE inline void adamw_master_kahan(std::uint16_t& w, std::uint16_t& c, adamw_decay d, float step) {
  const float x = bf16_value(w);
  const float update = -(x * d.rate) - step;
  const float y = bf16_value(c) + update;
  const std::uint16_t next = bf16_bits(x + y);
  // Exact whenever next and x lie within 2^16 of each other (two bf16 values), as they do
  // unless the weight is nearly zero; either way every backend rounds it alike.
  const float taken = bf16_value(next) - x;
  w = next;
  c = bf16_bits(y - taken);
}

// The buffers of one adamw call, cast once (the cpu op's and the CUDA kernel's): comp is the
// bf16-kahan master's compensation (bf16 bits), weights the working copy or nullptr.
struct adamw_pointers {
  void* master;
  std::uint16_t* comp;
  void *m, *v;
  float *m_absmax, *v_absmax;
  const void* grad;
  void* weights;
  float* direction;
};

inline adamw_pointers pointers_of(const adamw_args& a) {
  const bool weights = a.weights.data != nullptr && a.weights.cols > 0;
  return {a.master.data,
          static_cast<std::uint16_t*>(a.master_comp.data),
          a.exp_avg.data,
          a.exp_avg_sq.data,
          static_cast<float*>(a.exp_avg_absmax.data),
          static_cast<float*>(a.exp_avg_sq_absmax.data),
          a.grad.data,
          weights ? a.weights.data : nullptr,
          static_cast<float*>(a.direction.data)};
}

}  // namespace upipe
