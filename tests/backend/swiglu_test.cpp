// swiglu forward and backward against an fp64 reference written here (silu as
// x / (1 + e^-x)) and central finite differences of a scalar loss; saturated gates
// (|x| up to 1e30) stay finite; the in-place backward (d_gate over gate, d_up over up,
// also as column blocks of one fused gate|up matrix) equals separate buffers bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <iterator>
#include <random>
#include <vector>

#include "backend/backend.hpp"
#include "backend/ops.hpp"
#include "op_test_support.hpp"

namespace upipe {
namespace {

using namespace op_test;

double silu(double x) { return x / (1.0 + std::exp(-x)); }

// d silu / dx by the quotient rule on x / (1 + e^-x).
double silu_derivative(double x) {
  const double e = std::exp(-x);
  if (std::isinf(e)) return 0.0;  // x -> -inf: silu' -> 0 faster than e grows
  return (1.0 + e + x * e) / ((1.0 + e) * (1.0 + e));
}

// Gates at and far beyond the point where a float sigmoid saturates or e^-x overflows.
constexpr float saturated_gates[] = {100.0f, -100.0f, 88.9f, -88.9f, 1e4f, -1e4f, 1e30f, -1e30f, 0.0f};

struct swiglu_problem {
  test_matrix gate, up, d_out;
};

swiglu_problem make_problem(backend& be, std::int64_t rows, std::int64_t cols, std::uint32_t seed, float range) {
  std::mt19937 rng(seed);
  swiglu_problem p{make_matrix(be, rows, cols, 2, rng, -range, range, "gate"),
                   make_matrix(be, rows, cols, 1, rng, -2.0f, 2.0f, "up"),
                   make_matrix(be, rows, cols, 3, rng, -1.0f, 1.0f, "d_out")};
  return p;
}

void put_saturated_gates(const test_matrix& gate) {
  for (std::size_t i = 0; i < std::size(saturated_gates); ++i)
    gate(1, static_cast<std::int64_t>(i)) = saturated_gates[i];
}

bool all_finite(const test_matrix& m) {
  for (std::int64_t i = 0; i < m.view.rows; ++i)
    for (std::int64_t j = 0; j < m.view.cols; ++j)
      if (!std::isfinite(m(i, j))) return false;
  return true;
}

TEST(swiglu_forward, matches_fp64_reference_including_saturated_gates) {
  auto be = make_test_backend();
  const std::int64_t rows = 6, cols = 40;
  swiglu_problem p = make_problem(*be, rows, cols, 1, 8.0f);
  put_saturated_gates(p.gate);
  std::mt19937 rng(2);
  test_matrix out = make_matrix(*be, rows, cols, 2, rng, 0.0f, 1.0f, "out");
  ops::swiglu_forward(*be, swiglu_forward_args{p.gate.view, p.up.view, out.view});
  std::vector<double> want;
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) want.push_back(silu(p.gate(i, j)) * p.up(i, j));
  EXPECT_TRUE(all_finite(out));
  EXPECT_LT(max_rel_error(out, want), 1e-6);
  // Saturation: silu(100) = 100 to float precision, silu(-100) = -100 e^-100, no NaN at -1e30.
  EXPECT_FLOAT_EQ(out(1, 0), static_cast<float>(100.0 * p.up(1, 0)));
  EXPECT_NEAR(out(1, 1), 0.0, 1e-40);
  EXPECT_EQ(out(1, 7), 0.0f);
}

// The reference gradients, element by element.
void reference_backward(const swiglu_problem& p, std::vector<double>& d_gate, std::vector<double>& d_up) {
  d_gate.clear();
  d_up.clear();
  for (std::int64_t i = 0; i < p.gate.view.rows; ++i)
    for (std::int64_t j = 0; j < p.gate.view.cols; ++j) {
      const double g = p.gate(i, j), u = p.up(i, j), d = p.d_out(i, j);
      d_gate.push_back(d * u * silu_derivative(g));
      d_up.push_back(d * silu(g));
    }
}

TEST(swiglu_backward, matches_fp64_reference_including_saturated_gates) {
  auto be = make_test_backend();
  const std::int64_t rows = 5, cols = 33;
  swiglu_problem p = make_problem(*be, rows, cols, 3, 8.0f);
  put_saturated_gates(p.gate);
  std::mt19937 rng(4);
  test_matrix d_gate = make_matrix(*be, rows, cols, 1, rng, 5.0f, 6.0f, "d_gate");
  test_matrix d_up = make_matrix(*be, rows, cols, 0, rng, 5.0f, 6.0f, "d_up");
  ops::swiglu_backward(*be, swiglu_backward_args{p.gate.view, p.up.view, p.d_out.view, d_gate.view, d_up.view});
  std::vector<double> want_d_gate, want_d_up;
  reference_backward(p, want_d_gate, want_d_up);
  EXPECT_TRUE(all_finite(d_gate));
  EXPECT_TRUE(all_finite(d_up));
  EXPECT_LT(max_rel_error(d_gate, want_d_gate), 1e-6);
  EXPECT_LT(max_rel_error(d_up, want_d_up), 1e-6);
}

TEST(swiglu_backward, matches_finite_differences_of_a_scalar_loss) {
  auto be = make_test_backend();
  const std::int64_t rows = 4, cols = 9;
  swiglu_problem p = make_problem(*be, rows, cols, 5, 5.0f);
  std::mt19937 rng(6);
  test_matrix d_gate = make_matrix(*be, rows, cols, 0, rng, 0.0f, 1.0f, "d_gate");
  test_matrix d_up = make_matrix(*be, rows, cols, 0, rng, 0.0f, 1.0f, "d_up");
  ops::swiglu_backward(*be, swiglu_backward_args{p.gate.view, p.up.view, p.d_out.view, d_gate.view, d_up.view});
  // loss = sum(d_out * silu(gate) * up), so d loss / d gate and d loss / d up are the op's outputs.
  std::vector<double> gate = to_vector(p.gate), up = to_vector(p.up);
  const std::vector<double> w = to_vector(p.d_out);
  const auto loss = [&] {
    double sum = 0.0;
    for (std::size_t i = 0; i < w.size(); ++i) sum += w[i] * silu(gate[i]) * up[i];
    return sum;
  };
  EXPECT_LT(max_rel_error(d_gate, finite_differences(gate, loss)), 1e-5);
  EXPECT_LT(max_rel_error(d_up, finite_differences(up, loss)), 1e-5);
}

TEST(swiglu_backward, in_place_equals_separate_buffers) {
  auto be = make_test_backend();
  const std::int64_t rows = 7, cols = 24;
  swiglu_problem p = make_problem(*be, rows, cols, 7, 6.0f);
  put_saturated_gates(p.gate);
  std::mt19937 rng(8);
  test_matrix d_gate = make_matrix(*be, rows, cols, 0, rng, 0.0f, 1.0f, "d_gate");
  test_matrix d_up = make_matrix(*be, rows, cols, 0, rng, 0.0f, 1.0f, "d_up");
  ops::swiglu_backward(*be, swiglu_backward_args{p.gate.view, p.up.view, p.d_out.view, d_gate.view, d_up.view});

  // gate and up as the column blocks of one fused (rows, 2 cols) gate|up projection output.
  test_matrix fused = make_matrix(*be, rows, 2 * cols, 0, rng, 0.0f, 1.0f, "gate_up");
  const mat_view gate = fused.view.col_block(0, cols), up = fused.view.col_block(cols, cols);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) {
      fused(i, j) = p.gate(i, j);
      fused(i, cols + j) = p.up(i, j);
    }
  ops::swiglu_backward(*be, swiglu_backward_args{gate, up, p.d_out.view, gate, up});
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) {
      ASSERT_EQ(fused(i, j), d_gate(i, j)) << "d_gate (" << i << ", " << j << ")";
      ASSERT_EQ(fused(i, cols + j), d_up(i, j)) << "d_up (" << i << ", " << j << ")";
    }

  // And over the problem's own (separately allocated) gate and up.
  ops::swiglu_backward(*be, swiglu_backward_args{p.gate.view, p.up.view, p.d_out.view, p.gate.view, p.up.view});
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) {
      ASSERT_EQ(p.gate(i, j), d_gate(i, j)) << "d_gate (" << i << ", " << j << ")";
      ASSERT_EQ(p.up(i, j), d_up(i, j)) << "d_up (" << i << ", " << j << ")";
    }
}

}  // namespace
}  // namespace upipe
