// Shared pieces of the op kernels (ops/cuda/kernels_*.cu): launch configuration as data
// and the one launch helper, dtype dispatch, 16-byte vector loads and stores with fp32
// conversion, group reductions and row traversal. Included by CUDA translation units only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <source_location>
#include <type_traits>

#include "core/dtype.hpp"
#include "ops/cuda/cuda_check.hpp"

namespace upipe::cuda::kernels {

using bf16 = __nv_bfloat16;

// ---------------------------------------------------------------------------------------
// Launch configuration and the launch helper

// Block size and how many blocks per multiprocessor a grid-stride grid is capped at
// (enough resident threads to keep the memory system busy, no more).
struct kernel_config {
  int threads = 256;
  int blocks_per_sm = 8;
};

inline int multiprocessor_count() {
  int device = 0;
  UPIPE_CUDA_CHECK(cudaGetDevice(&device));
  static std::array<std::atomic<int>, 64> cache{};
  if (device >= 0 && device < static_cast<int>(cache.size())) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int count = 0;
  UPIPE_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  if (device >= 0 && device < static_cast<int>(cache.size())) cache[device].store(count, std::memory_order_relaxed);
  return count;
}

// Blocks for `wanted` blocks of work, capped at one resident wave (grid-stride loops
// cover the rest). Never 0 for wanted > 0.
inline int grid_size(const kernel_config& config, std::int64_t wanted) {
  const std::int64_t cap = static_cast<std::int64_t>(multiprocessor_count()) * config.blocks_per_sm;
  const std::int64_t blocks = wanted < cap ? wanted : cap;
  return static_cast<int>(blocks < 1 ? 1 : blocks);
}

inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Smallest power of two >= n, at most cap (a power of two).
inline int pow2_at_least(std::int64_t n, int cap) {
  int p = 1;
  while (p < cap && p < n) p *= 2;
  return p;
}

// The kernel's name and the launcher's call site, for the message of a failed launch.
struct launch_site {
  const char* name;
  std::source_location where;
  // Implicit from the name, so that the default argument records the caller's line.
  launch_site(const char* kernel_name, std::source_location site = std::source_location::current())  // NOLINT
      : name(kernel_name), where(site) {}
};

// Launches kernel<<<grid, config.threads, shared_bytes, stream>>> and checks the launch.
template <class... Params, class... Args>
void launch(const launch_site& site, void (*kernel)(Params...), int grid, const kernel_config& config,
            std::size_t shared_bytes, cudaStream_t stream, const Args&... args) {
  constexpr std::size_t default_shared_limit = 48 * 1024;
  if (shared_bytes > default_shared_limit)
    UPIPE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(shared_bytes)));
  kernel<<<grid, config.threads, shared_bytes, stream>>>(args...);
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess)
    fail("CUDA", site.name, cuda_message(static_cast<int>(status)), site.where.file_name(),
         static_cast<int>(site.where.line()));
}

// Blocks for a grid-stride walk over `units` work items, one per thread.
inline int grid_for_units(const kernel_config& config, std::int64_t units) {
  return grid_size(config, ceil_div(units, config.threads));
}

// Calls f(type_tag<T>...) with T = bf16 or float for each dtype given (the entries have
// ruled out i32 for every arithmetic view).
template <class T>
struct type_tag {
  using type = T;
};

template <class... Done, class F>
void with_types(F&& f) {
  f(type_tag<Done>{}...);
}

template <class... Done, class F, class... Rest>
void with_types(F&& f, dtype first, Rest... rest) {
  if (first == dtype::bf16)
    with_types<Done..., bf16>(f, rest...);
  else
    with_types<Done..., float>(f, rest...);
}

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Every row of a strided matrix starts on a 16-byte boundary.
inline bool rows_aligned16(const void* data, std::int64_t rows, std::int64_t ld, std::size_t element_bytes) {
  return aligned16(data) && (rows <= 1 || (ld * static_cast<std::int64_t>(element_bytes)) % 16 == 0);
}

// ---------------------------------------------------------------------------------------
// Element conversion and vector access

