// What the GPU tests share: whether a device is present, the tolerance of bf16 storage
// against the fp32 cpu reference, and a fixture holding a cpu and a cuda backend side by
// side for a whole suite.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <memory>

#include "backend/backend.hpp"

namespace upipe {

inline bool have_gpu() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: clear the error for later calls
    return false;
  }
  return count > 0;
}

inline constexpr double bf16_tolerance = 2e-2;

// A cpu backend and a cuda backend with device arenas of `device_mib` MiB (64 MiB of host
// pool each), made once per suite; every test skips where there is no GPU.
template <class Base, std::size_t device_mib>
class cpu_and_gpu : public Base {
 protected:
  static void SetUpTestSuite() {
    if (!have_gpu()) return;
    const memory_limits limits{device_mib << 20, std::size_t{64} << 20};
    cpu_ = make_cpu_backend(limits);
    gpu_ = make_backend(backend_kind::cuda, limits);
  }
  static void TearDownTestSuite() {
    gpu_.reset();
    cpu_.reset();
  }
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
  static inline std::unique_ptr<backend> cpu_, gpu_;
};

}  // namespace upipe
