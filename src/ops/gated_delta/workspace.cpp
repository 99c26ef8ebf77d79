#include "ops/gated_delta/workspace.hpp"

#include <algorithm>

#include "ops/gated_delta/workspace_layout.hpp"

namespace upipe {

std::int64_t gated_delta_chunks(std::int64_t tokens) {
  return std::max<std::int64_t>(1, (tokens + gated_delta_workspace_layout::chunk - 1) /
                                       gated_delta_workspace_layout::chunk);
}

std::int64_t gated_delta_workspace_floats(const gated_delta_shape& shape, gated_delta_pass pass,
                                          std::int64_t chunks_per_pass) {
  return gated_delta_workspace_layout(shape, pass, chunks_per_pass).floats;
}

std::int64_t gated_delta_chunks_per_pass(const gated_delta_shape& shape, gated_delta_pass pass,
                                         std::int64_t floats) {
  // Not monotone in the chunks a pass holds (the backward's boundary states shrink as the
  // passes lengthen): the longest pass that fits, counted down.
  for (std::int64_t chunks = gated_delta_chunks(shape.tokens); chunks >= 1; --chunks)
    if (gated_delta_workspace_floats(shape, pass, chunks) <= floats) return chunks;
  return 0;
}

}  // namespace upipe
