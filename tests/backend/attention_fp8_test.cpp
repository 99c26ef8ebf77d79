// FP8 attention on the cpu backend held to its definition (ops/fp8_attention.hpp): the
// forward against an fp64 attention written independently (backend/op_float64.hpp) on the
// inputs quantized here, P rounded where it meets V as the fused kernels round it, the output
// quantized at V's scale; the backward against the fp64 backward on the quantized inputs with
// P and dS rounded where the kernels round them, its outputs quantized at scales whose bounds
// hold (no gradient saturates). The registry's sdpa_*_fp8 cases name this test; the GPU is held to
// the cpu backend by tests/gpu/op_harness_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <random>
#include <tuple>
#include <vector>

#include "backend/backend.hpp"
#include "backend/op_float64.hpp"
#include "backend/ops.hpp"
#include "core/dtype.hpp"
#include "ops/fp8_attention.hpp"
#include "op_test_support.hpp"

namespace upipe {
namespace {

using namespace op_test;

struct shape_case {
  std::int64_t sq, skv, hq, hk, d;
  attn_mask mask;
};
const shape_case shapes[] = {{40, 40, 4, 2, 64, attn_mask::causal}, {24, 56, 4, 1, 128, attn_mask::none}};

tensor make_heads(backend& be, std::int64_t tokens, std::int64_t heads, std::int64_t dim, std::mt19937& rng,
                  float range, const char* label) {
  tensor t = be.allocate(mem_tag::activations, dtype::f32, shape{tokens, heads, dim}, label);
  std::uniform_real_distribution<float> dist(-range, range);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.as<float>()[i] = dist(rng);
  return t;
}

std::vector<float> values(const tensor& t) { return {t.as<float>(), t.as<float>() + t.numel()}; }

float amax(const tensor& t) {
  float m = 0;
  for (const float x : values(t)) m = std::max(m, std::fabs(x));
  return m;
}

// A copy of t with every element x -> fp8(x scale) / scale.
tensor quantized(backend& be, const tensor& t, float scale, fp8_format format) {
  tensor q = be.allocate(mem_tag::activations, dtype::f32, t.dims(), "quantized");
  for (std::int64_t i = 0; i < t.numel(); ++i)
    q.as<float>()[i] = round_to_fp8(t.as<float>()[i] * scale, format) / scale;
  return q;
}

double max_error(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0, top = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    err = worse(err, std::fabs(got[i] - want[i]));
    top = std::max(top, std::fabs(want[i]));
  }
  return top > 0 ? err / top : err;
}

// A power of two that puts the amax into the format's top binade: (largest / 2, largest].
void expect_current_scale(float amax_value, float scale, float largest) {
  int exponent = 0;
  EXPECT_EQ(std::frexp(scale, &exponent), 0.5f) << scale;
  EXPECT_LE(amax_value * scale, largest);
  EXPECT_GT(amax_value * scale, largest / 2);
}

class fp8_attention : public ::testing::TestWithParam<shape_case> {};

TEST_P(fp8_attention, forward_is_exact_attention_on_quantized_inputs) {
  const shape_case a = GetParam();
  auto be = make_test_backend();
  std::mt19937 rng(7);
  // Ranges far apart, so that each tensor's scale is its own.
  tensor q = make_heads(*be, a.sq, a.hq, a.d, rng, 5.0f, "q"), k = make_heads(*be, a.skv, a.hk, a.d, rng, 0.3f, "k"),
         v = make_heads(*be, a.skv, a.hk, a.d, rng, 40.0f, "v");
  tensor out = be->allocate(mem_tag::activations, dtype::f32, shape{a.sq, a.hq, a.d}, "out");
  tensor lse = be->allocate(mem_tag::activations, dtype::f32, shape{a.sq, a.hq, 1}, "lse");
  const float scale = 1.0f / std::sqrt(static_cast<float>(a.d));
  ops::sdpa_forward(*be, {q.heads(), k.heads(), v.heads(), out.heads(), lse.heads(), a.mask, scale, {}, 0,
                          attention_dtype::fp8});

  const fp8_forward_scales s = fp8_forward_scales_of(amax(q), amax(k), amax(v));
  expect_current_scale(amax(q), s.q, fp8_e4m3_largest);
  expect_current_scale(amax(k), s.k, fp8_e4m3_largest);
  expect_current_scale(amax(v), s.v, fp8_e4m3_largest);
  f64::host_case h;
  for (const auto& [name, t, sc] : {std::tuple{"q", &q, s.q}, std::tuple{"k", &k, s.k}, std::tuple{"v", &v, s.v}}) {
    const tensor x = quantized(*be, *t, sc, fp8_format::e4m3);
    h[name] = std::vector<double>(x.as<float>(), x.as<float>() + x.numel());
  }
  h["out"].assign(static_cast<std::size_t>(out.numel()), 0.0);
  h["lse"].assign(static_cast<std::size_t>(lse.numel()), 0.0);
  f64::sdpa_forward(h, a.sq, a.skv, a.hq, a.hk, a.d, a.mask == attn_mask::causal, scale, {}, true);
  std::vector<double> want_out(h["out"].size());
  for (std::size_t i = 0; i < want_out.size(); ++i)
    want_out[i] = round_to_fp8(static_cast<float>(h["out"][i]) * s.o, fp8_format::e4m3) / s.o;
  EXPECT_LT(max_error(values(out), want_out), 1e-5);
  EXPECT_LT(max_error(values(lse), h["lse"]), 1e-5);

  // Quantizing changed the result, and by what E4M3 loses, not more.
  tensor exact = be->allocate(mem_tag::activations, dtype::f32, shape{a.sq, a.hq, a.d}, "exact");
  ops::sdpa_forward(*be, {q.heads(), k.heads(), v.heads(), exact.heads(), lse.heads(), a.mask, scale});
  const std::vector<float> e = values(exact);
  const double drift = max_error(values(out), std::vector<double>(e.begin(), e.end()));
  EXPECT_GT(drift, 1e-4);
  EXPECT_LT(drift, 0.15);
}

TEST_P(fp8_attention, backward_is_exact_on_quantized_inputs_with_bounded_outputs) {
  const shape_case a = GetParam();
  auto be = make_test_backend();
  std::mt19937 rng(9);
  tensor q = make_heads(*be, a.sq, a.hq, a.d, rng, 2.0f, "q"), k = make_heads(*be, a.skv, a.hk, a.d, rng, 3.0f, "k"),
         v = make_heads(*be, a.skv, a.hk, a.d, rng, 1.0f, "v");
  tensor d_o = make_heads(*be, a.sq, a.hq, a.d, rng, 1e-3f, "d_o");
  tensor out = be->allocate(mem_tag::activations, dtype::f32, shape{a.sq, a.hq, a.d}, "out");
  tensor lse = be->allocate(mem_tag::activations, dtype::f32, shape{a.sq, a.hq, 1}, "lse");
  const float scale = 1.0f / std::sqrt(static_cast<float>(a.d));
  ops::sdpa_forward(*be, {q.heads(), k.heads(), v.heads(), out.heads(), lse.heads(), a.mask, scale, {}, 0,
                          attention_dtype::fp8});
  const auto grads = [&](const char* label) {
    return std::array<tensor, 3>{be->allocate(mem_tag::activations, dtype::f32, shape{a.sq, a.hq, a.d}, label),
                                 be->allocate(mem_tag::activations, dtype::f32, shape{a.skv, a.hk, a.d}, label),
                                 be->allocate(mem_tag::activations, dtype::f32, shape{a.skv, a.hk, a.d}, label)};
  };
  std::array<tensor, 3> got = grads("fp8"), exact = grads("exact");
  ops::sdpa_backward(*be, {q.heads(), k.heads(), v.heads(), out.heads(), d_o.heads(), lse.heads(), got[0].heads(),
                           got[1].heads(), got[2].heads(), a.mask, scale, {}, 0, attention_dtype::fp8});

  const fp8_backward_scales s =
      fp8_backward_scales_of({amax(q), amax(k), amax(v), amax(out), amax(d_o)}, a.sq, a.d, scale);
  expect_current_scale(amax(d_o), s.d_o, fp8_e5m2_largest);
  expect_current_scale(amax(out), s.o, fp8_e4m3_largest);
  f64::host_case h;
  for (const auto& [name, t, sc, format] :
       {std::tuple{"q", &q, s.q, fp8_format::e4m3}, std::tuple{"k", &k, s.k, fp8_format::e4m3},
        std::tuple{"v", &v, s.v, fp8_format::e4m3}, std::tuple{"out", &out, s.o, fp8_format::e4m3},
        std::tuple{"d_out", &d_o, s.d_o, fp8_format::e5m2}}) {
    const tensor x = quantized(*be, *t, sc, format);
    h[name] = std::vector<double>(x.as<float>(), x.as<float>() + x.numel());
  }
  h["lse"] = std::vector<double>(lse.as<float>(), lse.as<float>() + lse.numel());
  h["d_q"].assign(static_cast<std::size_t>(got[0].numel()), 0.0);
  h["d_k"].assign(static_cast<std::size_t>(got[1].numel()), 0.0);
  h["d_v"].assign(static_cast<std::size_t>(got[2].numel()), 0.0);
  f64::sdpa_backward_fp8(h, a.sq, a.skv, a.hq, a.hk, a.d, a.mask == attn_mask::causal, scale, s.d_s);
  // The exact backward on the same quantized inputs: the inner roundings moved the result.
  const tensor q8 = quantized(*be, q, s.q, fp8_format::e4m3), k8 = quantized(*be, k, s.k, fp8_format::e4m3),
               v8 = quantized(*be, v, s.v, fp8_format::e4m3), o8 = quantized(*be, out, s.o, fp8_format::e4m3),
               d_o8 = quantized(*be, d_o, s.d_o, fp8_format::e5m2);
  ops::sdpa_backward(*be, {q8.heads(), k8.heads(), v8.heads(), o8.heads(), d_o8.heads(), lse.heads(),
                           exact[0].heads(), exact[1].heads(), exact[2].heads(), a.mask, scale});
  const float out_scales[3] = {s.d_q, s.d_k, s.d_v};
  const char* const names[3] = {"d_q", "d_k", "d_v"};
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(names[i]);
    std::vector<double> want;
    double top = 0;
    for (const double g : h[names[i]]) {
      top = std::max(top, std::fabs(g));
      want.push_back(round_to_fp8(static_cast<float>(g) * out_scales[i], fp8_format::e5m2) / out_scales[i]);
    }
    // The bound holds: nothing saturates at the scale chosen before the call.
    EXPECT_LE(top * out_scales[i], fp8_e5m2_largest);
    EXPECT_LT(max_error(values(got[i]), want), 1e-5);
    const std::vector<float> e = values(exact[i]);
    EXPECT_GT(max_error(values(got[i]), std::vector<double>(e.begin(), e.end())), 1e-4);
  }
}

