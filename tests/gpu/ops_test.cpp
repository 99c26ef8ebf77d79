// What the op harness (tests/gpu/op_harness_test.cpp, one comparison per registered op)
// does not cover: ops run in place on aliased views, mixed input dtypes, and the backend's
// fp32 reduction, each on a cpu backend and a cuda backend from the same inputs (rounded to
// bf16 first wherever the GPU stores bf16), whole tensors compared as max|gpu - cpu| /
// max|cpu|. Skipped when no CUDA device is present.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.hpp"
#include "backend/ops.hpp"
#include "core/dtype.hpp"
#include "gpu_support.hpp"

namespace upipe {
namespace {

constexpr double bf16_tolerance = 2e-2;
constexpr double f32_tolerance = 1e-5;

// A tensor on each backend holding the same values.
struct twin {
  tensor on_cpu, on_gpu;
};

// max |got - want| / max |want|; NaN or a mismatched infinity counts as infinite error.
double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  double err = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i]) || std::isinf(got[i])) {
      if (got[i] != want[i]) err = std::numeric_limits<double>::infinity();
      continue;
    }
    const double diff = std::abs(static_cast<double>(got[i]) - want[i]);
    err = std::isnan(diff) ? std::numeric_limits<double>::infinity() : std::max(err, diff);
    scale = std::max(scale, std::abs(static_cast<double>(want[i])));
  }
  return scale > 0.0 ? err / scale : err;
}

class gpu_ops : public cpu_and_gpu<::testing::Test, 256> {
 protected:
  static backend& cpu() { return *cpu_; }
  static backend& gpu() { return *gpu_; }

  std::vector<float> random_values(std::int64_t n, float lo, float hi) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(static_cast<std::size_t>(n));
    for (float& x : v) x = dist(rng_);
    return v;
  }

  // Values rounded to bf16 when either side stores bf16.
  static twin make_twin(dtype cpu_type, dtype gpu_type, const shape& dims, std::vector<float> values) {
    if (cpu_type == dtype::bf16 || gpu_type == dtype::bf16)
      for (float& v : values) v = round_to_bf16(v);
    twin t{cpu().allocate(mem_tag::activations, cpu_type, dims, "cpu"),
           gpu().allocate(mem_tag::activations, gpu_type, dims, "gpu")};
    cpu().upload_f32(t.on_cpu, values.data());
    gpu().upload_f32(t.on_gpu, values.data());
    return t;
  }
  twin random_twin(dtype cpu_type, dtype gpu_type, const shape& dims, float lo = -1.0f, float hi = 1.0f) {
    return make_twin(cpu_type, gpu_type, dims, random_values(dims.numel(), lo, hi));
  }
  // The working dtype on each side: f32 on the cpu, bf16 on the gpu.
  twin work_twin(const shape& dims, float lo = -1.0f, float hi = 1.0f) {
    return random_twin(dtype::f32, dtype::bf16, dims, lo, hi);
  }
  twin f32_twin(const shape& dims, float lo = -1.0f, float hi = 1.0f) {
    return random_twin(dtype::f32, dtype::f32, dims, lo, hi);
  }

  // An (n x 1) i32 column inside an (n, 2) allocation whose padding holds INT32_MAX.
  static twin index_twin(const std::vector<std::int32_t>& values) {
    const auto n = static_cast<std::int64_t>(values.size());
    std::vector<std::int32_t> padded(static_cast<std::size_t>(2 * n), std::numeric_limits<std::int32_t>::max());
    for (std::int64_t i = 0; i < n; ++i) padded[2 * i] = values[i];
    twin t{cpu().allocate(mem_tag::activations, dtype::i32, shape{n, 2}, "ids"),
           gpu().allocate(mem_tag::activations, dtype::i32, shape{n, 2}, "ids")};
    cpu().upload_bytes(t.on_cpu, padded.data(), padded.size() * sizeof(std::int32_t));
    gpu().upload_bytes(t.on_gpu, padded.data(), padded.size() * sizeof(std::int32_t));
    return t;
  }

  static std::vector<float> fetch(backend& be, const tensor& t) {
    std::vector<float> out(static_cast<std::size_t>(t.numel()));
    be.download_f32(out.data(), t);
    return out;
  }
  static double error_of(const twin& t) { return relative_error(fetch(gpu(), t.on_gpu), fetch(cpu(), t.on_cpu)); }

  std::mt19937 rng_{20240611};
};

