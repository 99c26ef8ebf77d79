// Owning tensors (move-only, freed back to their backend's arena) and the non-owning
// views that ops take: row-major matrices and token x head x dim blocks with strides.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/dtype.hpp"
#include "core/ledger.hpp"
#include "core/shape.hpp"

namespace upipe {

class backend;

// A row-major matrix: element (i, j) at data[i * ld + j]. Strides count elements.
struct mat_view {
  void* data = nullptr;
  dtype type = dtype::f32;
  std::int64_t rows = 0, cols = 0, ld = 0;

  // Rows [first, first + count) of this matrix.
  mat_view row_block(std::int64_t first, std::int64_t count) const;
  // Columns [first, first + count) of this matrix (same rows, same ld).
  mat_view col_block(std::int64_t first, std::int64_t count) const;
};

// tokens x heads x dim, dim contiguous: element (t, h, i) at
// data[t * token_stride + h * head_stride + i]. A log-sum-exp is dim = 1.
struct head_view {
  void* data = nullptr;
  dtype type = dtype::f32;
  std::int64_t tokens = 0, heads = 0, dim = 0;
  std::int64_t token_stride = 0, head_stride = 0;

  head_view token_block(std::int64_t first, std::int64_t count) const;
  head_view head_block(std::int64_t first, std::int64_t count) const;
};

// Memory owned by one backend's arena (device tags) or host pool (host tags).
class tensor {
 public:
  tensor() = default;
  tensor(backend* owner, std::size_t offset, void* data, std::size_t bytes, dtype type,
         const shape& dims, mem_tag tag, const char* label)
      : owner_(owner), offset_(offset), data_(data), bytes_(bytes), type_(type), dims_(dims),
        tag_(tag), label_(label) {}
  tensor(const tensor&) = delete;
  tensor& operator=(const tensor&) = delete;
  tensor(tensor&& other) noexcept { steal(other); }
  tensor& operator=(tensor&& other) noexcept {
    if (this != &other) {
      reset();
      steal(other);
    }
    return *this;
  }
  ~tensor() { reset(); }

  // Frees the memory now (the ledger sees it at once). Defined with its owner's release
  // in backend/backend.cpp.
  void reset() noexcept;
  bool empty() const { return owner_ == nullptr; }

  void* data() const { return data_; }
  template <class T>
  T* as() const { return static_cast<T*>(data_); }
  dtype type() const { return type_; }
  const shape& dims() const { return dims_; }
  std::int64_t numel() const { return dims_.numel(); }
  std::size_t bytes() const { return bytes_; }
  mem_tag tag() const { return tag_; }
  const char* label() const { return label_; }

  // Views: the first dimension as rows and the rest as columns; or (tokens, heads, dim)
  // for a rank-3 tensor.
  mat_view matrix() const;
  head_view heads() const;

 private:
  friend class backend;  // retag()
  void steal(tensor& other) noexcept {
    owner_ = other.owner_;
    offset_ = other.offset_;
    data_ = other.data_;
    bytes_ = other.bytes_;
    type_ = other.type_;
    dims_ = other.dims_;
    tag_ = other.tag_;
    label_ = other.label_;
    other.owner_ = nullptr;
    other.data_ = nullptr;
  }

  backend* owner_ = nullptr;
  std::size_t offset_ = 0;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  dtype type_ = dtype::f32;
  shape dims_;
  mem_tag tag_ = mem_tag::activations;
  const char* label_ = "";
};

}  // namespace upipe
