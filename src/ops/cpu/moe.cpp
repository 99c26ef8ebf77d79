// Reference mixture-of-experts ops (ops/op_args.hpp): the router's softmax and top-k with
// their backward, the gather and weighted scatter of a tile's rows in the experts' order,
// and Qwen2-MoE's sigmoid-gated shared expert. fp32, sums in fp64.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "ops/cpu/cpu_ops.hpp"

namespace upipe::cpu {

namespace {

float* row_of(const mat_view& m, std::int64_t r) { return static_cast<float*>(m.data) + r * m.ld; }
std::int32_t* ids_of(const mat_view& m, std::int64_t r) { return static_cast<std::int32_t*>(m.data) + r * m.ld; }
std::int32_t id_at(const mat_view& m, std::int64_t i) { return *ids_of(m, i); }
// Element i of an (n, k) matrix read flat (row i / k, column i % k).
float& flat_at(const mat_view& m, std::int64_t i) { return row_of(m, i / m.cols)[i % m.cols]; }

}  // namespace

void run(const moe_route_args& args) {
  const std::int64_t n = args.logits.rows, E = args.logits.cols, k = args.weights.cols;
  std::vector<std::int32_t> order(static_cast<std::size_t>(E));
  for (std::int64_t r = 0; r < n; ++r) {
    const float* z = row_of(args.logits, r);
    float* p = row_of(args.probs, r);
    const float top = *std::max_element(z, z + E);
    double sum = 0;
    for (std::int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(z[e]) - top);
    for (std::int64_t e = 0; e < E; ++e) p[e] = static_cast<float>(std::exp(static_cast<double>(z[e]) - top) / sum);
    std::iota(order.begin(), order.end(), 0);
    // Descending, the lower expert first among equals.
    std::stable_sort(order.begin(), order.end(), [p](std::int32_t a, std::int32_t b) { return p[a] > p[b]; });
    float* w = row_of(args.weights, r);
    std::int32_t* x = ids_of(args.experts, r);
    float chosen = 0.0f;  // in fp32, as torch sums the k values
    for (std::int64_t j = 0; j < k; ++j) {
      x[j] = order[static_cast<std::size_t>(j)];
      w[j] = p[x[j]];
      chosen += w[j];
    }
    if (args.normalize)
      for (std::int64_t j = 0; j < k; ++j) w[j] /= chosen;
  }
}

void run(const moe_route_backward_args& args) {
  const std::int64_t n = args.probs.rows, E = args.probs.cols, k = args.experts.cols;
  const float* aux = args.aux_grad.rows > 0 ? static_cast<const float*>(args.aux_grad.data) : nullptr;
  std::vector<double> d_p(static_cast<std::size_t>(E));
  for (std::int64_t r = 0; r < n; ++r) {
    const float* p = row_of(args.probs, r);
    const std::int32_t* x = ids_of(args.experts, r);
    const float* d_w = row_of(args.d_weights, r);
    for (std::int64_t e = 0; e < E; ++e) d_p[static_cast<std::size_t>(e)] = aux != nullptr ? aux[e] : 0.0;
    // w_j = v_j / S with S = sum v: dL/dv_j = (d_w_j - sum_i d_w_i w_i) / S.
    double chosen = 0, weighted = 0;
    for (std::int64_t j = 0; j < k; ++j) chosen += p[x[j]];
    for (std::int64_t j = 0; j < k; ++j) weighted += static_cast<double>(d_w[j]) * p[x[j]] / chosen;
    for (std::int64_t j = 0; j < k; ++j)
      d_p[static_cast<std::size_t>(x[j])] += args.normalize ? (d_w[j] - weighted) / chosen : d_w[j];
    double dot = 0;
    for (std::int64_t e = 0; e < E; ++e) dot += p[e] * d_p[static_cast<std::size_t>(e)];
    float* d_z = row_of(args.d_logits, r);
    for (std::int64_t e = 0; e < E; ++e) d_z[e] = static_cast<float>(p[e] * (d_p[static_cast<std::size_t>(e)] - dot));
  }
}

void run(const moe_gather_args& args) {
  for (std::int64_t i = 0; i < args.dst.rows; ++i)
    std::copy_n(row_of(args.src, id_at(args.index, i)), args.dst.cols, row_of(args.dst, i));
}

void run(const moe_scatter_args& args) {
  for (std::int64_t i = 0; i < args.src.rows; ++i) {
    const float w = args.weights.rows > 0 ? flat_at(args.weights, id_at(args.slot, i)) : 1.0f;
    const float* s = row_of(args.src, i);
    float* d = row_of(args.dst, id_at(args.index, i));
    for (std::int64_t j = 0; j < args.src.cols; ++j) d[j] += w * s[j];
  }
}

void run(const moe_scatter_backward_args& args) {
  for (std::int64_t i = 0; i < args.src.rows; ++i) {
    const std::int32_t slot = id_at(args.slot, i);
    const float w = flat_at(args.weights, slot);
    const float* s = row_of(args.src, i);
    const float* d_y = row_of(args.d_dst, id_at(args.index, i));
    float* d_s = row_of(args.d_src, i);
    double dot = 0;
    for (std::int64_t j = 0; j < args.src.cols; ++j) {
      dot += static_cast<double>(s[j]) * d_y[j];
      d_s[j] = w * d_y[j];
    }
    flat_at(args.d_weights, slot) = static_cast<float>(dot);
  }
}

namespace {
double sigmoid(float z) { return 1.0 / (1.0 + std::exp(-static_cast<double>(z))); }
}  // namespace

void run(const sigmoid_gate_forward_args& args) {
  for (std::int64_t r = 0; r < args.s.rows; ++r) {
    const auto g = static_cast<float>(sigmoid(*row_of(args.z, r)));
    const float* s = row_of(args.s, r);
    float* y = row_of(args.y, r);
    for (std::int64_t j = 0; j < args.s.cols; ++j) y[j] += g * s[j];
  }
}

void run(const sigmoid_gate_backward_args& args) {
  for (std::int64_t r = 0; r < args.s.rows; ++r) {
    const double g = sigmoid(*row_of(args.z, r));
    const float* s = row_of(args.s, r);
    const float* d_y = row_of(args.d_y, r);
    float* d_s = row_of(args.d_s, r);
    double dot = 0;
    for (std::int64_t j = 0; j < args.s.cols; ++j) {
      dot += static_cast<double>(s[j]) * d_y[j];
      d_s[j] = static_cast<float>(g * d_y[j]);
    }
    *row_of(args.d_z, r) = static_cast<float>(g * (1.0 - g) * dot);
  }
}

}  // namespace upipe::cpu
