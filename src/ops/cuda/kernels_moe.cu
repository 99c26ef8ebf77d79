// Mixture-of-experts kernels (ops/op_args.hpp), as ops/cpu/moe.cpp computes them but in
// fp32: the router's softmax and top-k (a thread per row: k passes over E, ties to the
// lower expert as torch.topk) and its backward; the gather and weighted scatter of a
// tile's rows (a warp per row, no two rows of one call to the same destination) and the
// scatter's backward; Qwen2-MoE's sigmoid gate. A first version: the grouped expert GEMMs
// are the cuBLASLt GEMMs of each expert's row block (model/moe_layer.cpp).
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/cuda_ops.hpp"
#include "ops/cuda/kernels_common.cuh"

namespace upipe::cuda {

namespace {

using namespace kernels;

constexpr kernel_config row_config{.threads = 256, .blocks_per_sm = 8};
constexpr int rows_per_block = row_config.threads / 32;  // a warp per row

__global__ void __launch_bounds__(row_config.threads)
    route_kernel(const float* logits, std::int64_t ld_z, float* probs, std::int64_t ld_p, float* weights,
                 std::int64_t ld_w, std::int32_t* experts, std::int64_t ld_x, std::int64_t n, std::int64_t E,
                 std::int64_t k, bool normalize) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= n) return;
  const float* z = logits + r * ld_z;
  float* p = probs + r * ld_p;
  float top = z[0];
  for (std::int64_t e = 1; e < E; ++e) top = fmaxf(top, z[e]);
  float sum = 0.0f;
  for (std::int64_t e = 0; e < E; ++e) sum += __expf(z[e] - top);
  for (std::int64_t e = 0; e < E; ++e) p[e] = __expf(z[e] - top) / sum;
  float chosen = 0.0f, last = 2.0f;
  std::int64_t last_index = -1;
  for (std::int64_t j = 0; j < k; ++j) {
    // The largest below the previous pick in (value desc, index asc) order.
    std::int64_t best = -1;
    for (std::int64_t e = 0; e < E; ++e) {
      const bool after = p[e] < last || (p[e] == last && e > last_index);
      if (after && (best < 0 || p[e] > p[best])) best = e;
    }
    experts[r * ld_x + j] = static_cast<std::int32_t>(best);
    weights[r * ld_w + j] = p[best];
    chosen += p[best];
    last = p[best];
    last_index = best;
  }
  if (normalize)
    for (std::int64_t j = 0; j < k; ++j) weights[r * ld_w + j] /= chosen;
}

__global__ void __launch_bounds__(row_config.threads)
    route_backward_kernel(const float* probs, std::int64_t ld_p, const std::int32_t* experts, std::int64_t ld_x,
                          const float* d_weights, std::int64_t ld_w, const float* aux, float* d_logits,
                          std::int64_t ld_z, std::int64_t n, std::int64_t E, std::int64_t k, bool normalize) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= n) return;
  const float* p = probs + r * ld_p;
  const std::int32_t* x = experts + r * ld_x;
  const float* d_w = d_weights + r * ld_w;
  float chosen = 0.0f, weighted = 0.0f;
  for (std::int64_t j = 0; j < k; ++j) chosen += p[x[j]];
  for (std::int64_t j = 0; j < k; ++j) weighted += d_w[j] * p[x[j]] / chosen;
  // d_p_e = aux_e + (the top-k's term where e is chosen); d_z_e = p_e (d_p_e - p . d_p).
  const auto d_p = [&](std::int64_t e) {
    float v = aux != nullptr ? aux[e] : 0.0f;
    for (std::int64_t j = 0; j < k; ++j)
      if (x[j] == e) v += normalize ? (d_w[j] - weighted) / chosen : d_w[j];
    return v;
  };
  float dot = 0.0f;
  for (std::int64_t e = 0; e < E; ++e) dot += p[e] * d_p(e);
  for (std::int64_t e = 0; e < E; ++e) d_logits[r * ld_z + e] = p[e] * (d_p(e) - dot);
}

template <class S, class T>
__global__ void __launch_bounds__(row_config.threads)
    gather_kernel(const S* src, std::int64_t ld_s, const std::int32_t* index, std::int64_t ld_i, T* dst,
                  std::int64_t ld_d, std::int64_t rows, std::int64_t cols) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / 32;
  if (i >= rows) return;
  const S* s = src + static_cast<std::int64_t>(index[i * ld_i]) * ld_s;
  for (std::int64_t j = threadIdx.x % 32; j < cols; j += 32) dst[i * ld_d + j] = from_float<T>(to_float(s[j]));
}

