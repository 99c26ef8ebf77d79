// Shapes of up to four dimensions, row-major.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace upipe {

struct shape {
  std::array<std::int64_t, 4> dims{};
  int rank = 0;

  shape() = default;
  shape(std::initializer_list<std::int64_t> d) {
    UPIPE_CHECK(d.size() <= dims.size(), "at most 4 dimensions");
    for (auto v : d) dims[rank++] = v;
  }
  std::int64_t operator[](int i) const { return dims[i]; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < rank; ++i) n *= dims[i];
    return n;
  }
  bool operator==(const shape& o) const = default;
  std::string str() const {
    std::string s = "[";
    for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
    return s + "]";
  }
};

// The elements of a tensor of these dimensions (a parameter's or a file's shape).
inline std::int64_t element_count(const std::vector<std::int64_t>& dims) {
  std::int64_t n = 1;
  for (const std::int64_t d : dims) n *= d;
  return n;
}

}  // namespace upipe
