// RMSNorm forward and backward (the Hugging Face Llama convention, or Gemma's 1 + weight
// with weight_offset 1, as ops/cpu/rmsnorm.cpp):
// a warp per row for short rows (per-head norms), a block per row otherwise; fp32 sums;
// x, weight, y, d_y and d_x each bf16 or f32. The backward accumulates d_weight per block
// in shared memory and adds it to the f32 d_weight with one atomic per column and block.
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/cuda_ops.hpp"
#include "ops/cuda/kernels_common.cuh"

namespace upipe::cuda {

namespace {

using namespace kernels;

constexpr kernel_config norm_config{.threads = 256, .blocks_per_sm = 8};
// Rows up to this many columns take a warp each; longer rows a whole block.
constexpr std::int64_t warp_row_max_cols = 1024;
// The backward's blocks each take at least this many rows before their d_weight flush.
constexpr std::int64_t backward_min_rows_per_group = 8;
constexpr int vec_width = 8;  // elements per vector access: 16 bytes of bf16

struct rmsnorm_forward_params {
  const void* x;       // (rows, cols), ld_x
  const void* weight;  // (cols)
  void* y;             // (rows, cols), ld_y; may be x
  float* rstd;         // (rows), ld_rstd
  std::int64_t rows, cols, ld_x, ld_y, ld_rstd;
  float eps;
  float weight_offset;  // the scale is weight_offset + weight
};

struct rmsnorm_backward_params {
  const void* x;       // (rows, cols), ld_x
  const void* weight;  // (cols)
  const float* rstd;   // (rows), ld_rstd
  const void* d_y;     // (rows, cols), ld_d_y
  void* d_x;           // (rows, cols), ld_d_x; may be d_y
  float* d_weight;     // (cols) f32, accumulated
  std::int64_t rows, cols, ld_x, ld_rstd, ld_d_y, ld_d_x;
  bool shared_accumulator;  // d_weight partials in dynamic shared memory (cols floats)
  float weight_offset;      // the scale is weight_offset + weight
};

template <class X, class W, class Y, int Group>
__global__ void __launch_bounds__(norm_config.threads) rmsnorm_forward_kernel(rmsnorm_forward_params p) {
  __shared__ float scratch[32];
  const int lane = static_cast<int>(threadIdx.x) % Group;
  const auto* weight = static_cast<const W*>(p.weight);
  for_each_row(p.rows, Group, [&](std::int64_t row, bool active) {
    const std::int64_t n = active ? p.cols : 0;
    const X* x = static_cast<const X*>(p.x) + (active ? row : 0) * p.ld_x;
    Y* y = static_cast<Y*>(p.y) + (active ? row : 0) * p.ld_y;
    const bool vec = is_aligned16(x) && is_aligned16(y) && is_aligned16(weight);
    float sum_sq = 0.0f;
    for_each_chunk<vec_width>(n, vec, lane, Group, [&](std::int64_t j, auto width) {
      constexpr int w = decltype(width)::value;
      float v[w];
      load_vec<w>(x + j, v);
#pragma unroll
      for (int e = 0; e < w; ++e) sum_sq = fmaf(v[e], v[e], sum_sq);
    });
    sum_sq = group_sum<Group, norm_config.threads>(sum_sq, scratch);
    const double mean_sq = p.cols > 0 ? static_cast<double>(sum_sq) / static_cast<double>(p.cols) : 0.0;
    const auto rstd = static_cast<float>(1.0 / sqrt(mean_sq + static_cast<double>(p.eps)));
    if (active && lane == 0) p.rstd[row * p.ld_rstd] = rstd;
    // In place (y == x) each thread rereads exactly the elements it then overwrites.
    for_each_chunk<vec_width>(n, vec, lane, Group, [&](std::int64_t j, auto width) {
      constexpr int w = decltype(width)::value;
      float v[w], g[w];
      load_vec<w>(x + j, v);
      load_vec<w>(weight + j, g);
#pragma unroll
      for (int e = 0; e < w; ++e) v[e] = v[e] * rstd * (p.weight_offset + g[e]);
      store_vec<w>(y + j, v);
    });
  });
}

// A block per row with the row kept in registers between the sum of squares and the
// scaling, so x is read from memory once: for rows of at most threads x 8 x Chunks
// elements whose rows and weight are 16-byte aligned and whose length is a multiple of 8.
template <class X, class W, class Y, int Chunks>
__global__ void __launch_bounds__(norm_config.threads) rmsnorm_forward_cached_kernel(rmsnorm_forward_params p) {
  __shared__ float scratch[32];
  constexpr int threads = norm_config.threads;
  const auto* weight = static_cast<const W*>(p.weight);
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const X* x = static_cast<const X*>(p.x) + row * p.ld_x;
    Y* y = static_cast<Y*>(p.y) + row * p.ld_y;
    float v[Chunks][vec_width];
    float sum_sq = 0.0f;
#pragma unroll
    for (int c = 0; c < Chunks; ++c) {
      const std::int64_t j = (static_cast<std::int64_t>(c) * threads + threadIdx.x) * vec_width;
      if (j < p.cols) {
        load_vec<vec_width>(x + j, v[c]);
#pragma unroll
        for (int e = 0; e < vec_width; ++e) sum_sq = fmaf(v[c][e], v[c][e], sum_sq);
      }
    }
    sum_sq = group_sum<threads, threads>(sum_sq, scratch);
    const double mean_sq = static_cast<double>(sum_sq) / static_cast<double>(p.cols);
    const auto rstd = static_cast<float>(1.0 / sqrt(mean_sq + static_cast<double>(p.eps)));
    if (threadIdx.x == 0) p.rstd[row * p.ld_rstd] = rstd;
#pragma unroll
    for (int c = 0; c < Chunks; ++c) {
      const std::int64_t j = (static_cast<std::int64_t>(c) * threads + threadIdx.x) * vec_width;
      if (j < p.cols) {
        float g[vec_width];
        load_vec<vec_width>(weight + j, g);
#pragma unroll
        for (int e = 0; e < vec_width; ++e) v[c][e] = v[c][e] * rstd * (p.weight_offset + g[e]);
        store_vec<vec_width>(y + j, v[c]);
      }
    }
  }
}

template <class X, class W, class DY, class DX, int Group>
__global__ void __launch_bounds__(norm_config.threads) rmsnorm_backward_kernel(rmsnorm_backward_params p) {
  extern __shared__ float d_weight_partial[];  // (cols) when p.shared_accumulator
  __shared__ float scratch[32];
  const int lane = static_cast<int>(threadIdx.x) % Group;
  const auto* weight = static_cast<const W*>(p.weight);
  if (p.shared_accumulator) {
    for (std::int64_t j = threadIdx.x; j < p.cols; j += blockDim.x) d_weight_partial[j] = 0.0f;
    __syncthreads();
  }
  const float inv_cols = p.cols > 0 ? 1.0f / static_cast<float>(p.cols) : 0.0f;
  for_each_row(p.rows, Group, [&](std::int64_t row, bool active) {
    const std::int64_t n = active ? p.cols : 0;
    const std::int64_t r = active ? row : 0;
    const X* x = static_cast<const X*>(p.x) + r * p.ld_x;
    const DY* d_y = static_cast<const DY*>(p.d_y) + r * p.ld_d_y;
    DX* d_x = static_cast<DX*>(p.d_x) + r * p.ld_d_x;
    const float rstd = active ? p.rstd[r * p.ld_rstd] : 0.0f;
    const bool vec = is_aligned16(x) && is_aligned16(d_y) && is_aligned16(d_x) && is_aligned16(weight);
    float g_dot_x = 0.0f;
    for_each_chunk<vec_width>(n, vec, lane, Group, [&](std::int64_t j, auto width) {
      constexpr int w = decltype(width)::value;
      float xv[w], dy[w], g[w];
      load_vec<w>(x + j, xv);
      load_vec<w>(d_y + j, dy);
      load_vec<w>(weight + j, g);
#pragma unroll
      for (int e = 0; e < w; ++e) g_dot_x = fmaf(dy[e] * (p.weight_offset + g[e]), xv[e], g_dot_x);
    });
    g_dot_x = group_sum<Group, norm_config.threads>(g_dot_x, scratch);
    const float correction = rstd * rstd * g_dot_x * inv_cols;
    // In place (d_x == d_y) each thread rereads exactly the elements it then overwrites.
    for_each_chunk<vec_width>(n, vec, lane, Group, [&](std::int64_t j, auto width) {
      constexpr int w = decltype(width)::value;
      float xv[w], dy[w], g[w];
      load_vec<w>(x + j, xv);
      load_vec<w>(d_y + j, dy);
      load_vec<w>(weight + j, g);
#pragma unroll
      for (int e = 0; e < w; ++e) {
        const float contribution = dy[e] * xv[e] * rstd;
        if (!p.shared_accumulator) {
          if (p.d_weight != nullptr) atomicAdd(p.d_weight + j + e, contribution);  // nullptr: a frozen weight's
        } else if constexpr (Group == norm_config.threads) {
          d_weight_partial[j + e] += contribution;  // one row at a time: the column is this thread's
        } else {
          atomicAdd(d_weight_partial + j + e, contribution);  // warps on different rows share it
        }
        dy[e] = rstd * (dy[e] * (p.weight_offset + g[e]) - xv[e] * correction);
      }
      store_vec<w>(d_x + j, dy);
    });
  });
  if (p.shared_accumulator) {
    __syncthreads();
    for (std::int64_t j = threadIdx.x; j < p.cols; j += blockDim.x) atomicAdd(p.d_weight + j, d_weight_partial[j]);
  }
}

bool use_warp_rows(std::int64_t cols) { return cols <= warp_row_max_cols; }

int max_dynamic_shared_bytes() {
  int device = 0, bytes = 0;
  UPIPE_CUDA_CHECK(cudaGetDevice(&device));
  UPIPE_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  constexpr int static_bytes = 32 * 4;  // the reduction scratch
  return bytes - static_bytes;
}

}  // namespace