// ---------------------------------------------------------------------------------------
// RMSNorm

TEST_F(gpu_ops, rmsnorm_forward_in_place_and_mixed_dtypes) {
  const std::int64_t rows = 13, cols = 1536;
  // In place on bf16.
  const twin x = work_twin(shape{rows, cols}, -3.0f, 3.0f);
  const twin weight = work_twin(shape{1, cols}, 0.5f, 1.5f);
  const twin rstd = f32_twin(shape{rows, 1});
  // An f32 input with bf16 weights into an f32 output.
  const twin x32 = f32_twin(shape{rows, cols}, -3.0f, 3.0f);
  const twin y32 = f32_twin(shape{rows, cols});
  const twin rstd2 = f32_twin(shape{rows, 1});
  for (const bool gpu_side : {false, true}) {
    backend& be = gpu_side ? gpu() : cpu();
    auto pick = [&](const twin& t) -> const tensor& { return gpu_side ? t.on_gpu : t.on_cpu; };
    ops::rmsnorm_forward(be, {pick(x).matrix(), pick(weight).matrix(), pick(x).matrix(), pick(rstd).matrix(), 1e-6f});
    ops::rmsnorm_forward(be,
                         {pick(x32).matrix(), pick(weight).matrix(), pick(y32).matrix(), pick(rstd2).matrix(), 1e-6f});
  }
  EXPECT_LT(error_of(x), bf16_tolerance);
  EXPECT_LT(error_of(rstd), f32_tolerance);
  EXPECT_LT(error_of(y32), 1e-5);  // f32 in and out; only the weights are bf16
  EXPECT_LT(error_of(rstd2), f32_tolerance);
}

TEST_F(gpu_ops, rmsnorm_backward_in_place) {
  const std::int64_t rows = 21, cols = 512;
  const twin x = work_twin(shape{rows, cols});
  const twin weight = work_twin(shape{1, cols}, 0.5f, 1.5f);
  const twin rstd = f32_twin(shape{rows, 1}, 0.5f, 2.0f);
  const twin d = work_twin(shape{rows, cols});  // d_y, overwritten by d_x
  const twin d_weight = f32_twin(shape{1, cols});
  for (const bool gpu_side : {false, true}) {
    auto pick = [&](const twin& t) -> const tensor& { return gpu_side ? t.on_gpu : t.on_cpu; };
    ops::rmsnorm_backward(gpu_side ? gpu() : cpu(), {pick(x).matrix(), pick(weight).matrix(), pick(rstd).matrix(),
                                                     pick(d).matrix(), pick(d).matrix(), pick(d_weight).matrix()});
  }
  EXPECT_LT(error_of(d), bf16_tolerance);
  EXPECT_LT(error_of(d_weight), 1e-4);
}

// ---------------------------------------------------------------------------------------
// SwiGLU

TEST_F(gpu_ops, swiglu_backward_in_place) {
  const shape dims{24, 256};
  const twin gate = work_twin(dims, -6.0f, 6.0f), up = work_twin(dims, -2.0f, 2.0f), d_out = work_twin(dims);
  for (const bool gpu_side : {false, true}) {
    auto pick = [&](const twin& t) { return (gpu_side ? t.on_gpu : t.on_cpu).matrix(); };
    ops::swiglu_backward(gpu_side ? gpu() : cpu(), {pick(gate), pick(up), pick(d_out), pick(gate), pick(up)});
  }
  EXPECT_LT(error_of(gate), bf16_tolerance);
  EXPECT_LT(error_of(up), bf16_tolerance);
}

// ---------------------------------------------------------------------------------------
// The communicators' fp32 reduction

TEST_F(gpu_ops, add_f32_matches_cpu) {
  for (const std::int64_t first : {0, 1}) {
    const std::int64_t count = 10'007;
    const twin dst = f32_twin(shape{count + 1}), src = f32_twin(shape{count + 1});
    for (const bool gpu_side : {false, true}) {
      backend& be = gpu_side ? gpu() : cpu();
      const tensor& d = gpu_side ? dst.on_gpu : dst.on_cpu;
      const tensor& s = gpu_side ? src.on_gpu : src.on_cpu;
      be.add_f32(d.as<float>() + first, s.as<float>() + first, static_cast<std::size_t>(count));
    }
    EXPECT_EQ(error_of(dst), 0.0) << "first " << first;
  }
}

}  // namespace
}  // namespace upipe
