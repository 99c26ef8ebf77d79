// FP8 attention's data movement (ops/fp8_attention.hpp): the amax of a view, the scales
// computed on the device from the amaxes (no host round trip), and the conversions between
// the working dtype's strided views and the packed E4M3/E5M2 copies cuDNN reads and writes.
// Conversions round to nearest even and saturate (CUDA's satfinite), as core/dtype.hpp does.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <string>

#include "core/error.hpp"
#include "ops/cuda/cuda_ops.hpp"
#include "ops/cuda/kernels_common.cuh"
#include "ops/fp8_attention.hpp"

namespace upipe::cuda {

namespace {

using namespace kernels;

constexpr kernel_config fp8_config{256, 8};

// Element e of a (tokens, heads, dim) view, e in token-major, head, dim order.
struct heads_index {
  std::int64_t heads, dim, token_stride, head_stride;
  __device__ std::int64_t offset(std::int64_t e) const {
    const std::int64_t x = e % dim, row = e / dim;
    return (row / heads) * token_stride + (row % heads) * head_stride + x;
  }
};

heads_index index_of(const head_view& v) { return {v.heads, v.dim, v.token_stride, v.head_stride}; }
std::int64_t count_of(const head_view& v) { return v.tokens * v.heads * v.dim; }

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Non-negative floats order as their bit patterns, so an integer atomicMax keeps the max
// (a NaN's pattern is above infinity's: it wins, and its scale is 1).
__global__ void __launch_bounds__(fp8_config.threads)
    amax_kernel(const bf16* x, heads_index at, std::int64_t count, float* amax) {
  float m = 0.0f;
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < count;
       e += std::int64_t{gridDim.x} * blockDim.x) {
    const float v = fabsf(__bfloat162float(x[at.offset(e)]));
    m = v != v ? v : fmaxf(m, v);
  }
  m = warp_max(m);
  __shared__ float warps[fp8_config.threads / 32];
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x >= 32) return;
  m = threadIdx.x < blockDim.x / 32 ? warps[threadIdx.x] : 0.0f;
  m = warp_max(m);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(m));
}

// One thread: the scales of ops/fp8_attention.hpp from the amax slots, and their inverses
// (exact: powers of two).
__global__ void forward_scales_kernel(float* slot) {
  const fp8_forward_scales s =
      fp8_forward_scales_of(slot[fp8_slot::amax_q], slot[fp8_slot::amax_k], slot[fp8_slot::amax_v]);
  const float scales[] = {s.q, s.k, s.v, s.o, 1.0f, s.s, 1.0f, 1.0f, 1.0f, 1.0f};
  for (int i = 0; i < fp8_slot::operands; ++i) {
    slot[fp8_slot::scale_q + i] = scales[i];
    slot[fp8_slot::descale_q + i] = 1.0f / scales[i];
  }
}

__global__ void backward_scales_kernel(float* slot, std::int64_t q_tokens, std::int64_t dim, float attn_scale) {
  const fp8_backward_amax a{slot[fp8_slot::amax_q], slot[fp8_slot::amax_k], slot[fp8_slot::amax_v],
                            slot[fp8_slot::amax_o], slot[fp8_slot::amax_d_o]};
  const fp8_backward_scales s = fp8_backward_scales_of(a, q_tokens, dim, attn_scale);
  const float scales[] = {s.q, s.k, s.v, s.o, s.d_o, s.s, s.d_s, s.d_q, s.d_k, s.d_v};
  for (int i = 0; i < fp8_slot::operands; ++i) {
    slot[fp8_slot::scale_q + i] = scales[i];
    slot[fp8_slot::descale_q + i] = 1.0f / scales[i];
  }
}

__nv_fp8_interpretation_t interpretation(fp8_format f) { return f == fp8_format::e4m3 ? __NV_E4M3 : __NV_E5M2; }

__global__ void __launch_bounds__(fp8_config.threads)
    quantize_kernel(const bf16* x, heads_index at, std::int64_t count, std::uint8_t* dst, const float* scale,
                    __nv_fp8_interpretation_t format) {
  const float s = *scale;
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < count;
       e += std::int64_t{gridDim.x} * blockDim.x)
    dst[e] = __nv_cvt_float_to_fp8(__bfloat162float(x[at.offset(e)]) * s, __NV_SATFINITE, format);
}

__global__ void __launch_bounds__(fp8_config.threads)
    dequantize_kernel(const std::uint8_t* src, heads_index at, std::int64_t count, bf16* dst, const float* descale,
                      __nv_fp8_interpretation_t format) {
  const float s = *descale;
  for (std::int64_t e = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; e < count;
       e += std::int64_t{gridDim.x} * blockDim.x) {
    const __half h(__nv_cvt_fp8_to_halfraw(src[e], format));  // exact: both formats fit in fp16
    dst[at.offset(e)] = __float2bfloat16_rn(__half2float(h) * s);
  }
}

void require_bf16(const head_view& v, const char* what) {
  UPIPE_CHECK(v.type == dtype::bf16, std::string("fp8 attention: ") + what + " must be bf16 (the GPU's working dtype)");
}

}  // namespace

void fp8_amax(const head_view& x, float* amax, cudaStream_t stream) {
  require_bf16(x, "an amax's input");
  const std::int64_t n = count_of(x);
  if (n == 0) return;
  launch("fp8_amax_kernel", amax_kernel, grid_for_units(fp8_config, n), fp8_config, 0, stream,
         static_cast<const bf16*>(x.data), index_of(x), n, amax);
}

void compute_fp8_forward_scales(float* slots, cudaStream_t stream) {
  launch("fp8_forward_scales_kernel", forward_scales_kernel, 1, kernel_config{1, 1}, 0, stream, slots);
}

void compute_fp8_backward_scales(float* slots, std::int64_t q_tokens, std::int64_t dim, float attn_scale,
                         cudaStream_t stream) {
  launch("fp8_backward_scales_kernel", backward_scales_kernel, 1, kernel_config{1, 1}, 0, stream, slots, q_tokens,
         dim, attn_scale);
}

void fp8_quantize(const head_view& x, std::uint8_t* dst, const float* scale, fp8_format format, cudaStream_t stream) {
  require_bf16(x, "a quantized input");
  const std::int64_t n = count_of(x);
  if (n == 0) return;
  launch("fp8_quantize_kernel", quantize_kernel, grid_for_units(fp8_config, n), fp8_config, 0, stream,
         static_cast<const bf16*>(x.data), index_of(x), n, dst, scale, interpretation(format));
}

void fp8_dequantize(const std::uint8_t* src, const head_view& dst, const float* descale, fp8_format format,
                    cudaStream_t stream) {
  require_bf16(dst, "a dequantized output");
  const std::int64_t n = count_of(dst);
  if (n == 0) return;
  launch("fp8_dequantize_kernel", dequantize_kernel, grid_for_units(fp8_config, n), fp8_config, 0, stream, src,
         index_of(dst), n, static_cast<bf16*>(dst.data), descale, interpretation(format));
}

}  // namespace upipe::cuda
