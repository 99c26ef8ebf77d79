// Elementwise kernels: the gated linear units (SwiGLU, GeGLU) forward and backward on bf16
// (n, F) matrices (d_out bf16 or f32), as ops/cpu/swiglu.cpp but in fp32, the fp32 add of the communicators, and the
// GEMM's launcher (cuBLASLt, or a scale of c where k == 0).
// Grid-stride over 16-byte chunks when every row is 16-byte aligned, element by element
// otherwise; matrices without row padding are walked as one long row.
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "ops/cuda/cuda_ops.hpp"
#include "ops/cuda/kernels_common.cuh"

namespace upipe::cuda {

namespace {

using namespace kernels;

constexpr kernel_config elementwise_config{.threads = 256, .blocks_per_sm = 8};
constexpr int vec_width = 8;  // elements per chunk: 16 bytes of bf16

// A matrix operand: base pointer and leading dimension.
struct operand {
  void* data;
  std::int64_t ld;
};

struct swiglu_params {
  std::int64_t rows, cols;
  operand gate, up, d_out, out_or_d_gate, d_up;  // forward uses gate, up, out_or_d_gate
  bool vec;
};

// exp of a non-positive argument only, as the reference does.
__device__ __forceinline__ float sigmoid(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
  const float e = expf(x);
  return e / (1.0f + e);
}

constexpr float gelu_k = 0.7978845608f;  // sqrt(2 / pi)
constexpr float gelu_c = 0.044715f;

// act(g) and, with Slope, act'(g): silu, GELU's tanh approximation, or sigmoid.
template <gate_activation Act>
__device__ __forceinline__ float activation(float g, float* slope) {
  if constexpr (Act == gate_activation::silu) {
    const float s = sigmoid(g);
    if (slope != nullptr) *slope = s * (1.0f + g * (1.0f - s));
    return g * s;
  } else if constexpr (Act == gate_activation::sigmoid) {
    const float s = sigmoid(g);
    if (slope != nullptr) *slope = s * (1.0f - s);
    return s;
  } else {
    const float t = tanhf(gelu_k * (g + gelu_c * g * g * g));
    if (slope != nullptr)
      *slope = 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * gelu_k * (1.0f + 3.0f * gelu_c * g * g);
    return 0.5f * g * (1.0f + t);
  }
}

template <class T>
__device__ __forceinline__ T* row_of(const operand& m, std::int64_t row) {
  return static_cast<T*>(m.data) + row * m.ld;
}

template <gate_activation Act>
__global__ void __launch_bounds__(elementwise_config.threads) swiglu_forward_kernel(swiglu_params p) {
  for_each_matrix_chunk<vec_width>(p.rows, p.cols, p.vec, [&](std::int64_t row, std::int64_t j, auto width) {
    constexpr int w = decltype(width)::value;
    float g[w], u[w];
    load_vec<w>(row_of<const bf16>(p.gate, row) + j, g);
    load_vec<w>(row_of<const bf16>(p.up, row) + j, u);
#pragma unroll
    for (int e = 0; e < w; ++e) g[e] = activation<Act>(g[e], nullptr) * u[e];
    store_vec<w>(row_of<bf16>(p.out_or_d_gate, row) + j, g);
  });
}

// d_gate = d_out * up * act'(gate); d_up = d_out * act(gate).
// d_gate and d_up may be gate and up: a thread loads its chunk before storing it.
template <class DOut, gate_activation Act>
__global__ void __launch_bounds__(elementwise_config.threads) swiglu_backward_kernel(swiglu_params p) {
  for_each_matrix_chunk<vec_width>(p.rows, p.cols, p.vec, [&](std::int64_t row, std::int64_t j, auto width) {
    constexpr int w = decltype(width)::value;
    float g[w], u[w], d[w];
    load_vec<w>(row_of<const bf16>(p.gate, row) + j, g);
    load_vec<w>(row_of<const bf16>(p.up, row) + j, u);
    load_vec<w>(row_of<const DOut>(p.d_out, row) + j, d);
#pragma unroll
    for (int e = 0; e < w; ++e) {
      float slope = 0.0f;
      const float act = activation<Act>(g[e], &slope);
      const float d_gate = d[e] * u[e] * slope;
      u[e] = d[e] * act;
      g[e] = d_gate;
    }
    store_vec<w>(row_of<bf16>(p.out_or_d_gate, row) + j, g);
    store_vec<w>(row_of<bf16>(p.d_up, row) + j, u);
  });
}

__global__ void __launch_bounds__(elementwise_config.threads)
    add_f32_kernel(float* dst, const float* src, std::int64_t count, bool vec) {
  for_each_matrix_chunk<4>(1, count, vec, [&](std::int64_t, std::int64_t j, auto width) {
    constexpr int w = decltype(width)::value;
    float a[w], b[w];
    load_vec<w>(dst + j, a);
    load_vec<w>(src + j, b);
#pragma unroll
    for (int e = 0; e < w; ++e) a[e] += b[e];
    store_vec<w>(dst + j, a);
  });
}

// The (rows, cols) walk of same-shaped matrices: one long row when none has padding,
// chunked when every row of every operand is 16-byte aligned.
struct matrix_walk {
  std::int64_t rows, cols;
  bool vec;
};

matrix_walk walk_of(std::initializer_list<mat_view> views) {
  const mat_view& first = *views.begin();
  bool packed = true, bases_aligned = true, rows_aligned = true;
  for (const mat_view& m : views) {
    packed = packed && (m.rows <= 1 || m.ld == m.cols);
    bases_aligned = bases_aligned && aligned16(m.data);
    rows_aligned = rows_aligned && rows_aligned16(m.data, m.rows, m.ld, dtype_size(m.type));
  }
  if (packed) return {1, first.rows * first.cols, bases_aligned};
  return {first.rows, first.cols, rows_aligned};
}

operand operand_of(const mat_view& m) { return {m.data, m.ld}; }

// c = beta * c over a strided matrix; beta == 0 writes zeros without reading c (a GEMM
// with k == 0, which cuBLASLt does not take).
template <class T>
__global__ void scale_matrix_kernel(T* c, std::int64_t rows, std::int64_t cols, std::int64_t ld, float beta) {
  const std::int64_t n = rows * cols;
  const std::int64_t stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n; idx += stride) {
    const std::int64_t at = idx / cols * ld + idx % cols;
    c[at] = from_float<T>(beta == 0.0f ? 0.0f : beta * to_float(c[at]));
  }
}

}  // namespace

