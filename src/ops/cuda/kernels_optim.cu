// The optimizer's kernels: one AdamW step on a flat f32 shard (ops/adamw_formula.hpp,
// the arithmetic of the cpu backend and the host optimizer; this file compiles with
// --fmad=false so that each product and sum rounds as on the host), writing the working
// copy from the stored master; and the fp64 sum of squares behind the gradient norm
// (block sums in fp64, added to the result with one atomic a block, so the last bits may
// vary from run to run).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "ops/adamw_formula.hpp"
#include "ops/cuda/cuda_ops.hpp"
#include "ops/cuda/kernels_common.cuh"

namespace upipe::cuda {

namespace {

using namespace kernels;

constexpr kernel_config adamw_config{.threads = 256, .blocks_per_sm = 8};
constexpr kernel_config sum_squares_config{.threads = 256, .blocks_per_sm = 8};
constexpr int vec_width = 4;  // floats per 16-byte access

struct adamw_params {
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  const float* grad;
  void* weights;  // the working copy, or nullptr
  std::int64_t n;
  bool vec;
  adamw_coefficients c;
};

// W: the working copy's type; void when there is none.
template <class W>
__global__ void __launch_bounds__(adamw_config.threads) adamw_kernel(adamw_params p) {
  for_each_matrix_chunk<vec_width>(1, p.n, p.vec, [&](std::int64_t, std::int64_t j, auto width) {
    constexpr int w = decltype(width)::value;
    float master[w], m[w], v[w], g[w];
    load_vec<w>(p.master + j, master);
    load_vec<w>(p.exp_avg + j, m);
    load_vec<w>(p.exp_avg_sq + j, v);
    load_vec<w>(p.grad + j, g);
#pragma unroll
    for (int e = 0; e < w; ++e) adamw_element(p.c, master[e], m[e], v[e], g[e]);
    store_vec<w>(p.master + j, master);
    store_vec<w>(p.exp_avg + j, m);
    store_vec<w>(p.exp_avg_sq + j, v);
    if constexpr (!std::is_void_v<W>) store_vec<w>(static_cast<W*>(p.weights) + j, master);
  });
}

__global__ void __launch_bounds__(sum_squares_config.threads)
    sum_squares_kernel(const float* x, std::int64_t rows, std::int64_t cols, std::int64_t ld, bool vec,
                       double* result) {
  __shared__ double scratch[32];
  double sum = 0.0;
  for_each_matrix_chunk<vec_width>(rows, cols, vec, [&](std::int64_t row, std::int64_t j, auto width) {
    constexpr int w = decltype(width)::value;
    float v[w];
    load_vec<w>(x + row * ld + j, v);
#pragma unroll
    for (int e = 0; e < w; ++e) sum = fma(static_cast<double>(v[e]), static_cast<double>(v[e]), sum);
  });
  sum = group_sum<sum_squares_config.threads, sum_squares_config.threads>(sum, scratch);
  if (threadIdx.x == 0) atomicAdd(result, sum);
}

}  // namespace

void run(const adamw_args& args, const context& ctx) {
  const cudaStream_t stream = ctx.stream;
  const std::int64_t n = args.master.cols;
  if (n == 0) return;
  const bool write_weights = args.weights.data != nullptr && args.weights.cols > 0;
  adamw_params params{static_cast<float*>(args.master.data),
                      static_cast<float*>(args.exp_avg.data),
                      static_cast<float*>(args.exp_avg_sq.data),
                      static_cast<const float*>(args.grad.data),
                      write_weights ? args.weights.data : nullptr,
                      n,
                      false,
                      adamw_coefficients_of(args)};
  params.vec = aligned16(params.master) && aligned16(params.exp_avg) && aligned16(params.exp_avg_sq) &&
               aligned16(params.grad) && (!write_weights || aligned16(params.weights));
  const int grid = grid_for_units(adamw_config, params.vec ? ceil_div(n, vec_width) : n);
  if (!write_weights)
    launch("adamw_kernel<no weights>", adamw_kernel<void>, grid, adamw_config, 0, stream, params);
  else if (args.weights.type == dtype::bf16)
    launch("adamw_kernel<bf16>", adamw_kernel<bf16>, grid, adamw_config, 0, stream, params);
  else
    launch("adamw_kernel<f32>", adamw_kernel<float>, grid, adamw_config, 0, stream, params);
}

void run(const sum_squares_args& args, const context& ctx) {
  const mat_view& x = args.x;
  *args.result = 0.0;
  if (x.rows == 0 || x.cols == 0) return;
  const cudaStream_t stream = ctx.stream;
  double* result = ctx.sum_result;
  UPIPE_CUDA_CHECK(cudaMemsetAsync(result, 0, sizeof(double), stream));
  const bool packed = x.rows <= 1 || x.ld == x.cols;
  const std::int64_t rows = packed ? 1 : x.rows, cols = packed ? x.rows * x.cols : x.cols;
  const bool vec = packed ? aligned16(x.data) : rows_aligned16(x.data, x.rows, x.ld, sizeof(float));
  const int grid = grid_for_units(sum_squares_config, rows * (vec ? ceil_div(cols, vec_width) : cols));
  launch("sum_squares_kernel", sum_squares_kernel, grid, sum_squares_config, 0, stream,
         static_cast<const float*>(x.data), rows, cols, x.ld, vec, result);
  UPIPE_CUDA_CHECK(cudaMemcpyAsync(args.result, result, sizeof(double), cudaMemcpyDeviceToHost, stream));
}

}  // namespace upipe::cuda
