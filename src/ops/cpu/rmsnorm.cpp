// Reference RMSNorm (the Hugging Face Llama convention: y = x * rstd * weight; Gemma's
// y = x * rstd * (1 + weight) with weight_offset 1), with the per-row rstd saved for the
// backward. fp32 data, fp64 sums.
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops/cpu/cpu_ops.hpp"

namespace upipe::cpu {

namespace {

const float* row_of(const mat_view& m, std::int64_t i) { return static_cast<const float*>(m.data) + i * m.ld; }
float* mutable_row_of(const mat_view& m, std::int64_t i) { return static_cast<float*>(m.data) + i * m.ld; }

}  // namespace

void run(const rmsnorm_forward_args& args) {
  const std::int64_t cols = args.x.cols;
  const float* weight = row_of(args.weight, 0);
  for (std::int64_t r = 0; r < args.x.rows; ++r) {
    const float* x = row_of(args.x, r);
    double sum_sq = 0.0;
    for (std::int64_t j = 0; j < cols; ++j) sum_sq += static_cast<double>(x[j]) * x[j];
    const double mean_sq = cols > 0 ? sum_sq / static_cast<double>(cols) : 0.0;
    const auto rstd = static_cast<float>(1.0 / std::sqrt(mean_sq + static_cast<double>(args.eps)));
    *mutable_row_of(args.rstd, r) = rstd;
    float* y = mutable_row_of(args.y, r);
    for (std::int64_t j = 0; j < cols; ++j) y[j] = x[j] * rstd * (args.weight_offset + weight[j]);
  }
}

// With g = d_y * (offset + weight): d_x = rstd * (g - x * rstd^2 * mean(g * x)); d_weight += d_y * x * rstd.
void run(const rmsnorm_backward_args& args) {
  const std::int64_t cols = args.x.cols;
  const float* stored = row_of(args.weight, 0);
  std::vector<float> weight(stored, stored + cols);
  for (float& w : weight) w += args.weight_offset;
  float* d_weight = args.d_weight.rows > 0 ? mutable_row_of(args.d_weight, 0) : nullptr;  // none: frozen
  for (std::int64_t r = 0; r < args.x.rows; ++r) {
    const float* x = row_of(args.x, r);
    const float* d_y = row_of(args.d_y, r);
    const double rstd = *row_of(args.rstd, r);
    double g_dot_x = 0.0;
    for (std::int64_t j = 0; j < cols; ++j) g_dot_x += static_cast<double>(d_y[j]) * weight[j] * x[j];
    const double correction = cols > 0 ? rstd * rstd * g_dot_x / static_cast<double>(cols) : 0.0;
    float* d_x = mutable_row_of(args.d_x, r);
    // d_x may alias d_y (in-place backward): read d_y[j] before d_x[j] is written.
    for (std::int64_t j = 0; j < cols; ++j) {
      const double dy = d_y[j];
      if (d_weight != nullptr) d_weight[j] += static_cast<float>(dy * x[j] * rstd);
      d_x[j] = static_cast<float>(rstd * (dy * weight[j] - x[j] * correction));
    }
  }
}

}  // namespace upipe::cpu
