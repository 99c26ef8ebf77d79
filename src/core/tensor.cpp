#include "core/tensor.hpp"

#include "core/error.hpp"

namespace upipe {

namespace {
void* offset_ptr(void* data, dtype type, std::int64_t elements) {
  if (data == nullptr) return nullptr;  // meta: shapes only
  return static_cast<char*>(data) + elements * static_cast<std::int64_t>(dtype_size(type));
}
}  // namespace

mat_view mat_view::row_block(std::int64_t first, std::int64_t count) const {
  UPIPE_CHECK(first >= 0 && count >= 0 && first + count <= rows, "row block out of range");
  return {offset_ptr(data, type, first * ld), type, count, cols, ld};
}

mat_view mat_view::col_block(std::int64_t first, std::int64_t count) const {
  UPIPE_CHECK(first >= 0 && count >= 0 && first + count <= cols, "column block out of range");
  return {offset_ptr(data, type, first), type, rows, count, ld};
}

head_view head_view::token_block(std::int64_t first, std::int64_t count) const {
  UPIPE_CHECK(first >= 0 && count >= 0 && first + count <= tokens, "token block out of range");
  return {offset_ptr(data, type, first * token_stride), type, count, heads, dim, token_stride, head_stride};
}

head_view head_view::head_block(std::int64_t first, std::int64_t count) const {
  UPIPE_CHECK(first >= 0 && count >= 0 && first + count <= heads, "head block out of range");
  return {offset_ptr(data, type, first * head_stride), type, tokens, count, dim, token_stride, head_stride};
}

mat_view tensor::matrix() const {
  const std::int64_t rows = dims_.rank == 0 ? 1 : dims_[0];
  std::int64_t cols = 1;  // the product of the other dimensions, also when there are no rows
  for (int i = 1; i < dims_.rank; ++i) cols *= dims_[i];
  return {data_, type_, rows, cols, cols};
}

head_view tensor::heads() const {
  UPIPE_CHECK(dims_.rank == 3, "heads() needs a (tokens, heads, dim) tensor, got " + dims_.str());
  return {data_, type_, dims_[0], dims_[1], dims_[2], dims_[1] * dims_[2], dims_[2]};
}

}  // namespace upipe
