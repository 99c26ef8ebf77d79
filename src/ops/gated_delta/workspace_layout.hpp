// Where each buffer of a gated-delta-rule op lies in its workspace (ops/gated_delta/
// workspace.hpp), in f32 elements from the workspace's start. Every backend reads this
// one layout, so the sizes the callers allocate are the ones the implementations use.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ops/gated_delta/workspace.hpp"

namespace upipe {

struct gated_delta_workspace_layout {
  static constexpr std::int64_t chunk = 64;

  std::int64_t chunks = 0;          // the sequence's
  std::int64_t pass_chunks = 0;     // a pass's (the last may hold fewer)
  std::int64_t passes = 0;
  // Per pass of pass_chunks * 64 rows r (local to the pass), v head h:
  std::int64_t w = -1;              // (rows, H_v, d_k): the WY factor T diag(beta gamma) k
  std::int64_t u = -1;              // (rows, H_v, d_v): T diag(beta) v, then delta = u - w S
  std::int64_t decay = -1;          // (rows, H_v): the cumulative log-decay inside the chunk
  std::int64_t segment = -1;        // (rows): the document index inside the chunk (as f32)
  std::int64_t states = -1;         // (pass_chunks, H_v, d_k, d_v): the state entering each chunk
  std::int64_t carry = -1;          // (H_v, d_k, d_v): the state between passes
  std::int64_t transition = -1;     // (H_v, d_k, d_k): summary: the transition between passes
  std::int64_t d_delta = -1;        // (rows, H_v, d_v): backward: d delta
  std::int64_t d_state_end = -1;    // (pass_chunks, H_v, d_k, d_v): d of each chunk's last state
  std::int64_t d_carry = -1;        // (H_v, d_k, d_v): d state between passes
  std::int64_t d_q_heads = -1;      // (rows, H_v, d_k): backward: d q per value head
  std::int64_t d_k_heads = -1;      // (rows, H_v, d_k)
  std::int64_t boundaries = -1;     // (passes, H_v, d_k, d_v): backward: the state entering each pass
  std::int64_t floats = 0;

  gated_delta_workspace_layout(const gated_delta_shape& s, gated_delta_pass pass, std::int64_t chunks_per_pass) {
    chunks = std::max<std::int64_t>(1, (s.tokens + chunk - 1) / chunk);
    pass_chunks = std::clamp<std::int64_t>(chunks_per_pass, 1, chunks);
    passes = (chunks + pass_chunks - 1) / pass_chunks;
    const std::int64_t rows = pass_chunks * chunk, h = s.v_heads, state = h * s.d_k * s.d_v;
    const bool backward = pass == gated_delta_pass::backward;
    const bool summary_backward = pass == gated_delta_pass::summary_backward;
    w = take(rows * h * s.d_k);
    if (!summary_backward) u = take(rows * h * s.d_v);
    decay = take(rows * h);
    segment = take(rows);
    if (pass == gated_delta_pass::forward || backward) states = take(pass_chunks * state);
    if (!summary_backward) carry = take(state);
    if (pass == gated_delta_pass::summary) transition = take(h * s.d_k * s.d_k);
    if (backward || summary_backward) {
      d_delta = take(rows * h * s.d_v);
      d_carry = take(state);
    }
    if (backward) {
      d_state_end = take(pass_chunks * state);
      d_q_heads = take(rows * h * s.d_k);
      d_k_heads = take(rows * h * s.d_k);
      boundaries = take(passes * state);
    }
  }

 private:
  std::int64_t take(std::int64_t n) {
    const std::int64_t at = floats;
    floats += (n + 63) / 64 * 64;  // each buffer from a 256-byte boundary
    return at;
  }
};

}  // namespace upipe
