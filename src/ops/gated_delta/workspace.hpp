// The device memory a gated-delta-rule op works in (its `workspace` argument): the chunk
// buffers of one pass over `chunks_per_pass` chunks of 64 rows (the WY factors, the
// pseudo-values, the chunks' cumulative decays and states) and, for the backward, the
// states at the passes' boundaries. A caller sizes it here, allocates it from the arena
// (so the meta backend and the planner count it) and frees it after the op. A larger
// workspace lets a pass hold more chunks: fewer, longer sequential passes over the states.
#pragma once

#include <cstdint>

namespace upipe {

struct gated_delta_shape {
  std::int64_t tokens = 0, k_heads = 0, v_heads = 0, d_k = 0, d_v = 0;
};

enum class gated_delta_pass : std::uint8_t { forward, backward, summary, summary_backward };

// The f32 elements the op needs with `chunks_per_pass` chunks a pass (>= 1; more than the
// sequence has count as all of them).
std::int64_t gated_delta_workspace_floats(const gated_delta_shape& shape, gated_delta_pass pass,
                                          std::int64_t chunks_per_pass);

// The most chunks a pass holds in `floats` elements (at most the sequence's chunks); 0 when
// no pass length fits.
std::int64_t gated_delta_chunks_per_pass(const gated_delta_shape& shape, gated_delta_pass pass,
                                         std::int64_t floats);

// The FLOPs (2 per multiply-add) of the chunked algorithm's stages for one call, from their
// loops: per chunk of C = 64 rows and value head, the C x C products (k k^T, q k^T, the WY
// factors and their inverse, the in-chunk outputs) and the state's d_k x d_v ones; the
// backward recomputes the forward's states (prepare and state_pass twice).
double gated_delta_flops(const gated_delta_shape& shape, gated_delta_pass pass);

// The sequence's chunks: ceil(tokens / 64), at least 1.
std::int64_t gated_delta_chunks(std::int64_t tokens);

}  // namespace upipe
