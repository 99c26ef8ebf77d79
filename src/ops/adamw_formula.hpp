// The one AdamW arithmetic of every backend: the cpu backend's op, the host optimizer of
// --offload (the same function, called from host threads) and the GPU kernel all run
// adamw_element in fp32, with the step's scalars formed once in fp64 and rounded to
// float. Each product, sum, quotient and square root is rounded on its own (no fused
// multiply-add: the files that include this compile with contraction off), and all of
// them are IEEE operations on both sides, so one element gets the same bits wherever it
// is updated, whatever the vector width or the split into pieces.
#pragma once

#include <cmath>

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
          static_cast<float>(lr / (1.0 - std::pow(beta1, t))),
          static_cast<float>(std::sqrt(1.0 - std::pow(beta2, t)))};
}

// One element: master, m and v updated in place from the gradient g.
UPIPE_HOST_DEVICE inline void adamw_element(const adamw_coefficients& c, float& master, float& m, float& v, float g) {
  const float grad = g * c.grad_scale;
  m = c.beta1 * m + c.one_minus_beta1 * grad;
  v = c.beta2 * v + c.one_minus_beta2 * grad * grad;
#if defined(__CUDA_ARCH__)
  const float root = sqrtf(v);
#else
  const float root = std::sqrt(v);
#endif
  const float denom = root / c.bias_correction2_sqrt + c.eps;
  master = master * c.decay - c.step_size * m / denom;
}

}  // namespace upipe