template <class S, class T>
__global__ void __launch_bounds__(row_config.threads)
    scatter_kernel(const S* src, std::int64_t ld_s, const std::int32_t* index, std::int64_t ld_i,
                   const std::int32_t* slot, std::int64_t ld_slot, const float* weights, T* dst, std::int64_t ld_d,
                   std::int64_t rows, std::int64_t cols) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / 32;
  if (i >= rows) return;
  const float w = weights != nullptr ? weights[slot[i * ld_slot]] : 1.0f;
  T* d = dst + static_cast<std::int64_t>(index[i * ld_i]) * ld_d;
  for (std::int64_t j = threadIdx.x % 32; j < cols; j += 32)
    d[j] = from_float<T>(to_float(d[j]) + w * to_float(src[i * ld_s + j]));
}

template <class G, class S, class D>
__global__ void __launch_bounds__(row_config.threads)
    scatter_backward_kernel(const G* d_dst, std::int64_t ld_g, const std::int32_t* index, std::int64_t ld_i,
                            const std::int32_t* slot, std::int64_t ld_slot, const float* weights, const S* src,
                            std::int64_t ld_s, D* d_src, std::int64_t ld_d, float* d_weights, std::int64_t rows,
                            std::int64_t cols) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / 32;
  if (i >= rows) return;
  const std::int32_t at = slot[i * ld_slot];
  const float w = weights[at];
  const G* g = d_dst + static_cast<std::int64_t>(index[i * ld_i]) * ld_g;
  float dot = 0.0f;
  for (std::int64_t j = threadIdx.x % 32; j < cols; j += 32) {
    const float gj = to_float(g[j]);
    dot += to_float(src[i * ld_s + j]) * gj;
    d_src[i * ld_d + j] = from_float<D>(w * gj);
  }
  dot = warp_reduce<sum_op>(dot);
  if (threadIdx.x % 32 == 0) d_weights[at] = dot;
}

template <class S, class Y>
__global__ void __launch_bounds__(row_config.threads)
    sigmoid_gate_kernel(const float* z, std::int64_t ld_z, const S* s, std::int64_t ld_s, Y* y, std::int64_t ld_y,
                        std::int64_t rows, std::int64_t cols) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / 32;
  if (r >= rows) return;
  const float g = 1.0f / (1.0f + __expf(-z[r * ld_z]));
  for (std::int64_t j = threadIdx.x % 32; j < cols; j += 32)
    y[r * ld_y + j] = from_float<Y>(to_float(y[r * ld_y + j]) + g * to_float(s[r * ld_s + j]));
}

template <class S, class G, class D>
__global__ void __launch_bounds__(row_config.threads)
    sigmoid_gate_backward_kernel(const float* z, std::int64_t ld_z, const S* s, std::int64_t ld_s, const G* d_y,
                                 std::int64_t ld_g, D* d_s, std::int64_t ld_d, float* d_z, std::int64_t ld_dz,
                                 std::int64_t rows, std::int64_t cols) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / 32;
  if (r >= rows) return;
  const float g = 1.0f / (1.0f + __expf(-z[r * ld_z]));
  float dot = 0.0f;
  for (std::int64_t j = threadIdx.x % 32; j < cols; j += 32) {
    const float gj = to_float(d_y[r * ld_g + j]);
    dot += to_float(s[r * ld_s + j]) * gj;
    d_s[r * ld_d + j] = from_float<D>(g * gj);
  }
  dot = warp_reduce<sum_op>(dot);
  if (threadIdx.x % 32 == 0) d_z[r * ld_dz] = g * (1.0f - g) * dot;
}

int row_grid(std::int64_t rows) { return static_cast<int>(ceil_div(rows, rows_per_block)); }
int thread_grid(std::int64_t rows) { return static_cast<int>(ceil_div(rows, row_config.threads)); }

}  // namespace

void run(const moe_route_args& a, const context& ctx) {
  if (a.logits.rows == 0) return;
  launch("moe_route_kernel", route_kernel, thread_grid(a.logits.rows), row_config, 0, ctx.stream,
         static_cast<const float*>(a.logits.data), a.logits.ld, static_cast<float*>(a.probs.data), a.probs.ld,
         static_cast<float*>(a.weights.data), a.weights.ld, static_cast<std::int32_t*>(a.experts.data), a.experts.ld,
         a.logits.rows, a.logits.cols, a.weights.cols, a.normalize);
}

