// Reference mixture-of-experts ops (ops/op_args.hpp): the router's softmax and top-k with
// their backward, the dispatch (counts, offsets, positions, capacity), the permute and the
// weighted combine of a tile's rows in the experts' order, the load-balancing statistics,
// the grouped expert GEMMs and Qwen2-MoE's sigmoid gate's backward. fp32, dot products in
// fp64.
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
double sigmoid(float z) { return 1.0 / (1.0 + std::exp(-static_cast<double>(z))); }

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
    std::int32_t* x = ids_of(args.experts, r);
    if (!args.given) {
      std::iota(order.begin(), order.end(), 0);
      // Descending, the lower expert first among equals.
      std::stable_sort(order.begin(), order.end(), [p](std::int32_t a, std::int32_t b) { return p[a] > p[b]; });
      for (std::int64_t j = 0; j < k; ++j) x[j] = order[static_cast<std::size_t>(j)];
    }
    float* w = row_of(args.weights, r);
    float chosen = 0.0f;  // in fp32, as torch sums the k values
    for (std::int64_t j = 0; j < k; ++j) {
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
    const bool counted = args.counted.rows == 0 || *(static_cast<const std::uint8_t*>(args.counted.data) + r * args.counted.ld) != 0;
    for (std::int64_t e = 0; e < E; ++e) d_p[static_cast<std::size_t>(e)] = aux != nullptr && counted ? aux[e] : 0.0;
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

// Counting in token order: expert e's tokens take its rows in order until its capacity is
// spent (the GPU's chunked scan keeps the same order). The scratch is the device's alone.
void run(const moe_dispatch_args& args) {
  const std::int64_t n = args.experts.rows, k = args.experts.cols, E = args.offsets.cols - 1;
  std::vector<std::int64_t> seen(static_cast<std::size_t>(E), 0);
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t j = 0; j < k; ++j) ++seen[static_cast<std::size_t>(ids_of(args.experts, t)[j])];
  std::int32_t* offsets = ids_of(args.offsets, 0);
  offsets[0] = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t count = seen[static_cast<std::size_t>(e)];
    const std::int64_t kept = args.capacity > 0 ? std::min(count, args.capacity) : count;
    offsets[e + 1] = static_cast<std::int32_t>(offsets[e] + kept);
  }
  std::fill(seen.begin(), seen.end(), 0);
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t e = ids_of(args.experts, t)[j];
      const std::int64_t rank = seen[static_cast<std::size_t>(e)]++;
      const bool kept = args.capacity == 0 || rank < args.capacity;
      ids_of(args.position, t)[j] = kept ? static_cast<std::int32_t>(offsets[e] + rank) : -1;
    }
}

void run(const moe_permute_args& args) {
  const std::int64_t n = args.position.rows, k = args.position.cols;
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t at = ids_of(args.position, t)[j];
      if (at >= 0) std::copy_n(row_of(args.src, t), args.src.cols, row_of(args.dst, at));
    }
}

void run(const moe_combine_args& args) {
  const std::int64_t n = args.position.rows, k = args.position.cols, D = args.dst.cols;
  std::vector<float> sum(static_cast<std::size_t>(D));
  for (std::int64_t t = 0; t < n; ++t) {
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t at = ids_of(args.position, t)[j];
      if (at < 0) continue;
      const float w = args.weights.rows > 0 ? row_of(args.weights, t)[j] : 1.0f;
      const float* s = row_of(args.src, at);
      for (std::int64_t c = 0; c < D; ++c) sum[static_cast<std::size_t>(c)] += w * s[c];
    }
    if (args.shared.rows > 0) {
      const auto g = static_cast<float>(sigmoid(*row_of(args.shared_gate, t)));
      const float* s = row_of(args.shared, t);
      for (std::int64_t c = 0; c < D; ++c) sum[static_cast<std::size_t>(c)] += g * s[c];
    }
    float* d = row_of(args.dst, t);
    for (std::int64_t c = 0; c < D; ++c) d[c] += sum[static_cast<std::size_t>(c)];
  }
}

void run(const moe_combine_backward_args& args) {
  const std::int64_t n = args.position.rows, k = args.position.cols, D = args.d_dst.cols;
  for (std::int64_t t = 0; t < n; ++t) {
    const float* d_y = row_of(args.d_dst, t);
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t at = ids_of(args.position, t)[j];
      float& d_w = row_of(args.d_weights, t)[j];
      if (at < 0) {
        d_w = 0.0f;
        continue;
      }
      const float w = row_of(args.weights, t)[j];
      const float* s = row_of(args.src, at);
      float* d_s = row_of(args.d_src, at);
      double dot = 0;
      for (std::int64_t c = 0; c < D; ++c) {
        dot += static_cast<double>(s[c]) * d_y[c];
        d_s[c] = w * d_y[c];
      }
      d_w = static_cast<float>(dot);
    }
  }
}

void run(const moe_balance_args& args) {
  const std::int64_t n = args.probs.rows, E = args.probs.cols, k = args.experts.cols;
  auto* counts = static_cast<std::uint64_t*>(args.sums.data);
  auto* prob_sums = reinterpret_cast<double*>(counts + E);
  for (std::int64_t t = 0; t < n; ++t) {
    if (args.counted.rows > 0 && *(static_cast<const std::uint8_t*>(args.counted.data) + t * args.counted.ld) == 0) continue;
    const float* p = row_of(args.probs, t);
    for (std::int64_t e = 0; e < E; ++e) prob_sums[e] += p[e];
    for (std::int64_t j = 0; j < k; ++j) ++counts[ids_of(args.experts, t)[j]];
  }
}

// Each group's GEMM by the reference GEMM, on its block of rows.
void run(const moe_grouped_gemm_args& args) {
  const std::int32_t* offsets = ids_of(args.offsets, 0);
  for (std::size_t g = 0; g < args.weights.size(); ++g) {
    const std::int64_t first = offsets[g], count = offsets[g + 1] - first;
    if (count == 0) continue;
    const mat_view rows = args.rows.row_block(first, count);
    switch (args.form) {
      case grouped_form::rows_by_weight_t:
        run(gemm_args{rows, transpose::none, args.weights[g], transpose::yes, args.out.row_block(first, count),
                      args.alpha, args.beta});
        break;
      case grouped_form::rows_by_weight:
        run(gemm_args{rows, transpose::none, args.weights[g], transpose::none, args.out.row_block(first, count),
                      args.alpha, args.beta});
        break;
      case grouped_form::weight_gradient:
        run(gemm_args{rows, transpose::yes, args.other.row_block(first, count), transpose::none, args.weights[g],
                      args.alpha, args.beta});
        break;
    }
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
