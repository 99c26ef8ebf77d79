// What the sub-group tests share: cpu backends for the ranks of a group, float buffers, and
// values that name where they came from.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.hpp"

namespace upipe::testing {

// One cpu backend per rank (16 MiB arenas).
struct cpu_ranks {
  explicit cpu_ranks(int size) {
    for (int r = 0; r < size; ++r) {
      owned.push_back(make_cpu_backend({std::size_t{16} << 20, std::size_t{1} << 20}));
      ranks.push_back(owned.back().get());
    }
  }
  std::vector<std::unique_ptr<backend>> owned;
  std::vector<backend*> ranks;
};

inline tensor floats(backend& be, std::int64_t n) { return be.allocate(mem_tag::comm, dtype::f32, shape{n}, "test"); }
inline float* at(const tensor& t) { return static_cast<float*>(t.data()); }

// A value that names the (parent or world) rank it came from, the chunk and the element.
inline float value(int rank, int chunk, int i) { return static_cast<float>(rank * 1000 + chunk * 10 + i); }

}  // namespace upipe::testing
