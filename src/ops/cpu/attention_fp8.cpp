// FP8 attention on the cpu backend, its definition (ops/fp8_attention.hpp): the inputs
// quantized with the scales cuDNN's FP8 kernels are given (round to nearest even,
// saturating) and dequantized, attention on those values (attention.cpp) with the roundings
// the kernels make inside (P in E4M3 where it meets V or dO, dS in E5M2 where it meets K and
// Q), and the outputs quantized as the Hopper kernels write them. The softmax statistics
// stay fp32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/dtype.hpp"
#include "ops/cpu/cpu_ops.hpp"
#include "ops/fp8_attention.hpp"

namespace upipe::cpu {

namespace {

float* row_at(const head_view& v, std::int64_t t, std::int64_t h) {
  return static_cast<float*>(v.data) + t * v.token_stride + h * v.head_stride;
}

float amax_of(const head_view& v) {
  float amax = 0.0f;
  for (std::int64_t t = 0; t < v.tokens; ++t)
    for (std::int64_t h = 0; h < v.heads; ++h) {
      const float* row = row_at(v, t, h);
      for (std::int64_t x = 0; x < v.dim; ++x) amax = std::max(amax, std::fabs(row[x]));
    }
  return amax;
}

// x -> fp8(x scale) / scale on every element of v, in place.
void quantize_in_place(const head_view& v, float scale, fp8_format format) {
  for (std::int64_t t = 0; t < v.tokens; ++t)
    for (std::int64_t h = 0; h < v.heads; ++h) {
      float* row = row_at(v, t, h);
      for (std::int64_t x = 0; x < v.dim; ++x) row[x] = round_to_fp8(row[x] * scale, format) / scale;
    }
}

// A dequantized copy of an input, packed (tokens, heads, dim).
class quantized_copy {
 public:
  quantized_copy(const head_view& src, float scale, fp8_format format)
      : values_(static_cast<std::size_t>(src.tokens * src.heads * src.dim)) {
    view_ = {values_.data(), dtype::f32, src.tokens, src.heads, src.dim, src.heads * src.dim, src.dim};
    for (std::int64_t t = 0; t < src.tokens; ++t)
      for (std::int64_t h = 0; h < src.heads; ++h) std::copy_n(row_at(src, t, h), src.dim, row_at(view_, t, h));
    quantize_in_place(view_, scale, format);
  }
  const head_view& view() const { return view_; }

 private:
  std::vector<float> values_;
  head_view view_;
};

}  // namespace

void run_fp8(const sdpa_forward_args& args) { run_fp8(args, fp8_inner_rounding{}); }
void run_fp8(const sdpa_backward_args& args) { run_fp8(args, fp8_inner_rounding{}); }

void run_fp8(const sdpa_forward_args& args, const fp8_inner_rounding& reading) {
  const fp8_forward_scales s = fp8_forward_scales_of(amax_of(args.q), amax_of(args.k), amax_of(args.v));
  const quantized_copy q(args.q, s.q, fp8_format::e4m3), k(args.k, s.k, fp8_format::e4m3),
      v(args.v, s.v, fp8_format::e4m3);
  sdpa_forward_args quantized = args;
  quantized.q = q.view();
  quantized.k = k.view();
  quantized.v = v.view();
  fp8_inner_rounding inner = reading;
  inner.on = true;
  run_attention(quantized, inner);
  quantize_in_place(args.out, s.o, fp8_format::e4m3);
}

void run_fp8(const sdpa_backward_args& args, const fp8_inner_rounding& reading) {
  const fp8_backward_amax a{amax_of(args.q), amax_of(args.k), amax_of(args.v), amax_of(args.out),
                            amax_of(args.d_out)};
  const fp8_backward_scales s = fp8_backward_scales_of(a, args.q.tokens, args.q.dim, args.scale);
  const quantized_copy q(args.q, s.q, fp8_format::e4m3), k(args.k, s.k, fp8_format::e4m3),
      v(args.v, s.v, fp8_format::e4m3), out(args.out, s.o, fp8_format::e4m3),
      d_out(args.d_out, s.d_o, fp8_format::e5m2);
  sdpa_backward_args quantized = args;
  quantized.q = q.view();
  quantized.k = k.view();
  quantized.v = v.view();
  quantized.out = out.view();
  quantized.d_out = d_out.view();
  fp8_inner_rounding inner = reading;
  inner.on = true;
  inner.d_s_scale = s.d_s;
  run_attention(quantized, inner);
  quantize_in_place(args.d_q, s.d_q, fp8_format::e5m2);
  quantize_in_place(args.d_k, s.d_k, fp8_format::e5m2);
  quantize_in_place(args.d_v, s.d_v, fp8_format::e5m2);
}

}  // namespace upipe::cpu
