// gemm on the cpu backend against a naive fp64 reference: every transpose combination,
// padded leading dimensions, alpha/beta, and beta == 0 never reading c.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "backend/backend.hpp"
#include "backend/ops.hpp"
#include "op_test_support.hpp"

namespace upipe {
namespace {

using namespace op_test;

double element(const mat_view& m, std::int64_t i, std::int64_t j) {
  return static_cast<const float*>(m.data)[i * m.ld + j];
}

double op_element(const mat_view& m, transpose t, std::int64_t i, std::int64_t j) {
  return t == transpose::yes ? element(m, j, i) : element(m, i, j);
}

struct gemm_case {
  transpose trans_a, trans_b;
  std::int64_t m, n, k;
  float alpha, beta;
  bool c_holds_nan;  // beta == 0 must not read c
};

void run_case(const gemm_case& gc, std::uint32_t seed) {
  auto be = make_test_backend();
  std::mt19937 rng(seed);
  const bool ta = gc.trans_a == transpose::yes, tb = gc.trans_b == transpose::yes;
  auto a = make_matrix(*be, ta ? gc.k : gc.m, ta ? gc.m : gc.k, 3, rng, -1.0f, 1.0f, "a");
  auto b = make_matrix(*be, tb ? gc.n : gc.k, tb ? gc.k : gc.n, 5, rng, -1.0f, 1.0f, "b");
  auto c = make_matrix(*be, gc.m, gc.n, 2, rng, -1.0f, 1.0f, "c");
  if (gc.c_holds_nan)
    for (std::int64_t i = 0; i < gc.m; ++i)
      for (std::int64_t j = 0; j < gc.n; ++j)
        static_cast<float*>(c.view.data)[i * c.view.ld + j] = std::numeric_limits<float>::quiet_NaN();

  std::vector<double> ref(static_cast<std::size_t>(gc.m * gc.n));
  for (std::int64_t i = 0; i < gc.m; ++i)
    for (std::int64_t j = 0; j < gc.n; ++j) {
      double sum = 0.0;
      for (std::int64_t p = 0; p < gc.k; ++p)
        sum += op_element(a.view, gc.trans_a, i, p) * op_element(b.view, gc.trans_b, p, j);
      ref[i * gc.n + j] = gc.alpha * sum + (gc.beta != 0.0f ? gc.beta * element(c.view, i, j) : 0.0);
    }
  // The padding columns of c must survive untouched.
  const float pad_before = static_cast<float*>(c.view.data)[gc.n];

  ops::gemm(*be, gemm_args{a.view, gc.trans_a, b.view, gc.trans_b, c.view, gc.alpha, gc.beta});

  double max_err = 0.0, max_ref = 0.0;
  for (std::int64_t i = 0; i < gc.m; ++i)
    for (std::int64_t j = 0; j < gc.n; ++j) {
      const double got = element(c.view, i, j);
      ASSERT_TRUE(std::isfinite(got)) << "c(" << i << ", " << j << ")";
      max_err = std::max(max_err, std::abs(got - ref[i * gc.n + j]));
      max_ref = std::max(max_ref, std::abs(ref[i * gc.n + j]));
    }
  EXPECT_LT(max_err / max_ref, 1e-6) << "m " << gc.m << " n " << gc.n << " k " << gc.k << " ta " << ta << " tb " << tb;
  EXPECT_EQ(std::bit_cast<std::uint32_t>(static_cast<float*>(c.view.data)[gc.n]),
            std::bit_cast<std::uint32_t>(pad_before));
}

TEST(gemm, all_transpose_combinations_with_padded_leading_dims) {
  std::uint32_t seed = 1;
  for (transpose ta : {transpose::none, transpose::yes})
    for (transpose tb : {transpose::none, transpose::yes}) run_case({ta, tb, 13, 17, 29, 1.0f, 0.0f, false}, seed++);
}

TEST(gemm, alpha_and_beta_scale_and_accumulate) {
  std::uint32_t seed = 10;
  for (transpose ta : {transpose::none, transpose::yes})
    for (transpose tb : {transpose::none, transpose::yes}) run_case({ta, tb, 9, 21, 40, -0.75f, 0.5f, false}, seed++);
}

TEST(gemm, beta_zero_ignores_nan_in_c) {
  std::uint32_t seed = 20;
  for (transpose ta : {transpose::none, transpose::yes})
    for (transpose tb : {transpose::none, transpose::yes}) run_case({ta, tb, 11, 8, 16, 2.0f, 0.0f, true}, seed++);
}

TEST(gemm, larger_square_product) { run_case({transpose::none, transpose::none, 96, 80, 128, 1.0f, 1.0f, false}, 30); }

}  // namespace
}  // namespace upipe
