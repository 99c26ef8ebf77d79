// The cuBLASLt gemm against the cpu backend on the same (bf16-representable) values:
// every transpose combination, padded and misaligned views, alpha/beta, beta == 0 with
// NaN in c, c in f32 and bf16, f32 inputs without TF32, k == 0, Llama-sized shapes, and
// the dtype combinations it refuses. The padding around every c must survive.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "backend/ops.hpp"
#include "core/error.hpp"
#include "gpu_support.hpp"

namespace upipe {
namespace {

constexpr memory_limits cpu_limits{std::size_t{1} << 30, 0};
constexpr memory_limits gpu_limits{std::size_t{1} << 30, 0};

class cuda_gemm_test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    cpu_ = make_cpu_backend(cpu_limits);
    gpu_ = make_cuda_backend(gpu_limits, 0);
  }
  std::unique_ptr<backend> cpu_, gpu_;
};

// One matrix on both backends with the same values: f32 on the cpu, `type` on the GPU.
// The view is rows x cols at column `shift` of a rows x (cols + pad) allocation, so
// ld > cols when pad > 0 and the view is misaligned when shift > 0.
struct operand {
  tensor on_cpu, on_gpu;
  mat_view cpu_view, gpu_view;
  std::vector<float> initial;  // the whole allocation, as uploaded
};

operand make_operand(backend& cpu, backend& gpu, dtype type, std::int64_t rows, std::int64_t cols, std::int64_t pad,
                     std::int64_t shift, std::mt19937& rng, bool nan_inside = false) {
  operand o;
  const std::int64_t width = cols + pad;
  o.on_cpu = cpu.allocate(mem_tag::activations, dtype::f32, {rows, width}, "operand");
  o.on_gpu = gpu.allocate(mem_tag::activations, type, {rows, width}, "operand");
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  o.initial.resize(static_cast<std::size_t>(rows * width));
  for (float& v : o.initial) v = type == dtype::bf16 ? round_to_bf16(dist(rng)) : dist(rng);
  if (nan_inside)
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = shift; j < shift + cols; ++j)
        o.initial[i * width + j] = std::numeric_limits<float>::quiet_NaN();
  cpu.upload_f32(o.on_cpu, o.initial.data());
  gpu.upload_f32(o.on_gpu, o.initial.data());
  o.cpu_view = o.on_cpu.matrix().col_block(shift, cols);
  o.gpu_view = o.on_gpu.matrix().col_block(shift, cols);
  return o;
}

struct gemm_case {
  transpose trans_a = transpose::none, trans_b = transpose::none;
  std::int64_t m = 0, n = 0, k = 0;
  float alpha = 1.0f, beta = 0.0f;
  dtype inputs = dtype::bf16, output = dtype::f32;
  std::int64_t pad = 0, shift = 0;
  bool nan_in_c = false;
};

std::string describe(const gemm_case& g) {
  std::ostringstream s;
  s << "m " << g.m << " n " << g.n << " k " << g.k << (g.trans_a == transpose::yes ? " a^T" : "")
    << (g.trans_b == transpose::yes ? " b^T" : "") << " alpha " << g.alpha << " beta " << g.beta << " inputs "
    << dtype_name(g.inputs) << " c " << dtype_name(g.output) << " pad " << g.pad << " shift " << g.shift
    << (g.nan_in_c ? " nan in c" : "");
  return s.str();
}

// bf16 inputs are rounded on both sides, so the only differences are the accumulation
// order and, for a bf16 c, its rounding.
double tolerance(const gemm_case& g) {
  if (g.inputs == dtype::f32) return 1e-5;
  return g.output == dtype::bf16 ? 2e-2 : 2e-3;
}

