// The reference GEMM: fp32 data and fp32 accumulation (as cuBLAS accumulates bf16
// products), in a fixed order so results are reproducible. op(b) is first packed into a
// contiguous k x n panel, so that the innermost loop always streams two contiguous rows
// whatever the transposes are and the compiler can vectorize it.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/cpu/cpu_ops.hpp"

namespace upipe::cpu {

namespace {

// Row i of op(a) as a contiguous vector of length k.
void load_op_row(const mat_view& a, transpose trans, std::int64_t i, std::int64_t k, float* row) {
  const auto* data = static_cast<const float*>(a.data);
  if (trans == transpose::none) {
    const float* src = data + i * a.ld;
    for (std::int64_t p = 0; p < k; ++p) row[p] = src[p];
  } else {
    for (std::int64_t p = 0; p < k; ++p) row[p] = data[p * a.ld + i];
  }
}

// op(b) as a row-major k x n panel.
std::vector<float> pack_op_b(const mat_view& b, transpose trans, std::int64_t k, std::int64_t n) {
  std::vector<float> panel(static_cast<std::size_t>(k * n));
  const auto* data = static_cast<const float*>(b.data);
  for (std::int64_t p = 0; p < k; ++p)
    for (std::int64_t j = 0; j < n; ++j)
      panel[p * n + j] = trans == transpose::none ? data[p * b.ld + j] : data[j * b.ld + p];
  return panel;
}

// acc (rows x n) = a (rows x k) x panel (k x n) for up to four rows at once, so that each
// panel row loaded serves four output rows. Built for AVX2 too, chosen at run time.
constexpr std::int64_t row_block = 4;
__attribute__((target_clones("avx2", "default"))) void rows_times_panel(const float* a, std::int64_t rows,
                                                                        const float* panel, std::int64_t k,
                                                                        std::int64_t n, float* acc) {
  std::fill(acc, acc + rows * n, 0.0);
  if (rows == row_block) {
    float *c0 = acc, *c1 = acc + n, *c2 = acc + 2 * n, *c3 = acc + 3 * n;
    for (std::int64_t p = 0; p < k; ++p) {
      const float a0 = a[p], a1 = a[k + p], a2 = a[2 * k + p], a3 = a[3 * k + p];
      const float* b_row = panel + p * n;
      for (std::int64_t j = 0; j < n; ++j) {
        const float bj = b_row[j];
        c0[j] += a0 * bj;
        c1[j] += a1 * bj;
        c2[j] += a2 * bj;
        c3[j] += a3 * bj;
      }
    }
    return;
  }
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t p = 0; p < k; ++p) {
      const float arp = a[r * k + p];
      const float* b_row = panel + p * n;
      for (std::int64_t j = 0; j < n; ++j) acc[r * n + j] += arp * b_row[j];
    }
}

}  // namespace

void run(const gemm_args& args) {
  const std::int64_t m = args.c.rows, n = args.c.cols;
  const std::int64_t k = args.trans_a == transpose::yes ? args.a.rows : args.a.cols;
  auto* c = static_cast<float*>(args.c.data);
  const std::vector<float> panel = pack_op_b(args.b, args.trans_b, k, n);
  std::vector<float> a_rows(static_cast<std::size_t>(row_block * k)), acc(static_cast<std::size_t>(row_block * n));
  const float alpha = args.alpha, beta = args.beta;
  for (std::int64_t i0 = 0; i0 < m; i0 += row_block) {
    const std::int64_t rows = std::min(row_block, m - i0);
    for (std::int64_t r = 0; r < rows; ++r) load_op_row(args.a, args.trans_a, i0 + r, k, a_rows.data() + r * k);
    rows_times_panel(a_rows.data(), rows, panel.data(), k, n, acc.data());
    for (std::int64_t r = 0; r < rows; ++r) {
      float* c_row = c + (i0 + r) * args.c.ld;
      const float* acc_row = acc.data() + r * n;
      if (beta == 0.0f) {
        // c is not read: it may hold garbage (NaN) when beta is zero, as in BLAS.
        for (std::int64_t j = 0; j < n; ++j) c_row[j] = static_cast<float>(alpha * acc_row[j]);
      } else {
        for (std::int64_t j = 0; j < n; ++j) c_row[j] = static_cast<float>(alpha * acc_row[j] + beta * c_row[j]);
      }
    }
  }
}

}  // namespace upipe::cpu
