// A projection's bias: added to every row of y (bf16 or f32) and, in backward, the column
// sums of d_y (bf16 or f32) added to the f32 d_bias, as ops/cpu/bias.cpp but in fp32.
// The gradient's grid is columns of 32 times row ranges, each block summing its range in
// registers and shared memory and adding one partial per column (an atomic, so the last
// bits of d_bias vary with the order of the blocks, as RMSNorm's d_weight does).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ops/cuda/cuda_ops.hpp"
#include "ops/cuda/kernels_common.cuh"

namespace upipe::cuda {

namespace {

using namespace kernels;

constexpr kernel_config bias_config{.threads = 256, .blocks_per_sm = 8};
constexpr int grad_columns = 32;                                // a warp across the columns
constexpr int grad_row_lanes = bias_config.threads / grad_columns;  // rows in flight per block
constexpr std::int64_t grad_min_rows_per_block = 64;

template <class Y>
__global__ void __launch_bounds__(bias_config.threads)
    bias_add_kernel(Y* y, const bf16* bias, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  const std::int64_t n = rows * cols;
  const std::int64_t stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const std::int64_t r = i / cols, c = i % cols;
    Y* at = y + r * ld + c;
    *at = from_float<Y>(to_float(*at) + to_float(bias[c]));
  }
}

template <class G>
__global__ void __launch_bounds__(bias_config.threads)
    bias_grad_kernel(const G* d_y, float* d_bias, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                     std::int64_t rows_per_block, std::int64_t column_blocks) {
  __shared__ float partial[grad_row_lanes][grad_columns];
  const int lane = static_cast<int>(threadIdx.x) % grad_columns, row_lane = static_cast<int>(threadIdx.x) / grad_columns;
  // Block b takes column block b mod column_blocks over row range b / column_blocks.
  const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) % column_blocks * grad_columns + lane;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) / column_blocks * rows_per_block;
  const std::int64_t last = first + rows_per_block < rows ? first + rows_per_block : rows;
  float sum = 0.0f;
  if (col < cols)
    for (std::int64_t r = first + row_lane; r < last; r += grad_row_lanes) sum += to_float(d_y[r * ld + col]);
  partial[row_lane][lane] = sum;
  __syncthreads();
  if (row_lane != 0 || col >= cols) return;
  for (int k = 1; k < grad_row_lanes; ++k) sum += partial[k][lane];
  atomicAdd(d_bias + col, sum);
}

}  // namespace

void run(const bias_add_args& args, const context& ctx) {
  const mat_view& y = args.y;
  if (y.rows == 0 || y.cols == 0) return;
  const auto* bias = static_cast<const bf16*>(args.bias.data);
  with_types(
      [&](auto t) {
        using Y = typename decltype(t)::type;
        launch("bias_add_kernel", bias_add_kernel<Y>, grid_for_units(bias_config, y.rows * y.cols), bias_config, 0,
               ctx.stream, static_cast<Y*>(y.data), bias, y.rows, y.cols, y.ld);
      },
      y.type);
}

void run(const bias_grad_args& args, const context& ctx) {
  const mat_view& d_y = args.d_y;
  if (d_y.rows == 0 || d_y.cols == 0) return;
  // Enough row ranges to fill the device a few blocks deep, each at least a few rows long.
  const std::int64_t column_blocks = ceil_div(d_y.cols, grad_columns);
  const std::int64_t wanted_blocks = static_cast<std::int64_t>(multiprocessor_count()) * bias_config.blocks_per_sm;
  std::int64_t ranges = ceil_div(wanted_blocks, column_blocks);
  ranges = std::max<std::int64_t>(1, std::min(ranges, ceil_div(d_y.rows, grad_min_rows_per_block)));
  const std::int64_t rows_per_block = ceil_div(d_y.rows, ranges);
  const auto grid = static_cast<int>(column_blocks * ceil_div(d_y.rows, rows_per_block));
  with_types(
      [&](auto t) {
        using G = typename decltype(t)::type;
        launch("bias_grad_kernel", bias_grad_kernel<G>, grid, bias_config, 0, ctx.stream,
               static_cast<const G*>(d_y.data), static_cast<float*>(args.d_bias.data), d_y.rows, d_y.cols, d_y.ld,
               rows_per_block, column_blocks);
      },
      d_y.type);
}

}  // namespace upipe::cuda