void run(const gemm_args& args, const context& ctx) {
  const mat_view& c = args.c;
  if (c.rows == 0 || c.cols == 0) return;
  const std::int64_t k = args.trans_a == transpose::yes ? args.a.rows : args.a.cols;
  if (k > 0) {
    ctx.gemm->run(args);
    return;
  }
  if (args.beta == 1.0f) return;
  with_types(
      [&](auto t) {
        using T = typename decltype(t)::type;
        launch("scale_matrix_kernel", scale_matrix_kernel<T>, grid_for_units(elementwise_config, c.rows * c.cols),
               elementwise_config, 0, ctx.stream, static_cast<T*>(c.data), c.rows, c.cols, c.ld, args.beta);
      },
      c.type);
}

void run(const swiglu_forward_args& args, const context& ctx) {
  const cudaStream_t stream = ctx.stream;
  const matrix_walk walk = walk_of({args.gate, args.up, args.out});
  if (walk.rows * walk.cols == 0) return;
  const swiglu_params params{walk.rows,           walk.cols, operand_of(args.gate), operand_of(args.up), {nullptr, 0},
                             operand_of(args.out), {nullptr, 0}, walk.vec};
  const std::int64_t units = walk.rows * (walk.vec ? ceil_div(walk.cols, vec_width) : walk.cols);
  const int grid = grid_for_units(elementwise_config, units);
  if (args.activation == gate_activation::silu)
    launch("swiglu_forward_kernel<silu>", swiglu_forward_kernel<gate_activation::silu>, grid, elementwise_config, 0,
           stream, params);
  else if (args.activation == gate_activation::sigmoid)
    launch("swiglu_forward_kernel<sigmoid>", swiglu_forward_kernel<gate_activation::sigmoid>, grid,
           elementwise_config, 0, stream, params);
  else
    launch("swiglu_forward_kernel<gelu_tanh>", swiglu_forward_kernel<gate_activation::gelu_tanh>, grid,
           elementwise_config, 0, stream, params);
}

void run(const swiglu_backward_args& args, const context& ctx) {
  const cudaStream_t stream = ctx.stream;
  const matrix_walk walk = walk_of({args.gate, args.up, args.d_out, args.d_gate, args.d_up});
  if (walk.rows * walk.cols == 0) return;
  const swiglu_params params{walk.rows,
                             walk.cols,
                             operand_of(args.gate),
                             operand_of(args.up),
                             operand_of(args.d_out),
                             operand_of(args.d_gate),
                             operand_of(args.d_up),
                             walk.vec};
  const std::int64_t units = walk.rows * (walk.vec ? ceil_div(walk.cols, vec_width) : walk.cols);
  const int grid = grid_for_units(elementwise_config, units);
  const bool silu = args.activation == gate_activation::silu;
  if (args.activation == gate_activation::sigmoid) {
    if (args.d_out.type == dtype::bf16)
      launch("swiglu_backward_kernel<bf16, sigmoid>", swiglu_backward_kernel<bf16, gate_activation::sigmoid>, grid,
             elementwise_config, 0, stream, params);
    else
      launch("swiglu_backward_kernel<f32, sigmoid>", swiglu_backward_kernel<float, gate_activation::sigmoid>, grid,
             elementwise_config, 0, stream, params);
    return;
  }
  if (args.d_out.type == dtype::bf16 && silu)
    launch("swiglu_backward_kernel<bf16, silu>", swiglu_backward_kernel<bf16, gate_activation::silu>, grid,
           elementwise_config, 0, stream, params);
  else if (args.d_out.type == dtype::bf16)
    launch("swiglu_backward_kernel<bf16, gelu_tanh>", swiglu_backward_kernel<bf16, gate_activation::gelu_tanh>, grid,
           elementwise_config, 0, stream, params);
  else if (silu)
    launch("swiglu_backward_kernel<f32, silu>", swiglu_backward_kernel<float, gate_activation::silu>, grid,
           elementwise_config, 0, stream, params);
  else
    launch("swiglu_backward_kernel<f32, gelu_tanh>", swiglu_backward_kernel<float, gate_activation::gelu_tanh>, grid,
           elementwise_config, 0, stream, params);
}

void add_f32(float* dst, const float* src, std::size_t count, cudaStream_t stream) {
  if (count == 0) return;
  const auto n = static_cast<std::int64_t>(count);
  const bool vec = aligned16(dst) && aligned16(src);
  const std::int64_t units = vec ? ceil_div(n, 4) : n;
  launch("add_f32_kernel", add_f32_kernel, grid_for_units(elementwise_config, units), elementwise_config, 0, stream,
         dst, src, n, vec);
}

}  // namespace upipe::cuda
