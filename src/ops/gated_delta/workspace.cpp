#include "ops/gated_delta/workspace.hpp"

#include <algorithm>

#include "ops/gated_delta/workspace_layout.hpp"

namespace upipe {

std::int64_t gated_delta_chunks(std::int64_t tokens) {
  return std::max<std::int64_t>(1, (tokens + gated_delta_workspace_layout::chunk - 1) /
                                       gated_delta_workspace_layout::chunk);
}

double gated_delta_flops(const gated_delta_shape& shape, gated_delta_pass pass) {
  const double c = gated_delta_workspace_layout::chunk, dk = static_cast<double>(shape.d_k);
  const double dv = static_cast<double>(shape.d_v), cube = c * c * c;
  // Multiply-adds of each stage for one chunk and value head.
  const double prepare = c * c * dk + cube / 6 + c * c * (dk + dv) / 2;
  const double state_pass = 2 * c * dk * dv, transition_pass = 2 * c * dk * dk;
  const double output = c * c * dk / 2 + c * dk * dv + c * c * dv / 2;
  const double intra_backward = c * c * dk / 2 + c * c * dv / 2;
  const double reverse_pass = 3 * c * dk * dv;
  const double wy_backward = c * c * dk + cube / 6 + 1.5 * c * c * dv + c * dk * dv + 2.5 * c * c * dk + cube;
  const double output_backward = 2 * c * c * dk + c * c * dv / 2 + 3 * c * dk * dv;
  double per_chunk = 0;
  switch (pass) {
    case gated_delta_pass::forward: per_chunk = prepare + state_pass + output; break;
    case gated_delta_pass::summary: per_chunk = prepare + state_pass + transition_pass; break;
    case gated_delta_pass::summary_backward: per_chunk = prepare + intra_backward + reverse_pass; break;
    case gated_delta_pass::backward:
      per_chunk = 2 * (prepare + state_pass) + intra_backward + reverse_pass + wy_backward + output_backward;
      break;
  }
  return 2.0 * per_chunk * static_cast<double>(gated_delta_chunks(shape.tokens)) * static_cast<double>(shape.v_heads);
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