void run(const moe_route_backward_args& a, const context& ctx) {
  if (a.probs.rows == 0) return;
  launch("moe_route_backward_kernel", route_backward_kernel, thread_grid(a.probs.rows), row_config, 0, ctx.stream,
         static_cast<const float*>(a.probs.data), a.probs.ld, static_cast<const std::int32_t*>(a.experts.data),
         a.experts.ld, static_cast<const float*>(a.d_weights.data), a.d_weights.ld,
         a.aux_grad.rows > 0 ? static_cast<const float*>(a.aux_grad.data) : nullptr,
         static_cast<float*>(a.d_logits.data), a.d_logits.ld, a.probs.rows, a.probs.cols, a.experts.cols, a.normalize);
}

void run(const moe_gather_args& a, const context& ctx) {
  if (a.dst.rows == 0) return;
  with_types(
      [&](auto s, auto t) {
        using S = typename decltype(s)::type;
        using T = typename decltype(t)::type;
        launch("moe_gather_kernel", gather_kernel<S, T>, row_grid(a.dst.rows), row_config, 0, ctx.stream,
               static_cast<const S*>(a.src.data), a.src.ld, static_cast<const std::int32_t*>(a.index.data), a.index.ld,
               static_cast<T*>(a.dst.data), a.dst.ld, a.dst.rows, a.dst.cols);
      },
      a.src.type, a.dst.type);
}

void run(const moe_scatter_args& a, const context& ctx) {
  if (a.src.rows == 0) return;
  const bool weighted = a.weights.rows > 0;
  with_types(
      [&](auto s, auto t) {
        using S = typename decltype(s)::type;
        using T = typename decltype(t)::type;
        launch("moe_scatter_kernel", scatter_kernel<S, T>, row_grid(a.src.rows), row_config, 0, ctx.stream,
               static_cast<const S*>(a.src.data), a.src.ld, static_cast<const std::int32_t*>(a.index.data), a.index.ld,
               weighted ? static_cast<const std::int32_t*>(a.slot.data) : nullptr, weighted ? a.slot.ld : 0,
               weighted ? static_cast<const float*>(a.weights.data) : nullptr, static_cast<T*>(a.dst.data), a.dst.ld,
               a.src.rows, a.src.cols);
      },
      a.src.type, a.dst.type);
}

void run(const moe_scatter_backward_args& a, const context& ctx) {
  if (a.src.rows == 0) return;
  with_types(
      [&](auto g, auto s, auto d) {
        using G = typename decltype(g)::type;
        using S = typename decltype(s)::type;
        using D = typename decltype(d)::type;
        launch("moe_scatter_backward_kernel", scatter_backward_kernel<G, S, D>, row_grid(a.src.rows), row_config, 0,
               ctx.stream, static_cast<const G*>(a.d_dst.data), a.d_dst.ld,
               static_cast<const std::int32_t*>(a.index.data), a.index.ld,
               static_cast<const std::int32_t*>(a.slot.data), a.slot.ld, static_cast<const float*>(a.weights.data),
               static_cast<const S*>(a.src.data), a.src.ld, static_cast<D*>(a.d_src.data), a.d_src.ld,
               static_cast<float*>(a.d_weights.data), a.src.rows, a.src.cols);
      },
      a.d_dst.type, a.src.type, a.d_src.type);
}

void run(const sigmoid_gate_forward_args& a, const context& ctx) {
  if (a.s.rows == 0) return;
  with_types(
      [&](auto s, auto y) {
        using S = typename decltype(s)::type;
        using Y = typename decltype(y)::type;
        launch("sigmoid_gate_kernel", sigmoid_gate_kernel<S, Y>, row_grid(a.s.rows), row_config, 0, ctx.stream,
               static_cast<const float*>(a.z.data), a.z.ld, static_cast<const S*>(a.s.data), a.s.ld,
               static_cast<Y*>(a.y.data), a.y.ld, a.s.rows, a.s.cols);
      },
      a.s.type, a.y.type);
}

void run(const sigmoid_gate_backward_args& a, const context& ctx) {
  if (a.s.rows == 0) return;
  with_types(
      [&](auto s, auto g, auto d) {
        using S = typename decltype(s)::type;
        using G = typename decltype(g)::type;
        using D = typename decltype(d)::type;
        launch("sigmoid_gate_backward_kernel", sigmoid_gate_backward_kernel<S, G, D>, row_grid(a.s.rows), row_config,
               0, ctx.stream, static_cast<const float*>(a.z.data), a.z.ld, static_cast<const S*>(a.s.data), a.s.ld,
               static_cast<const G*>(a.d_y.data), a.d_y.ld, static_cast<D*>(a.d_s.data), a.d_s.ld,
               static_cast<float*>(a.d_z.data), a.d_z.ld, a.s.rows, a.s.cols);
      },
      a.s.type, a.d_y.type, a.d_s.type);
}

}  // namespace upipe::cuda