void run(const rmsnorm_forward_args& args, const context& ctx) {
  const cudaStream_t stream = ctx.stream;
  const std::int64_t rows = args.x.rows, cols = args.x.cols;
  if (rows == 0) return;
  const rmsnorm_forward_params params{args.x.data, args.weight.data, args.y.data, static_cast<float*>(args.rstd.data),
                                      rows, cols, args.x.ld, args.y.ld, args.rstd.ld, args.eps, args.weight_offset};
  const bool warp_rows = use_warp_rows(cols);
  const int rows_per_block = warp_rows ? norm_config.threads / 32 : 1;
  const int grid = grid_size(norm_config, ceil_div(rows, rows_per_block));
  // Every row start 16-byte aligned: the base pointers and the leading dimensions.
  const auto aligned = [](const void* ptr, std::int64_t ld, dtype type) {
    return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0 && (ld * static_cast<std::int64_t>(dtype_size(type))) % 16 == 0;
  };
  const bool cached = cols % vec_width == 0 && cols <= norm_config.threads * vec_width * 4 &&
                      aligned(args.x.data, args.x.ld, args.x.type) && aligned(args.y.data, args.y.ld, args.y.type) &&
                      aligned(args.weight.data, 0, args.weight.type);
  with_types(
      [&](auto x, auto w, auto y) {
        using X = typename decltype(x)::type;
        using W = typename decltype(w)::type;
        using Y = typename decltype(y)::type;
        if (warp_rows)
          launch("rmsnorm_forward_kernel<warp>", rmsnorm_forward_kernel<X, W, Y, 32>, grid, norm_config, 0, stream,
                 params);
        else if (cached && cols <= norm_config.threads * vec_width * 2)
          launch("rmsnorm_forward_cached_kernel<2>", rmsnorm_forward_cached_kernel<X, W, Y, 2>, grid, norm_config, 0,
                 stream, params);
        else if (cached)
          launch("rmsnorm_forward_cached_kernel<4>", rmsnorm_forward_cached_kernel<X, W, Y, 4>, grid, norm_config, 0,
                 stream, params);
        else
          launch("rmsnorm_forward_kernel<block>", rmsnorm_forward_kernel<X, W, Y, norm_config.threads>, grid,
                 norm_config, 0, stream, params);
      },
      args.x.type, args.weight.type, args.y.type);
}

