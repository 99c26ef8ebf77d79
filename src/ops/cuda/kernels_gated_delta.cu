// The chunked gated delta rule on the GPU: the stages of ops/gated_delta/chunk_*.hpp as
// kernels (one block of block_threads threads per stage block, fp32 SIMT arithmetic on
// shared-memory tiles, bf16 q/k/v/o storage), run in the drivers' order on the backend's
// stream; and the summaries' scan. The cpu backend runs the same stage code on the host.
#include <cuda_runtime.h>

#include <string>

#include "core/error.hpp"
#include "ops/cuda/cuda_ops.hpp"
#include "ops/cuda/kernels_common.cuh"
#include "ops/gated_delta/chunk_backward.hpp"
#include "ops/gated_delta/chunk_driver.hpp"

namespace upipe::cuda {

namespace {

using gated_delta::device_block;
using gated_delta::stage;
using gated_delta::stage_params;

template <stage S>
__global__ void __launch_bounds__(gated_delta::block_threads) stage_kernel(const stage_params p) {
  extern __shared__ float smem[];
  const device_block b;
  const std::int64_t x = blockIdx.x, y = blockIdx.y;
  if constexpr (S == stage::prepare) gated_delta::prepare(b, p, x, y, smem);
  if constexpr (S == stage::state_pass) gated_delta::state_pass(b, p, x, y, smem);
  if constexpr (S == stage::output) gated_delta::output(b, p, x, y, smem);
  if constexpr (S == stage::intra_backward) gated_delta::intra_backward(b, p, x, y, smem);
  if constexpr (S == stage::reverse_pass) gated_delta::reverse_pass(b, p, x, y, smem);
  if constexpr (S == stage::wy_backward) gated_delta::wy_backward(b, p, x, y, smem);
  if constexpr (S == stage::output_backward) gated_delta::output_backward(b, p, x, y, smem);
  if constexpr (S == stage::qk_backward) gated_delta::qk_backward(b, p, x, y, smem);
}

const char* stage_name(stage s) {
  switch (s) {
    case stage::prepare: return "gated_delta prepare";
    case stage::state_pass: return "gated_delta state_pass";
    case stage::output: return "gated_delta output";
    case stage::intra_backward: return "gated_delta intra_backward";
    case stage::reverse_pass: return "gated_delta reverse_pass";
    case stage::wy_backward: return "gated_delta wy_backward";
    case stage::output_backward: return "gated_delta output_backward";
    case stage::qk_backward: return "gated_delta qk_backward";
  }
  return "gated_delta";
}

class device_executor final : public gated_delta::stage_executor {
 public:
  explicit device_executor(cudaStream_t stream) : stream_(stream) {}

  void launch(stage s, std::int64_t grid_x, std::int64_t grid_y, const stage_params& p) override {
    switch (s) {
      case stage::prepare: return run<stage::prepare>(grid_x, grid_y, p);
      case stage::state_pass: return run<stage::state_pass>(grid_x, grid_y, p);
      case stage::output: return run<stage::output>(grid_x, grid_y, p);
      case stage::intra_backward: return run<stage::intra_backward>(grid_x, grid_y, p);
      case stage::reverse_pass: return run<stage::reverse_pass>(grid_x, grid_y, p);
      case stage::wy_backward: return run<stage::wy_backward>(grid_x, grid_y, p);
      case stage::output_backward: return run<stage::output_backward>(grid_x, grid_y, p);
      case stage::qk_backward: return run<stage::qk_backward>(grid_x, grid_y, p);
    }
  }

