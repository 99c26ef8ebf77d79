// The reference GEMM: fp32 data, fp64 accumulation, loops ordered so that the innermost
// one walks contiguous memory whatever the transposes are.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/cpu/cpu_ops.hpp"

namespace upipe::cpu {

namespace {

// Row i of op(a) as a contiguous fp64 vector of length k.
void load_op_row(const mat_view& a, transpose trans, std::int64_t i, std::int64_t k, std::vector<double>& row) {
  const auto* data = static_cast<const float*>(a.data);
  if (trans == transpose::none) {
    const float* src = data + i * a.ld;
    for (std::int64_t p = 0; p < k; ++p) row[p] = src[p];
  } else {
    for (std::int64_t p = 0; p < k; ++p) row[p] = data[p * a.ld + i];
  }
}

}  // namespace

void gemm(const gemm_args& args) {
  const bool trans_b = args.trans_b == transpose::yes;
  const std::int64_t m = args.c.rows, n = args.c.cols;
  const std::int64_t k = args.trans_a == transpose::yes ? args.a.rows : args.a.cols;
  const auto* b = static_cast<const float*>(args.b.data);
  auto* c = static_cast<float*>(args.c.data);
  std::vector<double> a_row(static_cast<std::size_t>(k)), acc(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < m; ++i) {
    load_op_row(args.a, args.trans_a, i, k, a_row);
    if (!trans_b) {
      // i-k-j: each step adds a scaled row of b to the accumulator row.
      std::fill(acc.begin(), acc.end(), 0.0);
      for (std::int64_t p = 0; p < k; ++p) {
        const double aip = a_row[p];
        const float* b_row = b + p * args.b.ld;
        for (std::int64_t j = 0; j < n; ++j) acc[j] += aip * b_row[j];
      }
    } else {
      // op(b)'s column j is b's row j: a dot product of two contiguous rows.
      for (std::int64_t j = 0; j < n; ++j) {
        const float* b_row = b + j * args.b.ld;
        double sum = 0.0;
        for (std::int64_t p = 0; p < k; ++p) sum += a_row[p] * b_row[p];
        acc[j] = sum;
      }
    }
    float* c_row = c + i * args.c.ld;
    const double alpha = args.alpha, beta = args.beta;
    if (beta == 0.0) {
      // c is not read: it may hold garbage (NaN) when beta is zero, as in BLAS.
      for (std::int64_t j = 0; j < n; ++j) c_row[j] = static_cast<float>(alpha * acc[j]);
    } else {
      for (std::int64_t j = 0; j < n; ++j) c_row[j] = static_cast<float>(alpha * acc[j] + beta * c_row[j]);
    }
  }
}

}  // namespace upipe::cpu
