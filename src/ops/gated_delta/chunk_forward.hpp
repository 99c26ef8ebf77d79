// The chunked gated delta rule's forward stages (docs/design.md, "Gated DeltaNet ops"):
//   prepare     per chunk and head, in parallel: G, seg, the WY factors
//               T = (I + strict_lower(diag(beta) (k k^T o M)))^-1, w = T diag(beta gam) k and
//               u = T diag(beta) v;
//   state_pass  per head and slice of state columns, chunk after chunk: the state S entering
//               each chunk, delta = u - w S, S <- gam_end S + (diag(lam) k)^T delta;
//   output      per chunk and head, in parallel: o = diag(gam) q S + ((q k^T) o M) delta.
#pragma once

#include "ops/gated_delta/chunk_common.hpp"

namespace upipe::gated_delta {

// Shared memory of each stage, in floats; tiles carry one float of padding a row so that
// a column's reads fall in different banks.
UPIPE_HD_INLINE int tile_ld(std::int64_t cols) { return static_cast<int>(cols) + 1; }
UPIPE_HD_INLINE std::int64_t tile_floats(std::int64_t cols) { return chunk * (cols + 1); }

inline std::int64_t prepare_smem_floats(std::int64_t dk, std::int64_t dv) {
  return chunk_vector_count * chunk + tile_floats(dk) + tile_floats(dv) + 2 * tile_floats(chunk);
}

// One block per (chunk of the sub-range, value head).
template <class B>
UPIPE_HD void prepare(const B& b, const stage_params& p, std::int64_t bx, std::int64_t h, float* smem) {
  const std::int64_t local = p.sub_first + bx, kh = h / (p.hv / p.hk);
  const int rows = chunk_rows(p, local), dk = static_cast<int>(p.dk), dv = static_cast<int>(p.dv);
  const std::int64_t first = chunk_first_row(p, local), base = local * chunk;
  const chunk_vectors cv = carve_vectors(smem);
  float* k_tile = smem + chunk_vector_count * chunk;
  float* v_tile = k_tile + tile_floats(dk);
  float* a = v_tile + tile_floats(dv);
  float* t = a + tile_floats(chunk);
  const int kl = tile_ld(dk), vl = tile_ld(dv), cl = tile_ld(chunk);
  // g (in lam, as scratch), beta and the documents inside the chunk.
  b.for_each(chunk, [&](std::int64_t r) {
    cv.lam[r] = r < rows ? p.g.at(first + r, h) : 0.0f;
    cv.beta[r] = r < rows ? p.beta.at(first + r, h) : 0.0f;
    int seg = 0;
    for (int n = 0; n < p.resets; ++n) seg += p.reset_rows[n] >= first && p.reset_rows[n] <= first + r;
    cv.segment[r] = static_cast<float>(seg);
  });
  b.sync();
  b.for_each(chunk, [&](std::int64_t r) {
    float sum = 0.0f;
    for (int n = 0; n <= r; ++n) sum += cv.lam[n];
    cv.decay[r] = sum;
    cv.gam[r] = cv.segment[r] == 0.0f ? expf(sum) : 0.0f;
    p.decay[(base + r) * p.hv + h] = sum;
    if (h == 0) p.segment[base + r] = cv.segment[r];
  });
  b.sync();
  load_normalized(b, p, p.k, local, kh, 1.0f, nullptr, k_tile, kl, cv.inv);
  b.for_each(chunk * chunk, [&](std::int64_t e) {
    const int i = static_cast<int>(e / chunk), j = static_cast<int>(e % chunk);
    float value = 0.0f;
    if (j < i) {
      float dot = 0.0f;
      for (int m = 0; m < dk; ++m) dot += k_tile[i * kl + m] * k_tile[j * kl + m];
      value = cv.beta[i] * decay_between(cv, i, j) * dot;
    }
    a[i * cl + j] = value;
  });
  b.sync();
  // T = (I + A)^-1 by forward substitution, a row at a time: T_i = e_i - sum_{j<i} A_ij T_j.
  for (int i = 0; i < chunk; ++i) {
    b.for_each(chunk, [&](std::int64_t m) {
      float sum = i == m ? 1.0f : 0.0f;
      for (int j = static_cast<int>(m); j < i; ++j) sum -= a[i * cl + j] * t[j * cl + m];
      t[i * cl + m] = m <= i ? sum : 0.0f;
    });
    b.sync();
  }
  b.for_each(static_cast<std::int64_t>(chunk) * dk, [&](std::int64_t e) {
    const int i = static_cast<int>(e / dk), m = static_cast<int>(e % dk);
    float sum = 0.0f;
    for (int j = 0; j <= i; ++j) sum += t[i * cl + j] * cv.beta[j] * cv.gam[j] * k_tile[j * kl + m];
    p.w[row_head(p, base + i, h, dk) + m] = sum;
  });
  if (p.u == nullptr) return;
  b.for_each(static_cast<std::int64_t>(chunk) * dv, [&](std::int64_t e) {
    const int r = static_cast<int>(e / dv), c = static_cast<int>(e % dv);
    v_tile[r * vl + c] = r < rows ? p.v.load(first + r, h, c) : 0.0f;
  });
  b.sync();
  b.for_each(static_cast<std::int64_t>(chunk) * dv, [&](std::int64_t e) {
    const int i = static_cast<int>(e / dv), c = static_cast<int>(e % dv);
    float sum = 0.0f;
    for (int j = 0; j <= i; ++j) sum += t[i * cl + j] * cv.beta[j] * v_tile[j * vl + c];
    p.u[row_head(p, base + i, h, dv) + c] = sum;
  });
}

inline std::int64_t state_pass_smem_floats(std::int64_t dk) {
  return chunk_vector_count * chunk + dk * state_slice + 2 * tile_floats(dk) + chunk * state_slice;
}

// One block per (value head, slice of state_slice columns of p.cols), through the pass's
// chunks in order.
template <class B>
UPIPE_HD void state_pass(const B& b, const stage_params& p, std::int64_t h, std::int64_t slice, float* smem) {
  const std::int64_t kh = h / (p.hv / p.hk), c0 = slice * state_slice;
  const int dk = static_cast<int>(p.dk), nc = static_cast<int>(p.cols - c0 < state_slice ? p.cols - c0 : state_slice);
  const chunk_vectors cv = carve_vectors(smem);
  float* st = smem + chunk_vector_count * chunk;  // (dk, state_slice)
  float* w_tile = st + dk * state_slice;
  float* k_tile = w_tile + tile_floats(dk);
  float* delta = k_tile + tile_floats(dk);        // (chunk, state_slice)
  const int kl = tile_ld(dk);
  b.for_each(static_cast<std::int64_t>(dk) * nc, [&](std::int64_t e) {
    const int i = static_cast<int>(e / nc), c = static_cast<int>(e % nc);
    float value = 0.0f;
    if (p.start == state_start::given) value = p.start_state.at(h, i, c0 + c);
    if (p.start == state_start::identity) value = i == c0 + c ? 1.0f : 0.0f;
    st[i * state_slice + c] = value;
    if (!p.entry_out.empty()) p.entry_out.at(h, i, c0 + c) = value;
  });
  b.sync();
  for (std::int64_t local = 0; local < p.pass_chunks; ++local) {
    const int rows = chunk_rows(p, local);
    const std::int64_t base = local * chunk;
    load_chunk_vectors(b, p, local, h, cv);
    b.for_each(static_cast<std::int64_t>(chunk) * dk, [&](std::int64_t e) {
      const int r = static_cast<int>(e / dk), m = static_cast<int>(e % dk);
      w_tile[r * kl + m] = p.w[row_head(p, base + r, h, dk) + m];
    });
    if (p.states_out != nullptr)
      b.for_each(static_cast<std::int64_t>(dk) * nc, [&](std::int64_t e) {
        const int i = static_cast<int>(e / nc), c = static_cast<int>(e % nc);
        p.states_out[((local * p.hv + h) * dk + i) * p.cols + c0 + c] = st[i * state_slice + c];
      });
    b.sync();
    b.for_each(static_cast<std::int64_t>(chunk) * nc, [&](std::int64_t e) {
      const int r = static_cast<int>(e / nc), c = static_cast<int>(e % nc);
      float sum = p.values != nullptr ? p.values[row_head(p, base + r, h, p.cols) + c0 + c] : 0.0f;
      for (int m = 0; m < dk; ++m) sum -= w_tile[r * kl + m] * st[m * state_slice + c];
      delta[r * state_slice + c] = sum;
      if (p.delta_out != nullptr) p.delta_out[row_head(p, base + r, h, p.cols) + c0 + c] = sum;
    });
    b.sync();
    load_normalized(b, p, p.k, local, kh, 1.0f, cv.lam, k_tile, kl, cv.inv);
    const float gam_end = gam_of_end(cv, rows);
    b.for_each(static_cast<std::int64_t>(dk) * nc, [&](std::int64_t e) {
      const int m = static_cast<int>(e / nc), c = static_cast<int>(e % nc);
      float sum = gam_end * st[m * state_slice + c];
      for (int r = 0; r < chunk; ++r) sum += k_tile[r * kl + m] * delta[r * state_slice + c];
      st[m * state_slice + c] = sum;
    });
    b.sync();
  }
  if (!p.carry_out.empty())
    b.for_each(static_cast<std::int64_t>(dk) * nc, [&](std::int64_t e) {
      const int i = static_cast<int>(e / nc), c = static_cast<int>(e % nc);
      p.carry_out.at(h, i, c0 + c) = st[i * state_slice + c];
    });
}

inline std::int64_t output_smem_floats(std::int64_t dk, std::int64_t dv) {
  return chunk_vector_count * chunk + 2 * tile_floats(dk) + tile_floats(chunk) + tile_floats(dv);
}

// q k^T o M on and below the diagonal: p_tile (chunk x chunk); q and k tiles loaded.
template <class B>
UPIPE_HD void intra_scores(const B& b, const stage_params& p, const chunk_vectors& cv, const float* q_tile,
                           const float* k_tile, float* p_tile) {
  const int dk = static_cast<int>(p.dk), kl = tile_ld(dk), cl = tile_ld(chunk);
  b.for_each(chunk * chunk, [&](std::int64_t e) {
    const int i = static_cast<int>(e / chunk), j = static_cast<int>(e % chunk);
    float value = 0.0f;
    if (j <= i) {
      float dot = 0.0f;
      for (int m = 0; m < dk; ++m) dot += q_tile[i * kl + m] * k_tile[j * kl + m];
      value = decay_between(cv, i, j) * dot;
    }
    p_tile[i * cl + j] = value;
  });
  b.sync();
}

// The chunk's vectors, its normalized q (scaled) and k, and (q k^T) o M on and below the
// diagonal, in shared memory; `rest` is where the stage's own buffers begin.
struct intra_tiles {
  chunk_vectors cv;
  float *q, *k, *p, *rest;
};
template <class B>
UPIPE_HD intra_tiles load_intra(const B& b, const stage_params& p, std::int64_t local, std::int64_t h, float* smem) {
  const std::int64_t kh = h / (p.hv / p.hk);
  intra_tiles t;
  t.cv = carve_vectors(smem);
  t.q = smem + chunk_vector_count * chunk;
  t.k = t.q + tile_floats(p.dk);
  t.p = t.k + tile_floats(p.dk);
  t.rest = t.p + tile_floats(chunk);
  load_chunk_vectors(b, p, local, h, t.cv);
  load_normalized(b, p, p.q, local, kh, p.scale, nullptr, t.q, tile_ld(p.dk), t.cv.inv);
  load_normalized(b, p, p.k, local, kh, 1.0f, nullptr, t.k, tile_ld(p.dk), t.cv.inv);
  intra_scores(b, p, t.cv, t.q, t.k, t.p);
  return t;
}

// One block per (chunk of the pass, value head).
template <class B>
UPIPE_HD void output(const B& b, const stage_params& p, std::int64_t local, std::int64_t h, float* smem) {
  const std::int64_t base = local * chunk, first = chunk_first_row(p, local);
  const int rows = chunk_rows(p, local), dk = static_cast<int>(p.dk), dv = static_cast<int>(p.dv);
  const intra_tiles t = load_intra(b, p, local, h, smem);
  float* d_tile = t.rest;
  const int kl = tile_ld(dk), cl = tile_ld(chunk), vl = tile_ld(dv);
  b.for_each(static_cast<std::int64_t>(chunk) * dv, [&](std::int64_t e) {
    const int r = static_cast<int>(e / dv), c = static_cast<int>(e % dv);
    d_tile[r * vl + c] = p.u[row_head(p, base + r, h, dv) + c];
  });
  b.sync();
  const float* state = p.states + (local * p.hv + h) * p.dk * p.dv;
  b.for_each(static_cast<std::int64_t>(rows) * dv, [&](std::int64_t e) {
    const int i = static_cast<int>(e / dv), c = static_cast<int>(e % dv);
    float inter = 0.0f, intra = 0.0f;
    for (int m = 0; m < dk; ++m) inter += t.q[i * kl + m] * state[m * dv + c];
    for (int j = 0; j <= i; ++j) intra += t.p[i * cl + j] * d_tile[j * vl + c];
    p.out.store(first + i, h, c, t.cv.gam[i] * inter + intra);
  });
}

}  // namespace upipe::gated_delta