void run(const rmsnorm_backward_args& args, const context& ctx) {
  const cudaStream_t stream = ctx.stream;
  const std::int64_t rows = args.x.rows, cols = args.x.cols;
  if (rows == 0 || cols == 0) return;
  const auto shared_bytes = static_cast<std::size_t>(cols) * sizeof(float);
  const bool wanted = args.d_weight.rows > 0;  // else a frozen weight's: not computed
  const bool shared_accumulator = wanted && shared_bytes <= static_cast<std::size_t>(max_dynamic_shared_bytes());
  const rmsnorm_backward_params params{args.x.data,
                                       args.weight.data,
                                       static_cast<const float*>(args.rstd.data),
                                       args.d_y.data,
                                       args.d_x.data,
                                       wanted ? static_cast<float*>(args.d_weight.data) : nullptr,
                                       rows,
                                       cols,
                                       args.x.ld,
                                       args.rstd.ld,
                                       args.d_y.ld,
                                       args.d_x.ld,
                                       shared_accumulator,
                                       args.weight_offset};
  const bool warp_rows = use_warp_rows(cols);
  const int rows_per_block = warp_rows ? norm_config.threads / 32 : 1;
  const int grid = grid_size(norm_config, ceil_div(rows, rows_per_block * backward_min_rows_per_group));
  const std::size_t dynamic_bytes = shared_accumulator ? shared_bytes : 0;
  with_types(
      [&](auto x, auto w, auto dy, auto dx) {
        using X = typename decltype(x)::type;
        using W = typename decltype(w)::type;
        using DY = typename decltype(dy)::type;
        using DX = typename decltype(dx)::type;
        if (warp_rows)
          launch("rmsnorm_backward_kernel<warp>", rmsnorm_backward_kernel<X, W, DY, DX, 32>, grid, norm_config,
                 dynamic_bytes, stream, params);
        else
          launch("rmsnorm_backward_kernel<block>", rmsnorm_backward_kernel<X, W, DY, DX, norm_config.threads>, grid,
                 norm_config, dynamic_bytes, stream, params);
      },
      args.x.type, args.weight.type, args.d_y.type, args.d_x.type);
}

}  // namespace upipe::cuda