INSTANTIATE_TEST_SUITE_P(shapes, fp8_attention, ::testing::ValuesIn(shapes));

// Zero inputs: every scale is 1 and the outputs are zeros, not NaN.
TEST(fp8_attention_edges, zero_inputs_give_zero_outputs) {
  auto be = make_test_backend();
  tensor q = be->allocate_zeroed(mem_tag::activations, dtype::f32, shape{8, 2, 64}, "q");
  tensor k = be->allocate_zeroed(mem_tag::activations, dtype::f32, shape{8, 2, 64}, "k");
  tensor v = be->allocate_zeroed(mem_tag::activations, dtype::f32, shape{8, 2, 64}, "v");
  tensor out = be->allocate(mem_tag::activations, dtype::f32, shape{8, 2, 64}, "out");
  tensor lse = be->allocate(mem_tag::activations, dtype::f32, shape{8, 2, 1}, "lse");
  ops::sdpa_forward(*be, {q.heads(), k.heads(), v.heads(), out.heads(), lse.heads(), attn_mask::causal, 0.125f, {}, 0,
                          attention_dtype::fp8});
  for (const float x : values(out)) EXPECT_EQ(x, 0.0f);
  EXPECT_EQ(fp8_scale(0.0f, fp8_e4m3_largest), 1.0f);
  EXPECT_EQ(fp8_scale(448.0f, fp8_e4m3_largest), 1.0f);
  EXPECT_EQ(fp8_scale(449.0f, fp8_e4m3_largest), 0.5f);
  EXPECT_EQ(fp8_scale(1.0f, fp8_e4m3_largest), 256.0f);
}

}  // namespace
}  // namespace upipe
