// Reference bias ops: a row vector added to every row, and its gradient, the column sums
// (fp64, rows in order).
#include <cstdint>
#include <vector>

#include "ops/cpu/cpu_ops.hpp"

namespace upipe::cpu {

void run(const bias_add_args& args) {
  const auto* bias = static_cast<const float*>(args.bias.data);
  for (std::int64_t r = 0; r < args.y.rows; ++r) {
    float* y = static_cast<float*>(args.y.data) + r * args.y.ld;
    for (std::int64_t j = 0; j < args.y.cols; ++j) y[j] += bias[j];
  }
}

void run(const bias_grad_args& args) {
  std::vector<double> sums(static_cast<std::size_t>(args.d_y.cols), 0.0);
  for (std::int64_t r = 0; r < args.d_y.rows; ++r) {
    const float* d_y = static_cast<const float*>(args.d_y.data) + r * args.d_y.ld;
    for (std::int64_t j = 0; j < args.d_y.cols; ++j) sums[static_cast<std::size_t>(j)] += d_y[j];
  }
  auto* d_bias = static_cast<float*>(args.d_bias.data);
  for (std::int64_t j = 0; j < args.d_y.cols; ++j) d_bias[j] += static_cast<float>(sums[static_cast<std::size_t>(j)]);
}

}  // namespace upipe::cpu
