// Reference AdamW step on a flat fp32 shard and the fp64 sum of squares behind the
// global gradient norm. Every element is computed in fp64 and stored once as float.
#include <cmath>
#include <cstdint>

#include "core/dtype.hpp"
#include "ops/cpu/cpu_ops.hpp"

namespace upipe::cpu {

namespace {

const float* row_of(const mat_view& m, std::int64_t i) { return static_cast<const float*>(m.data) + i * m.ld; }
float* f32_data(const mat_view& m) { return static_cast<float*>(m.data); }

// The step's scalars, formed once in fp64 as torch.optim.AdamW forms them.
struct adamw_scalars {
  double beta1, beta2, eps, grad_scale;
  double decay;                  // 1 - lr * weight_decay
  double step_size;              // lr / (1 - beta1^t)
  double bias_correction2_sqrt;  // sqrt(1 - beta2^t)
};

adamw_scalars scalars_of(const adamw_args& args) {
  const double lr = args.lr, beta1 = args.beta1, beta2 = args.beta2;
  const auto t = static_cast<double>(args.step);
  const double bias_correction1 = 1.0 - std::pow(beta1, t);
  const double bias_correction2 = 1.0 - std::pow(beta2, t);
  return {beta1,
          beta2,
          static_cast<double>(args.eps),
          static_cast<double>(args.grad_scale),
          1.0 - lr * static_cast<double>(args.weight_decay),
          lr / bias_correction1,
          std::sqrt(bias_correction2)};
}

}  // namespace

// PyTorch's single-tensor AdamW (torch/optim/adamw.py), term for term:
//   p *= 1 - lr wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
//   denom = sqrt(v) / sqrt(1 - b2^t) + eps;  p -= lr / (1 - b1^t) * m / denom.
// This equals the form in adamw_args' comment (the decay reads the master value from
// before the step); only the rounding follows PyTorch's order.
void adamw(const adamw_args& args) {
  const adamw_scalars s = scalars_of(args);
  const std::int64_t n = args.master.cols;
  float* master = f32_data(args.master);
  float* exp_avg = f32_data(args.exp_avg);
  float* exp_avg_sq = f32_data(args.exp_avg_sq);
  const float* grad = row_of(args.grad, 0);
  const bool write_weights = args.weights.data != nullptr && args.weights.cols > 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double g = static_cast<double>(grad[i]) * s.grad_scale;
    const double m = s.beta1 * exp_avg[i] + (1.0 - s.beta1) * g;
    const double v = s.beta2 * exp_avg_sq[i] + (1.0 - s.beta2) * g * g;
    const double denom = std::sqrt(v) / s.bias_correction2_sqrt + s.eps;
    const double p = static_cast<double>(master[i]) * s.decay - s.step_size * m / denom;
    exp_avg[i] = static_cast<float>(m);
    exp_avg_sq[i] = static_cast<float>(v);
    master[i] = static_cast<float>(p);
    if (!write_weights) continue;
    // The working copy is the stored master, so it never differs from what a reload sees.
    if (args.weights.type == dtype::bf16)
      static_cast<std::uint16_t*>(args.weights.data)[i] = float_to_bf16(master[i]);
    else
      f32_data(args.weights)[i] = master[i];
  }
}

double sum_squares(const mat_view& x) {
  double sum = 0.0;
  for (std::int64_t r = 0; r < x.rows; ++r) {
    const float* row = row_of(x, r);
    for (std::int64_t j = 0; j < x.cols; ++j) sum += static_cast<double>(row[j]) * row[j];
  }
  return sum;
}

}  // namespace upipe::cpu
