// The thread block the chunked gated delta rule's stages are written for, on the GPU and
// on the host. A stage is a function of one block: phases of `for_each(n, f)` (f(i) for
// every i in [0, n), spread over the block's threads) separated by `sync()`, over buffers
// in the block's shared memory. The CUDA kernels run it with device_block; the cpu backend
// runs the very same stage code with host_block, one block after another, so the GPU's
// arithmetic is the cpu's (docs/design.md, "Gated DeltaNet ops"). Within a phase no
// index may read what another index writes: host_block can run the indices in reverse to
// show such a race as a change in the result (tests/backend/gated_delta_chunk_test.cpp).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define UPIPE_HD __host__ __device__
#define UPIPE_HD_INLINE __host__ __device__ __forceinline__
#else
#define UPIPE_HD
#define UPIPE_HD_INLINE inline
#endif

namespace upipe::gated_delta {

// The block's threads on the GPU; the stages index work, never threads.
inline constexpr int block_threads = 256;

#if defined(__CUDACC__)
struct device_block {
  template <class F>
  __device__ __forceinline__ void for_each(std::int64_t n, F&& f) const {
    for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) f(i);
  }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
};
#endif

// Runs each phase's indices in order, or in reverse (the race check).
struct host_block {
  bool reverse = false;
  template <class F>
  void for_each(std::int64_t n, F&& f) const {
    if (reverse) {
      for (std::int64_t i = n - 1; i >= 0; --i) f(i);
    } else {
      for (std::int64_t i = 0; i < n; ++i) f(i);
    }
  }
  void sync() const {}
};

// Element storage of the views the stages read and write: f32, or bf16 (the GPU's working
// dtype) rounded to nearest even as core/dtype.hpp's float_to_bf16.
enum class element : std::uint8_t { f32, bf16 };

UPIPE_HD_INLINE float bf16_bits_to_float(std::uint16_t bits) {
  const std::uint32_t word = static_cast<std::uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

UPIPE_HD_INLINE std::uint16_t float_to_bf16_bits(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0)
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<std::uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// A (rows, heads, dim) view: element (t, h, i) at data[t * s0 + h * s1 + i].
struct tensor3 {
  void* data = nullptr;
  element type = element::f32;
  std::int64_t s0 = 0, s1 = 0;

  UPIPE_HD_INLINE float load(std::int64_t t, std::int64_t h, std::int64_t i) const {
    const std::int64_t at = t * s0 + h * s1 + i;
    if (type == element::f32) return static_cast<const float*>(data)[at];
    return bf16_bits_to_float(static_cast<const std::uint16_t*>(data)[at]);
  }
  UPIPE_HD_INLINE void store(std::int64_t t, std::int64_t h, std::int64_t i, float value) const {
    const std::int64_t at = t * s0 + h * s1 + i;
    if (type == element::f32) {
      static_cast<float*>(data)[at] = value;
    } else {
      static_cast<std::uint16_t*>(data)[at] = float_to_bf16_bits(value);
    }
  }
  UPIPE_HD_INLINE bool empty() const { return data == nullptr; }
};

// An f32 (rows, cols) matrix with leading dimension ld.
struct matrix_f32 {
  float* data = nullptr;
  std::int64_t ld = 0;
  UPIPE_HD_INLINE float& at(std::int64_t r, std::int64_t c) const { return data[r * ld + c]; }
  UPIPE_HD_INLINE bool empty() const { return data == nullptr; }
};

// A stack of f32 matrices (state views): element (m, i, j) at data[m * s0 + i * s1 + j].
struct stack_f32 {
  float* data = nullptr;
  std::int64_t s0 = 0, s1 = 0;
  UPIPE_HD_INLINE float& at(std::int64_t m, std::int64_t i, std::int64_t j) const {
    return data[m * s0 + i * s1 + j];
  }
  UPIPE_HD_INLINE bool empty() const { return data == nullptr; }
};

}  // namespace upipe::gated_delta
