// What the chunked gated delta rule's stages share: their parameters (one struct, passed
// by value to every kernel), the chunk geometry, the masks of packed documents inside a
// chunk and the loads of normalized q and k rows. docs/design.md, "Gated DeltaNet ops",
// gives the algorithm; ops/gated_delta/recurrent.hpp the definition it is held to.
//
// Notation of one chunk of C = 64 rows (the last may hold fewer, L; rows past L are zero)
// and one value head: G_i the cumulative log-decay inside the chunk, seg_i the number of
// document starts at or before row i inside it, and
//   M_ij   = seg_i == seg_j ? exp(G_i - G_j) : 0          (j <= i) the decay from j to i,
//   gam_i  = seg_i == 0 ? exp(G_i) : 0                     the decay of the entering state,
//   lam_j  = seg_j == seg_last ? exp(G_last - G_j) : 0      the decay from j to the chunk's end,
//   gam_end = seg_last == 0 ? exp(G_last) : 0.
#pragma once

#include <cmath>
#include <cstdint>

#include "ops/gated_delta/block.hpp"

namespace upipe::gated_delta {

inline constexpr int chunk = 64;
inline constexpr int state_slice = 32;  // state columns per block of the sequential passes
inline constexpr int max_resets = 64;   // document starts one prepare launch carries

// How a sequential pass starts its state: zero, from `start` (an initial state, a carry or
// d_final_state), or the identity (a summary's transition).
enum class state_start : std::uint8_t { zero, given, identity };

struct stage_params {
  // The problem.
  std::int64_t s = 0, hk = 0, hv = 0, dk = 0, dv = 0;
  float scale = 1, eps = 1e-6f;
  bool l2 = true;
  tensor3 q, k, v, out, d_out, d_q, d_k, d_v;
  matrix_f32 g, beta, d_g, d_beta;
  // The pass: chunks [pass_first, pass_first + pass_chunks) of the sequence.
  std::int64_t pass_first = 0, pass_chunks = 0;
  // The workspace's buffers (ops/gated_delta/workspace_layout.hpp), rows local to the pass.
  float* w = nullptr;            // (rows, hv, dk)
  float* u = nullptr;            // (rows, hv, dv): u, then delta
  float* decay = nullptr;        // (rows, hv)
  float* segment = nullptr;      // (rows)
  float* states = nullptr;       // (pass_chunks, hv, dk, dv)
  float* d_delta = nullptr;      // (rows, hv, dv)
  float* d_state_end = nullptr;  // (pass_chunks, hv, dk, dv)
  float* d_q_heads = nullptr;    // (rows, hv, dk)
  float* d_k_heads = nullptr;    // (rows, hv, dk)
  // A sequential pass (state_pass, reverse_pass) over `cols` state columns.
  std::int64_t cols = 0;
  const float* values = nullptr;  // (rows, hv, cols): the pass's u, or null (zero values)
  float* delta_out = nullptr;     // (rows, hv, cols) or null; may be `values`
  float* states_out = nullptr;    // (pass_chunks, hv, dk, cols) or null
  state_start start = state_start::zero;
  stack_f32 start_state;          // (hv, dk, cols) where start is given
  stack_f32 entry_out;            // the state the pass starts from, or empty
  stack_f32 carry_out;            // the state it ends with, or empty
  // prepare: chunks [sub_first, sub_first + sub_chunks) of the pass, and the document
  // starts inside them as rows of the segment.
  std::int64_t sub_first = 0, sub_chunks = 0;
  int resets = 0;
  std::int64_t reset_rows[max_resets] = {};
};

// The rows of the pass's chunk `local` (0-based in the pass) that hold data.
UPIPE_HD_INLINE int chunk_rows(const stage_params& p, std::int64_t local) {
  const std::int64_t first = (p.pass_first + local) * chunk;
  const std::int64_t left = p.s - first;
  return static_cast<int>(left < chunk ? left : chunk);
}
UPIPE_HD_INLINE std::int64_t chunk_first_row(const stage_params& p, std::int64_t local) {
  return (p.pass_first + local) * chunk;
}

// The per-chunk vectors of one head in shared memory.
struct chunk_vectors {
  float* decay;    // G
  float* segment;  // seg
  float* gam;      // gam_i
  float* lam;      // lam_j
  float* beta;
  float* inv;      // a row's inverse norm (scratch of the loads)
};
inline constexpr int chunk_vector_count = 6;
UPIPE_HD_INLINE chunk_vectors carve_vectors(float* smem) {
  return {smem, smem + chunk, smem + 2 * chunk, smem + 3 * chunk, smem + 4 * chunk, smem + 5 * chunk};
}

UPIPE_HD_INLINE float decay_between(const chunk_vectors& cv, int i, int j) {
  return cv.segment[i] == cv.segment[j] ? expf(cv.decay[i] - cv.decay[j]) : 0.0f;
}

// Reads G and seg of chunk `local` from the workspace (written by prepare) and forms gam,
// lam and beta; returns after a sync. gam_end is gam_of_end(cv, rows).
template <class B>
UPIPE_HD void load_chunk_vectors(const B& b, const stage_params& p, std::int64_t local, std::int64_t h,
                                 const chunk_vectors& cv) {
  const int rows = chunk_rows(p, local);
  const std::int64_t base = local * chunk;
  b.for_each(chunk, [&](std::int64_t r) {
    cv.decay[r] = p.decay[(base + r) * p.hv + h];
    cv.segment[r] = p.segment[base + r];
    cv.beta[r] = r < rows ? p.beta.at(chunk_first_row(p, local) + r, h) : 0.0f;
  });
  b.sync();
  b.for_each(chunk, [&](std::int64_t r) {
    const int last = rows - 1;
    cv.gam[r] = cv.segment[r] == 0.0f ? expf(cv.decay[r]) : 0.0f;
    cv.lam[r] = cv.segment[r] == cv.segment[last] ? expf(cv.decay[last] - cv.decay[r]) : 0.0f;
  });
  b.sync();
}

UPIPE_HD_INLINE float gam_of_end(const chunk_vectors& cv, int rows) {
  return cv.segment[rows - 1] == 0.0f ? expf(cv.decay[rows - 1]) : 0.0f;
}

// tile[r * ld + m] = the chunk's row r of x's head `head`, L2-normalized where p.l2, times
// `scale` and, where `row_scale` is given, times row_scale[r]; rows past the chunk's zero.
// inv[r] gets the row's inverse norm (1 without l2). Returns after a sync.
template <class B>
UPIPE_HD void load_normalized(const B& b, const stage_params& p, const tensor3& x, std::int64_t local,
                              std::int64_t head, float scale, const float* row_scale, float* tile, int ld,
                              float* inv) {
  const int rows = chunk_rows(p, local), dim = static_cast<int>(p.dk);
  const std::int64_t first = chunk_first_row(p, local);
  b.for_each(static_cast<std::int64_t>(chunk) * dim, [&](std::int64_t e) {
    const int r = static_cast<int>(e / dim), m = static_cast<int>(e % dim);
    tile[r * ld + m] = r < rows ? x.load(first + r, head, m) : 0.0f;
  });
  b.sync();
  b.for_each(chunk, [&](std::int64_t r) {
    float sum = 0.0f;
    for (int m = 0; m < dim; ++m) sum += tile[r * ld + m] * tile[r * ld + m];
    inv[r] = p.l2 ? 1.0f / sqrtf(sum + p.eps) : 1.0f;
  });
  b.sync();
  b.for_each(static_cast<std::int64_t>(chunk) * dim, [&](std::int64_t e) {
    const int r = static_cast<int>(e / dim), m = static_cast<int>(e % dim);
    tile[r * ld + m] *= inv[r] * scale * (row_scale != nullptr ? row_scale[r] : 1.0f);
  });
  b.sync();
}

// Index helpers of the (rows, hv, cols) buffers.
UPIPE_HD_INLINE std::int64_t row_head(const stage_params& p, std::int64_t row, std::int64_t h, std::int64_t cols) {
  return (row * p.hv + h) * cols;
}

}  // namespace upipe::gated_delta
