// rmsnorm forward against an fp64 reference, backward against central finite
// differences of a scalar loss (fp64), and d_weight accumulating across calls.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "backend/backend.hpp"
#include "backend/ops.hpp"
#include "op_test_support.hpp"

namespace upipe {
namespace {

using namespace op_test;

constexpr float eps = 1e-5f;

// y = x / sqrt(mean(x^2) + eps) * w, row by row, in fp64.
std::vector<double> reference_forward(const std::vector<double>& x, const std::vector<double>& w, std::int64_t rows,
                                      std::int64_t cols, std::vector<double>* rstd = nullptr) {
  std::vector<double> y(x.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    double ms = 0.0;
    for (std::int64_t j = 0; j < cols; ++j) ms += x[r * cols + j] * x[r * cols + j] / cols;
    const double s = 1.0 / std::sqrt(ms + eps);
    if (rstd != nullptr) rstd->push_back(s);
    for (std::int64_t j = 0; j < cols; ++j) y[r * cols + j] = x[r * cols + j] * s * w[j];
  }
  return y;
}

TEST(rmsnorm, forward_matches_fp64_reference) {
  auto be = make_test_backend();
  std::mt19937 rng(7);
  const std::int64_t rows = 9, cols = 48;
  test_matrix x = make_matrix(*be, rows, cols, 2, rng, -2.0f, 2.0f, "x");
  test_matrix w = make_matrix(*be, 1, cols, 0, rng, 0.5f, 1.5f, "weight");
  test_matrix y = make_matrix(*be, rows, cols, 3, rng, 0.0f, 1.0f, "y");
  test_matrix rstd = make_matrix(*be, rows, 1, 0, rng, 0.0f, 1.0f, "rstd");
  ops::rmsnorm_forward(*be, rmsnorm_forward_args{x.view, w.view, y.view, rstd.view, eps});
  std::vector<double> want_rstd;
  EXPECT_LT(max_rel_error(y, reference_forward(to_vector(x), to_vector(w), rows, cols, &want_rstd)), 1e-6);
  EXPECT_LT(max_rel_error(rstd, want_rstd), 1e-6);
}

// loss = sum(g * y) with y from the fp64 reference.
double loss(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& g,
            std::int64_t rows, std::int64_t cols) {
  const std::vector<double> y = reference_forward(x, w, rows, cols);
  double sum = 0.0;
  for (std::size_t i = 0; i < y.size(); ++i) sum += g[i] * y[i];
  return sum;
}

TEST(rmsnorm, backward_matches_finite_differences_and_accumulates_d_weight) {
  auto be = make_test_backend();
  std::mt19937 rng(8);
  const std::int64_t rows = 5, cols = 24;
  test_matrix x = make_matrix(*be, rows, cols, 1, rng, -2.0f, 2.0f, "x");
  test_matrix w = make_matrix(*be, 1, cols, 0, rng, 0.5f, 1.5f, "weight");
  test_matrix y = make_matrix(*be, rows, cols, 0, rng, 0.0f, 1.0f, "y");
  test_matrix rstd = make_matrix(*be, rows, 1, 0, rng, 0.0f, 1.0f, "rstd");
  test_matrix d_y = make_matrix(*be, rows, cols, 2, rng, -1.0f, 1.0f, "d_y");
  test_matrix d_x = make_matrix(*be, rows, cols, 1, rng, 5.0f, 6.0f, "d_x");  // garbage: must be overwritten
  test_matrix d_w = make_matrix(*be, 1, cols, 0, rng, 0.0f, 1.0f, "d_weight");
  const float prior = 0.375f;  // d_weight's earlier contents, to be added to
  for (std::int64_t j = 0; j < cols; ++j) d_w(0, j) = prior;
  ops::rmsnorm_forward(*be, rmsnorm_forward_args{x.view, w.view, y.view, rstd.view, eps});
  ops::rmsnorm_backward(*be, rmsnorm_backward_args{x.view, w.view, rstd.view, d_y.view, d_x.view, d_w.view});

  std::vector<double> xs = to_vector(x), ws = to_vector(w);
  const std::vector<double> g = to_vector(d_y);
  const auto eval = [&] { return loss(xs, ws, g, rows, cols); };
  EXPECT_LT(max_rel_error(d_x, finite_differences(xs, eval)), 1e-5);
  std::vector<double> want_d_w = finite_differences(ws, eval);
  for (double& v : want_d_w) v += prior;
  EXPECT_LT(max_rel_error(d_w, want_d_w), 1e-5);

  // A second call adds the same gradient again.
  ops::rmsnorm_backward(*be, rmsnorm_backward_args{x.view, w.view, rstd.view, d_y.view, d_x.view, d_w.view});
  for (double& v : want_d_w) v = 2 * v - prior;
  EXPECT_LT(max_rel_error(d_w, want_d_w), 1e-5);
}

}  // namespace
}  // namespace upipe