void check_case(backend& cpu, backend& gpu, const gemm_case& g, std::uint32_t seed) {
  SCOPED_TRACE(describe(g));
  std::mt19937 rng(seed);
  const bool ta = g.trans_a == transpose::yes, tb = g.trans_b == transpose::yes;
  // Pads differ per operand so that the three leading dimensions differ.
  operand a = make_operand(cpu, gpu, g.inputs, ta ? g.k : g.m, ta ? g.m : g.k, g.pad, g.shift, rng);
  operand b = make_operand(cpu, gpu, g.inputs, tb ? g.n : g.k, tb ? g.k : g.n, g.pad + (g.pad > 0 ? 2 : 0),
                           g.shift, rng);
  operand c = make_operand(cpu, gpu, g.output, g.m, g.n, g.pad + (g.pad > 0 ? 1 : 0), g.shift, rng, g.nan_in_c);

  ops::gemm(cpu, {a.cpu_view, g.trans_a, b.cpu_view, g.trans_b, c.cpu_view, g.alpha, g.beta});
  ops::gemm(gpu, {a.gpu_view, g.trans_a, b.gpu_view, g.trans_b, c.gpu_view, g.alpha, g.beta});
  std::vector<float> got(c.initial.size());
  gpu.download_f32(got.data(), c.on_gpu);

  const std::int64_t width = c.on_gpu.dims()[1];
  const auto* want = c.on_cpu.as<float>();
  double max_err = 0.0, max_ref = 0.0;
  for (std::int64_t i = 0; i < g.m; ++i)
    for (std::int64_t j = 0; j < width; ++j) {
      const std::size_t at = static_cast<std::size_t>(i * width + j);
      if (j < g.shift || j >= g.shift + g.n) {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(got[at]), std::bit_cast<std::uint32_t>(c.initial[at]))
            << "padding of c changed at (" << i << ", " << j << ")";
        continue;
      }
      ASSERT_TRUE(std::isfinite(got[at])) << "c(" << i << ", " << j - g.shift << ") = " << got[at];
      max_err = std::max(max_err, std::abs(static_cast<double>(got[at]) - want[at]));
      max_ref = std::max(max_ref, std::abs(static_cast<double>(want[at])));
    }
  if (max_ref == 0.0) {
    EXPECT_EQ(max_err, 0.0);
    return;
  }
  EXPECT_LT(max_err / max_ref, tolerance(g)) << "max |gpu - cpu| " << max_err << ", max |cpu| " << max_ref;
}

TEST_F(cuda_gemm_test, all_transpose_combinations) {
  std::uint32_t seed = 1;
  for (dtype output : {dtype::f32, dtype::bf16})
    for (transpose ta : {transpose::none, transpose::yes})
      for (transpose tb : {transpose::none, transpose::yes}) {
        gemm_case g{ta, tb, 64, 96, 128};
        g.output = output;
        check_case(*cpu_, *gpu_, g, seed++);
      }
}

// Sizes that are no multiple of 8, odd leading dimensions and views that start one
// element into their allocation (2-byte aligned for bf16).
TEST_F(cuda_gemm_test, odd_sizes_padded_and_misaligned_views) {
  std::uint32_t seed = 100;
  for (dtype output : {dtype::f32, dtype::bf16})
    for (transpose ta : {transpose::none, transpose::yes})
      for (transpose tb : {transpose::none, transpose::yes})
        for (std::int64_t shift : {0, 1}) {
          gemm_case g{ta, tb, 13, 17, 29};
          g.output = output;
          g.pad = 3;
          g.shift = shift;
          check_case(*cpu_, *gpu_, g, seed++);
        }
  check_case(*cpu_, *gpu_, {transpose::none, transpose::yes, 1, 1, 1}, seed++);
  check_case(*cpu_, *gpu_, {transpose::yes, transpose::none, 7, 1, 301}, seed++);
  check_case(*cpu_, *gpu_, {transpose::none, transpose::none, 1, 333, 9}, seed++);
}

TEST_F(cuda_gemm_test, alpha_and_beta_scale_and_accumulate) {
  std::uint32_t seed = 200;
  for (dtype output : {dtype::f32, dtype::bf16})
    for (transpose ta : {transpose::none, transpose::yes})
      for (transpose tb : {transpose::none, transpose::yes}) {
        gemm_case g{ta, tb, 40, 24, 72, -0.75f, 0.5f};
        g.output = output;
        g.pad = 5;
        check_case(*cpu_, *gpu_, g, seed++);
        g.alpha = 1.0f;
        g.beta = 1.0f;  // the accumulation of weight gradients
        check_case(*cpu_, *gpu_, g, seed++);
      }
}

TEST_F(cuda_gemm_test, beta_zero_does_not_read_c) {
  std::uint32_t seed = 300;
  for (dtype output : {dtype::f32, dtype::bf16})
    for (transpose ta : {transpose::none, transpose::yes})
      for (transpose tb : {transpose::none, transpose::yes}) {
        gemm_case g{ta, tb, 33, 48, 64, 2.0f, 0.0f};
        g.output = output;
        g.pad = 2;
        g.nan_in_c = true;
        check_case(*cpu_, *gpu_, g, seed++);
      }
}