 private:
  template <stage S>
  void run(std::int64_t grid_x, std::int64_t grid_y, const stage_params& p) {
    if (grid_x == 0 || grid_y == 0) return;
    const auto bytes = static_cast<std::size_t>(gated_delta::stage_smem_floats(S, p.dk, p.dv)) * sizeof(float);
    int device = 0, limit = 0;
    UPIPE_CUDA_CHECK(cudaGetDevice(&device));
    UPIPE_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (bytes > static_cast<std::size_t>(limit))
      throw config_error(std::string(stage_name(S)) + " needs " + std::to_string(bytes) +
                         " bytes of shared memory a block for d_k " + std::to_string(p.dk) + ", d_v " +
                         std::to_string(p.dv) + ", and this GPU gives " + std::to_string(limit) +
                         ": the GPU kernels take head dims up to 128 (every Qwen3.5 and Qwen3-Next config)");
    UPIPE_CUDA_CHECK(
        cudaFuncSetAttribute(stage_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
    const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
    stage_kernel<S><<<grid, gated_delta::block_threads, bytes, stream_>>>(p);
    const cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess)
      fail("CUDA", stage_name(S), cuda_message(static_cast<int>(status)), __FILE__, __LINE__);
  }

  cudaStream_t stream_;
};

// The scan of R segments' summaries: one block per (head, slice of 32 state columns), the
// segments in order (forward) or in reverse (backward), the carry in shared memory.
constexpr int scan_slice = 32;

__global__ void __launch_bounds__(256) scan_kernel(gated_delta::stack_f32 m, gated_delta::stack_f32 local,
                                                   gated_delta::stack_f32 out, std::int64_t heads,
                                                   std::int64_t segments, int dk, int dv, bool forward) {
  extern __shared__ float carry[];  // (dk, scan_slice), then the next one
  float* next = carry + dk * scan_slice;
  const std::int64_t h = blockIdx.x;
  const int c0 = static_cast<int>(blockIdx.y) * scan_slice;
  const int nc = dv - c0 < scan_slice ? dv - c0 : scan_slice;
  for (int e = threadIdx.x; e < dk * scan_slice; e += blockDim.x) carry[e] = 0.0f;
  __syncthreads();
  for (std::int64_t step = 0; step < segments; ++step) {
    const std::int64_t at = (forward ? step : segments - 1 - step) * heads + h;
    for (int e = threadIdx.x; e < dk * nc; e += blockDim.x) {
      const int i = e / nc, c = e % nc;
      out.at(at, i, c0 + c) = carry[i * scan_slice + c];
      float sum = local.at(at, i, c0 + c);
      for (int p = 0; p < dk; ++p) sum += (forward ? m.at(at, i, p) : m.at(at, p, i)) * carry[p * scan_slice + c];
      next[i * scan_slice + c] = sum;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < dk * scan_slice; e += blockDim.x) carry[e] = next[e];
    __syncthreads();
  }
}

gated_delta::stack_f32 stack_of(const head_view& v) {
  return {static_cast<float*>(v.data), v.token_stride, v.head_stride};
}

}  // namespace

void run(const gated_delta_forward_args& args, const context& ctx) {
  device_executor exec(ctx.stream);
  gated_delta::chunked_forward(args, exec);
}

void run(const gated_delta_backward_args& args, const context& ctx) {
  device_executor exec(ctx.stream);
  gated_delta::chunked_backward(args, exec);
}

void run(const gated_delta_summary_args& args, const context& ctx) {
  device_executor exec(ctx.stream);
  gated_delta::chunked_summary(args, exec);
}

void run(const gated_delta_summary_backward_args& args, const context& ctx) {
  device_executor exec(ctx.stream);
  gated_delta::chunked_summary_backward(args, exec);
}

void run(const gated_delta_scan_args& args, const context& ctx) {
  const std::int64_t segments = args.transitions.tokens / args.heads;
  const int dk = static_cast<int>(args.transitions.heads), dv = static_cast<int>(args.locals.dim);
  const std::size_t bytes = 2 * static_cast<std::size_t>(dk) * scan_slice * sizeof(float);
  if (bytes > 48 * 1024)
    UPIPE_CUDA_CHECK(cudaFuncSetAttribute(scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(bytes)));
  const dim3 grid(static_cast<unsigned>(args.heads), static_cast<unsigned>(kernels::ceil_div(dv, scan_slice)));
  scan_kernel<<<grid, 256, bytes, ctx.stream>>>(stack_of(args.transitions), stack_of(args.locals),
                                                stack_of(args.states), args.heads, segments, dk, dv,
                                                args.direction == scan_direction::forward);
  UPIPE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace upipe::cuda
