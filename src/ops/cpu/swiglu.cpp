// Reference gated linear units: out = act(gate) * up, elementwise, in fp64, with act
// silu (SwiGLU), GELU's tanh approximation (GeGLU) or sigmoid (an output gate). The backward may run in place
// (d_gate over gate, d_up over up): each element's inputs are read before either of its
// outputs is written.
#include <cmath>
#include <cstdint>
#include <utility>

#include "ops/cpu/cpu_ops.hpp"

namespace upipe::cpu {

namespace {

const float* row_of(const mat_view& m, std::int64_t i) { return static_cast<const float*>(m.data) + i * m.ld; }
float* mutable_row_of(const mat_view& m, std::int64_t i) { return static_cast<float*>(m.data) + i * m.ld; }

// exp of a non-positive argument only, so no finite x overflows on the way to 0 or 1.
double sigmoid(double x) {
  if (x >= 0.0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}

constexpr double gelu_k = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double gelu_c = 0.044715;

// act(g) and act'(g).
std::pair<double, double> activation(gate_activation kind, double g) {
  if (kind == gate_activation::silu) {
    const double s = sigmoid(g);
    return {g * s, s * (1.0 + g * (1.0 - s))};
  }
  if (kind == gate_activation::sigmoid) {
    const double s = sigmoid(g);
    return {s, s * (1.0 - s)};
  }
  const double t = std::tanh(gelu_k * (g + gelu_c * g * g * g));
  return {0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * gelu_k * (1.0 + 3.0 * gelu_c * g * g)};
}

}  // namespace

void run(const swiglu_forward_args& args) {
  const std::int64_t cols = args.gate.cols;
  for (std::int64_t r = 0; r < args.gate.rows; ++r) {
    const float* gate = row_of(args.gate, r);
    const float* up = row_of(args.up, r);
    float* out = mutable_row_of(args.out, r);
    for (std::int64_t j = 0; j < cols; ++j) {
      out[j] = static_cast<float>(activation(args.activation, gate[j]).first * up[j]);
    }
  }
}

// d_gate = d_out * up * act'(gate); d_up = d_out * act(gate); silu'(x) = s (1 + x (1 - s)).
void run(const swiglu_backward_args& args) {
  const std::int64_t cols = args.gate.cols;
  for (std::int64_t r = 0; r < args.gate.rows; ++r) {
    const float* gate = row_of(args.gate, r);
    const float* up = row_of(args.up, r);
    const float* d_out = row_of(args.d_out, r);
    float* d_gate = mutable_row_of(args.d_gate, r);
    float* d_up = mutable_row_of(args.d_up, r);
    for (std::int64_t j = 0; j < cols; ++j) {
      const double u = up[j], d = d_out[j];
      const auto [act, slope] = activation(args.activation, gate[j]);
      d_gate[j] = static_cast<float>(d * u * slope);
      d_up[j] = static_cast<float>(d * act);
    }
  }
}

}  // namespace upipe::cpu
