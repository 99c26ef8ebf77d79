// Reference layout ops on (tokens, heads, dim) views: copy with dtype conversion (the
// all-to-all pack/unpack), accumulate (fp32 sums stored to an f32 or bf16 dst), fill.
// f32 and bf16 both work here.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops/cpu/cpu_ops.hpp"

namespace upipe::cpu {

namespace {

// Address of element (t, h, 0) of a view, in bytes.
void* row_ptr(const head_view& v, std::int64_t t, std::int64_t h) {
  const auto offset = (t * v.token_stride + h * v.head_stride) * static_cast<std::int64_t>(dtype_size(v.type));
  return static_cast<char*>(v.data) + offset;
}

void load_row(const head_view& v, std::int64_t t, std::int64_t h, float* out) {
  if (v.type == dtype::f32) {
    std::memcpy(out, row_ptr(v, t, h), static_cast<std::size_t>(v.dim) * sizeof(float));
    return;
  }
  const auto* src = static_cast<const std::uint16_t*>(row_ptr(v, t, h));
  for (std::int64_t i = 0; i < v.dim; ++i) out[i] = bf16_to_float(src[i]);
}

void store_row(const head_view& v, std::int64_t t, std::int64_t h, const float* in) {
  if (v.type == dtype::f32) {
    std::memcpy(row_ptr(v, t, h), in, static_cast<std::size_t>(v.dim) * sizeof(float));
    return;
  }
  auto* dst = static_cast<std::uint16_t*>(row_ptr(v, t, h));
  for (std::int64_t i = 0; i < v.dim; ++i) dst[i] = float_to_bf16(in[i]);
}

}  // namespace

void run(const copy_heads_args& args) {
  const head_view& dst = args.dst;
  const head_view& src = args.src;
  std::vector<float> row(static_cast<std::size_t>(src.dim));
  for (std::int64_t t = 0; t < src.tokens; ++t)
    for (std::int64_t h = 0; h < src.heads; ++h) {
      load_row(src, t, h, row.data());
      store_row(dst, t, h, row.data());
    }
}

// The sum is formed in fp32 and stored once, so a bf16 dst rounds once per add.
void run(const add_heads_args& args) {
  const head_view& dst = args.dst;
  const head_view& src = args.src;
  std::vector<float> sum(static_cast<std::size_t>(src.dim)), row(static_cast<std::size_t>(src.dim));
  for (std::int64_t t = 0; t < src.tokens; ++t)
    for (std::int64_t h = 0; h < src.heads; ++h) {
      load_row(dst, t, h, sum.data());
      load_row(src, t, h, row.data());
      for (std::int64_t i = 0; i < src.dim; ++i) sum[i] += row[i];
      store_row(dst, t, h, sum.data());
    }
}

void run(const fill_heads_args& args) {
  const head_view& dst = args.dst;
  const float value = args.value;
  std::vector<float> row(static_cast<std::size_t>(dst.dim), value);
  for (std::int64_t t = 0; t < dst.tokens; ++t)
    for (std::int64_t h = 0; h < dst.heads; ++h) store_row(dst, t, h, row.data());
}

}  // namespace upipe::cpu