// CUBLAS_COMPUTE_32F must keep f32 products in f32 (TF32 would miss 1e-5 by far at k = 4096).
TEST_F(cuda_gemm_test, f32_inputs_stay_f32) {
  std::uint32_t seed = 400;
  for (transpose ta : {transpose::none, transpose::yes})
    for (transpose tb : {transpose::none, transpose::yes}) {
      gemm_case g{ta, tb, 37, 45, 61, 1.5f, -0.25f, dtype::f32, dtype::f32, 3, 1};
      check_case(*cpu_, *gpu_, g, seed++);
    }
  check_case(*cpu_, *gpu_, {transpose::none, transpose::yes, 128, 512, 4096, 1.0f, 0.0f, dtype::f32, dtype::f32},
             seed++);
}

// k == 0 leaves c = beta * c (and zeros when beta == 0, NaN or not).
TEST_F(cuda_gemm_test, empty_inner_dimension_scales_c) {
  std::uint32_t seed = 500;
  for (dtype output : {dtype::f32, dtype::bf16}) {
    gemm_case g{transpose::none, transpose::none, 9, 11, 0, 1.0f, 0.5f};
    g.output = output;
    g.pad = 2;
    check_case(*cpu_, *gpu_, g, seed++);
    g.beta = 0.0f;
    g.nan_in_c = true;
    check_case(*cpu_, *gpu_, g, seed++);
  }
  gemm_case empty{transpose::none, transpose::none, 0, 8, 16};
  check_case(*cpu_, *gpu_, empty, seed++);
}

// The projections of a Llama 3 8B layer on 512 tokens: forward, input gradient, weight
// gradient (accumulated in f32), and the grouped-query k/v projection.
TEST_F(cuda_gemm_test, llama_shapes) {
  std::uint32_t seed = 600;
  const std::int64_t tokens = 512, hidden = 4096, kv = 1024;
  gemm_case forward{transpose::none, transpose::yes, tokens, hidden, hidden};
  forward.output = dtype::bf16;
  check_case(*cpu_, *gpu_, forward, seed++);
  gemm_case input_grad{transpose::none, transpose::none, tokens, hidden, hidden};
  input_grad.output = dtype::f32;
  check_case(*cpu_, *gpu_, input_grad, seed++);
  gemm_case weight_grad{transpose::yes, transpose::none, hidden, hidden, tokens, 1.0f, 1.0f};
  weight_grad.output = dtype::f32;
  check_case(*cpu_, *gpu_, weight_grad, seed++);
  gemm_case kv_proj{transpose::none, transpose::yes, tokens, kv, hidden};
  kv_proj.output = dtype::bf16;
  check_case(*cpu_, *gpu_, kv_proj, seed++);
}

// The second call of a shape reuses the cached plan; new data must still come out right,
// and a differently aligned view of the same shape must get its own plan.
TEST_F(cuda_gemm_test, cached_plans_are_reused_correctly) {
  std::uint32_t seed = 700;
  gemm_case g{transpose::none, transpose::yes, 48, 80, 96};
  g.pad = 8;
  for (int round = 0; round < 3; ++round) check_case(*cpu_, *gpu_, g, seed++);
  g.shift = 1;
  check_case(*cpu_, *gpu_, g, seed++);
  g.shift = 0;
  check_case(*cpu_, *gpu_, g, seed++);
}

TEST_F(cuda_gemm_test, mixed_input_dtypes_are_refused) {
  std::mt19937 rng(800);
  operand a = make_operand(*cpu_, *gpu_, dtype::f32, 8, 16, 0, 0, rng);
  operand b = make_operand(*cpu_, *gpu_, dtype::bf16, 16, 8, 0, 0, rng);
  operand c = make_operand(*cpu_, *gpu_, dtype::f32, 8, 8, 0, 0, rng);
  EXPECT_THROW(ops::gemm(*gpu_, {a.gpu_view, transpose::none, b.gpu_view, transpose::none, c.gpu_view}),
               internal_error);
  operand a32 = make_operand(*cpu_, *gpu_, dtype::f32, 8, 16, 0, 0, rng);
  operand b32 = make_operand(*cpu_, *gpu_, dtype::f32, 16, 8, 0, 0, rng);
  operand c16 = make_operand(*cpu_, *gpu_, dtype::bf16, 8, 8, 0, 0, rng);
  EXPECT_THROW(ops::gemm(*gpu_, {a32.gpu_view, transpose::none, b32.gpu_view, transpose::none, c16.gpu_view}),
               internal_error);
}

}  // namespace
}  // namespace upipe