template <class T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return __bfloat162float(v);
}

template <class T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return __float2bfloat16_rn(v);
}

// A 32-bit word holds one float or two bf16 (the first element in the low half).
template <class T>
__device__ __forceinline__ void unpack_word(unsigned word, float* out) {
  if constexpr (std::is_same_v<T, float>) {
    out[0] = __uint_as_float(word);
  } else {
    out[0] = __uint_as_float(word << 16);
    out[1] = __uint_as_float(word & 0xffff0000u);
  }
}

template <class T>
__device__ __forceinline__ unsigned pack_word(const float* in) {
  if constexpr (std::is_same_v<T, float>) {
    return __float_as_uint(in[0]);
  } else {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(in[0], in[1]);
    return static_cast<unsigned>(__bfloat16_as_ushort(pair.x)) |
           (static_cast<unsigned>(__bfloat16_as_ushort(pair.y)) << 16);
  }
}

// N consecutive elements as floats; the address must be aligned to the access width
// (16 bytes when N * sizeof(T) is a multiple of 16).
template <int N, class T>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[N]) {
  constexpr int bytes = N * static_cast<int>(sizeof(T));
  constexpr int per_word = 4 / static_cast<int>(sizeof(T));
  if constexpr (bytes % 16 == 0) {
#pragma unroll
    for (int c = 0; c < bytes / 16; ++c) {
      const uint4 raw = reinterpret_cast<const uint4*>(p)[c];
      unpack_word<T>(raw.x, v + (4 * c + 0) * per_word);
      unpack_word<T>(raw.y, v + (4 * c + 1) * per_word);
      unpack_word<T>(raw.z, v + (4 * c + 2) * per_word);
      unpack_word<T>(raw.w, v + (4 * c + 3) * per_word);
    }
  } else if constexpr (bytes == 8) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    unpack_word<T>(raw.x, v);
    unpack_word<T>(raw.y, v + per_word);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = to_float(p[i]);
  }
}

template <int N, class T>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[N]) {
  constexpr int bytes = N * static_cast<int>(sizeof(T));
  constexpr int per_word = 4 / static_cast<int>(sizeof(T));
  if constexpr (bytes % 16 == 0) {
#pragma unroll
    for (int c = 0; c < bytes / 16; ++c) {
      uint4 raw;
      raw.x = pack_word<T>(v + (4 * c + 0) * per_word);
      raw.y = pack_word<T>(v + (4 * c + 1) * per_word);
      raw.z = pack_word<T>(v + (4 * c + 2) * per_word);
      raw.w = pack_word<T>(v + (4 * c + 3) * per_word);
      reinterpret_cast<uint4*>(p)[c] = raw;
    }
  } else if constexpr (bytes == 8) {
    uint2 raw;
    raw.x = pack_word<T>(v);
    raw.y = pack_word<T>(v + per_word);
    *reinterpret_cast<uint2*>(p) = raw;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = from_float<T>(v[i]);
  }
}

__device__ __forceinline__ bool is_aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// q = i / d, r = i % d, in 32-bit arithmetic when both fit (a 64-bit division costs
// several times more).
__device__ __forceinline__ void split_index(std::int64_t i, std::int64_t d, std::int64_t& q, std::int64_t& r) {
  if (((i | d) >> 32) == 0) {
    const auto q32 = static_cast<std::uint32_t>(i) / static_cast<std::uint32_t>(d);
    q = q32;
    r = i - static_cast<std::int64_t>(q32) * d;
  } else {
    q = i / d;
    r = i - q * d;
  }
}

// ---------------------------------------------------------------------------------------
// Reductions

struct sum_op {
  template <class T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct max_op {
  template <class T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a > b ? a : b; }
};

// Reduces over groups of `width` consecutive lanes (a power of two up to 32); every lane
// of the warp must call it.
template <class Op, class T>
__device__ __forceinline__ T warp_reduce(T v, int width = 32) {
  for (int offset = width / 2; offset > 0; offset /= 2) v = Op{}(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Reduces over a group of Group consecutive threads (a power of two up to a warp, or
// the whole block of Threads). Every thread of the block must call it; scratch holds 32
// values and is free again when it returns.
template <class Op, int Group, int Threads, class T>
__device__ __forceinline__ T group_reduce(T v, T* scratch) {
  static_assert(Group <= 32 || Group == Threads, "a group is at most a warp, or the whole block");
  if constexpr (Group <= 32) {
    return warp_reduce<Op>(v, Group);
  } else {
    constexpr int warps = Threads / 32;
    v = warp_reduce<Op>(v);
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    T total = scratch[0];
#pragma unroll
    for (int w = 1; w < warps; ++w) total = Op{}(total, scratch[w]);
    __syncthreads();
    return total;
  }
}

template <int Group, int Threads, class T>
__device__ __forceinline__ T group_sum(T v, T* scratch) {
  return group_reduce<sum_op, Group, Threads>(v, scratch);
}

// ---------------------------------------------------------------------------------------
// Row traversal

// Calls f(row, active) for the rows [0, rows) that this thread's group of `group`
// consecutive threads (a power of two dividing the block) takes. The loop is uniform
// over the block, so f may synchronize; inactive threads (row >= rows) come along.
template <class F>
__device__ __forceinline__ void for_each_row(std::int64_t rows, int group, F&& f) {
  const int rows_per_block = static_cast<int>(blockDim.x) / group;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * rows_per_block;
  for (std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * rows_per_block; base < rows; base += step) {
    const std::int64_t row = base + threadIdx.x / group;
    f(row, row < rows);
  }
}

// Visits the elements [0, n) of one row by a group of Group threads: chunks of Width
// elements (f(j, width_tag<Width>)) when vec, the tail and every element otherwise one
// at a time (f(j, width_tag<1>)). A thread visits the same elements whenever n, vec and
// lane are the same, so a row may be read in one pass and written in the next.
template <int N>
struct width_tag {
  static constexpr int value = N;
};

template <int Width, class F>
__device__ __forceinline__ void for_each_chunk(std::int64_t n, bool vec, int lane, int group, F&& f) {
  std::int64_t scalar_begin = 0;
  if (vec) {
    for (std::int64_t j = static_cast<std::int64_t>(lane) * Width; j + Width <= n;
         j += static_cast<std::int64_t>(group) * Width)
      f(j, width_tag<Width>{});
    scalar_begin = n / Width * Width;
  }
  for (std::int64_t j = scalar_begin + lane; j < n; j += group) f(j, width_tag<1>{});
}

// Visits a rows x cols matrix grid-stride: chunks of Width elements of one row
// (f(row, j, width_tag<Width>)) when vec, else single elements (f(row, j, width_tag<1>));
// a row's tail that fills no chunk goes element by element. rows == 1 costs no division.
template <int Width, class F>
__device__ __forceinline__ void for_each_matrix_chunk(std::int64_t rows, std::int64_t cols, bool vec, F&& f) {
  const std::int64_t per_row = vec ? (cols + Width - 1) / Width : cols;
  const std::int64_t total = rows * per_row;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t u = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < total; u += step) {
    std::int64_t row = 0, k = u;
    if (rows > 1) split_index(u, per_row, row, k);
    if (!vec) {
      f(row, k, width_tag<1>{});
      continue;
    }
    const std::int64_t j = k * Width;
    if (j + Width <= cols) {
      f(row, j, width_tag<Width>{});
    } else {
      for (std::int64_t jj = j; jj < cols; ++jj) f(row, jj, width_tag<1>{});
    }
  }
}

// A device-side range failure (an id or label the host could not see): reports and
// traps, which poisons the context so the next checked CUDA call aborts.
__device__ __forceinline__ void trap_out_of_range(const char* op, const char* what, long long value, long long row,
                                                  long long limit) {
  printf("upipe: %s: %s %lld at row %lld is outside [0, %lld)\n", op, what, value, row, limit);
  __trap();
}

}  // namespace upipe::cuda::kernels
