// The chunked gated delta rule's backward stages (docs/design.md, "Gated DeltaNet ops"),
// after the forward's prepare and state_pass have recomputed a pass's w, u, delta and
// states:
//   intra_backward   per chunk and head: d_delta = ((q k^T) o M)^T d_o (the in-chunk part);
//   reverse_pass     per head and slice of d_v, chunks in reverse: d_delta += diag(lam) k dS,
//                    dS <- gam_end dS + (diag(gam) q)^T d_o - w^T d_delta, with dS the
//                    gradient by each chunk's last state;
//   wy_backward      per chunk and head: back through u = T diag(beta) v, w = T diag(beta gam)
//                    k and T = (I + A)^-1 to d_v, d_beta, a part of d_k and of d_G;
//   output_backward  per chunk and head: back through o and the chunk's last state to d_q,
//                    the rest of d_k and d_G, then d_g by the reverse cumulative sum;
//   qk_backward      per row and key head: the group's value heads summed, back through the
//                    scale and the L2 norm to d_q and d_k.
#pragma once

#include "ops/gated_delta/chunk_forward.hpp"

namespace upipe::gated_delta {

inline std::int64_t intra_backward_smem_floats(std::int64_t dk, std::int64_t dv) {
  return output_smem_floats(dk, dv);
}

// One block per (chunk of the pass, value head).
template <class B>
UPIPE_HD void intra_backward(const B& b, const stage_params& p, std::int64_t local, std::int64_t h, float* smem) {
  const std::int64_t base = local * chunk, first = chunk_first_row(p, local);
  const int rows = chunk_rows(p, local), dv = static_cast<int>(p.dv);
  const intra_tiles t = load_intra(b, p, local, h, smem);
  float* o_tile = t.rest;
  const int cl = tile_ld(chunk), vl = tile_ld(dv);
  b.for_each(static_cast<std::int64_t>(chunk) * dv, [&](std::int64_t e) {
    const int r = static_cast<int>(e / dv), c = static_cast<int>(e % dv);
    o_tile[r * vl + c] = r < rows ? p.d_out.load(first + r, h, c) : 0.0f;
  });
  b.sync();
  b.for_each(static_cast<std::int64_t>(chunk) * dv, [&](std::int64_t e) {
    const int j = static_cast<int>(e / dv), c = static_cast<int>(e % dv);
    float sum = 0.0f;
    for (int i = j; i < chunk; ++i) sum += t.p[i * cl + j] * o_tile[i * vl + c];
    p.d_delta[row_head(p, base + j, h, dv) + c] = sum;
  });
}

inline std::int64_t reverse_pass_smem_floats(std::int64_t dk) {
  return chunk_vector_count * chunk + dk * state_slice + 3 * tile_floats(dk) + 2 * chunk * state_slice;
}

// One block per (value head, slice of d_v's columns), through the pass's chunks from the
// last. p.start_state is d_final_state or the carry of the pass after; p.d_delta holds
// intra_backward's part and gets the whole d_delta.
template <class B>
UPIPE_HD void reverse_pass(const B& b, const stage_params& p, std::int64_t h, std::int64_t slice, float* smem) {
  const std::int64_t kh = h / (p.hv / p.hk), c0 = slice * state_slice;
  const int dk = static_cast<int>(p.dk), dv = static_cast<int>(p.dv);
  const int nc = static_cast<int>(dv - c0 < state_slice ? dv - c0 : state_slice);
  const chunk_vectors cv = carve_vectors(smem);
  float* ds = smem + chunk_vector_count * chunk;  // (dk, state_slice)
  float* q_tile = ds + dk * state_slice;
  float* k_tile = q_tile + tile_floats(dk);
  float* w_tile = k_tile + tile_floats(dk);
  float* o_slice = w_tile + tile_floats(dk);      // (chunk, state_slice)
  float* dd_slice = o_slice + chunk * state_slice;
  const int kl = tile_ld(dk);
  b.for_each(static_cast<std::int64_t>(dk) * nc, [&](std::int64_t e) {
    const int i = static_cast<int>(e / nc), c = static_cast<int>(e % nc);
    ds[i * state_slice + c] = p.start == state_start::given ? p.start_state.at(h, i, c0 + c) : 0.0f;
  });
  b.sync();
  for (std::int64_t local = p.pass_chunks - 1; local >= 0; --local) {
    const int rows = chunk_rows(p, local);
    const std::int64_t base = local * chunk, first = chunk_first_row(p, local);
    load_chunk_vectors(b, p, local, h, cv);
    if (p.d_state_end != nullptr)
      b.for_each(static_cast<std::int64_t>(dk) * nc, [&](std::int64_t e) {
        const int i = static_cast<int>(e / nc), c = static_cast<int>(e % nc);
        p.d_state_end[((local * p.hv + h) * dk + i) * dv + c0 + c] = ds[i * state_slice + c];
      });
    b.for_each(static_cast<std::int64_t>(chunk) * dk, [&](std::int64_t e) {
      const int r = static_cast<int>(e / dk), m = static_cast<int>(e % dk);
      w_tile[r * kl + m] = p.w[row_head(p, base + r, h, dk) + m];
    });
    b.for_each(static_cast<std::int64_t>(chunk) * nc, [&](std::int64_t e) {
      const int r = static_cast<int>(e / nc), c = static_cast<int>(e % nc);
      o_slice[r * state_slice + c] = r < rows ? p.d_out.load(first + r, h, c0 + c) : 0.0f;
    });
    load_normalized(b, p, p.k, local, kh, 1.0f, cv.lam, k_tile, kl, cv.inv);
    load_normalized(b, p, p.q, local, kh, p.scale, cv.gam, q_tile, kl, cv.inv);
    b.for_each(static_cast<std::int64_t>(chunk) * nc, [&](std::int64_t e) {
      const int r = static_cast<int>(e / nc), c = static_cast<int>(e % nc);
      float* at = p.d_delta + row_head(p, base + r, h, dv) + c0 + c;
      float sum = *at;
      for (int m = 0; m < dk; ++m) sum += k_tile[r * kl + m] * ds[m * state_slice + c];
      *at = sum;
      dd_slice[r * state_slice + c] = sum;
    });
    b.sync();
    const float gam_end = gam_of_end(cv, rows);
    b.for_each(static_cast<std::int64_t>(dk) * nc, [&](std::int64_t e) {
      const int m = static_cast<int>(e / nc), c = static_cast<int>(e % nc);
      float sum = gam_end * ds[m * state_slice + c];
      for (int r = 0; r < chunk; ++r)
        sum += q_tile[r * kl + m] * o_slice[r * state_slice + c] - w_tile[r * kl + m] * dd_slice[r * state_slice + c];
      ds[m * state_slice + c] = sum;
    });
    b.sync();
  }
  if (!p.carry_out.empty())
    b.for_each(static_cast<std::int64_t>(dk) * nc, [&](std::int64_t e) {
      const int i = static_cast<int>(e / nc), c = static_cast<int>(e % nc);
      p.carry_out.at(h, i, c0 + c) = ds[i * state_slice + c];
    });
}

UPIPE_HD_INLINE std::int64_t wide(std::int64_t dk, std::int64_t dv) { return dk > dv ? dk : dv; }

inline std::int64_t wy_backward_smem_floats(std::int64_t dk, std::int64_t dv) {
  return (chunk_vector_count + 2) * chunk + tile_floats(dk) + 3 * tile_floats(wide(dk, dv)) + 4 * tile_floats(chunk);
}

// (I + A)^-1 into t from a (both chunk x chunk tiles), a row at a time.
template <class B>
UPIPE_HD void invert_unit_lower(const B& b, const float* a, float* t) {
  const int cl = tile_ld(chunk);
  for (int i = 0; i < chunk; ++i) {
    b.for_each(chunk, [&](std::int64_t m) {
      float sum = i == m ? 1.0f : 0.0f;
      for (int j = static_cast<int>(m); j < i; ++j) sum -= a[i * cl + j] * t[j * cl + m];
      t[i * cl + m] = m <= i ? sum : 0.0f;
    });
    b.sync();
  }
}

// One block per (chunk of the pass, value head). Reads d_delta (whole) and the chunk's
// entering state; writes d_v and d_beta, d_k_heads (its part) and d_g (d_G's part, before
// output_backward's cumulative sum).
template <class B>
UPIPE_HD void wy_backward(const B& b, const stage_params& p, std::int64_t local, std::int64_t h, float* smem) {
  const std::int64_t kh = h / (p.hv / p.hk), base = local * chunk, first = chunk_first_row(p, local);
  const int rows = chunk_rows(p, local), dk = static_cast<int>(p.dk), dv = static_cast<int>(p.dv);
  const chunk_vectors cv = carve_vectors(smem);
  float* db = smem + chunk_vector_count * chunk;
  float* dgam = db + chunk;
  float* k_tile = dgam + chunk;
  float* ta = k_tile + tile_floats(dk);
  float* tb = ta + tile_floats(wide(dk, dv));
  float* td = tb + tile_floats(wide(dk, dv));
  float* t = td + tile_floats(wide(dk, dv));
  float* kk = t + tile_floats(chunk);
  float* s1 = kk + tile_floats(chunk);
  float* s2 = s1 + tile_floats(chunk);
  const int kl = tile_ld(dk), wl = tile_ld(wide(dk, dv)), cl = tile_ld(chunk);
  const float* state = p.states + (local * p.hv + h) * p.dk * p.dv;
  load_chunk_vectors(b, p, local, h, cv);
  load_normalized(b, p, p.k, local, kh, 1.0f, nullptr, k_tile, kl, cv.inv);
  b.for_each(chunk * chunk, [&](std::int64_t e) {
    const int i = static_cast<int>(e / chunk), j = static_cast<int>(e % chunk);
    float dot = 0.0f;
    for (int m = 0; m < dk; ++m) dot += k_tile[i * kl + m] * k_tile[j * kl + m];
    kk[i * cl + j] = dot;
    s1[i * cl + j] = j < i ? cv.beta[i] * decay_between(cv, i, j) * dot : 0.0f;
  });
  b.sync();
  invert_unit_lower(b, s1, t);
  // ta = d_delta, tb = v; dT = d_delta (diag(beta) v)^T; td = dX = T^T d_delta.
  b.for_each(static_cast<std::int64_t>(chunk) * dv, [&](std::int64_t e) {
    const int r = static_cast<int>(e / dv), c = static_cast<int>(e % dv);
    ta[r * wl + c] = p.d_delta[row_head(p, base + r, h, dv) + c];
    tb[r * wl + c] = r < rows ? p.v.load(first + r, h, c) : 0.0f;
  });
  b.sync();
  b.for_each(chunk * chunk, [&](std::int64_t e) {
    const int i = static_cast<int>(e / chunk), j = static_cast<int>(e % chunk);
    float sum = 0.0f;
    for (int c = 0; c < dv; ++c) sum += ta[i * wl + c] * tb[j * wl + c];
    s2[i * cl + j] = cv.beta[j] * sum;
  });
  b.for_each(static_cast<std::int64_t>(chunk) * dv, [&](std::int64_t e) {
    const int j = static_cast<int>(e / dv), c = static_cast<int>(e % dv);
    float sum = 0.0f;
    for (int i = j; i < chunk; ++i) sum += t[i * cl + j] * ta[i * wl + c];
    td[j * wl + c] = sum;
  });
  b.sync();
  b.for_each(static_cast<std::int64_t>(rows) * dv, [&](std::int64_t e) {
    const int j = static_cast<int>(e / dv), c = static_cast<int>(e % dv);
    p.d_v.store(first + j, h, c, cv.beta[j] * td[j * wl + c]);
  });
  b.for_each(chunk, [&](std::int64_t j) {
    float sum = 0.0f;
    for (int c = 0; c < dv; ++c) sum += tb[j * wl + c] * td[j * wl + c];
    db[j] = sum;
  });
  b.sync();
  // tb = dW = -d_delta S^T; dT += dW (diag(beta gam) k)^T; ta = dY = T^T dW.
  b.for_each(static_cast<std::int64_t>(chunk) * dk, [&](std::int64_t e) {
    const int i = static_cast<int>(e / dk), m = static_cast<int>(e % dk);
    float sum = 0.0f;
    for (int c = 0; c < dv; ++c) sum += ta[i * wl + c] * state[m * dv + c];
    tb[i * wl + m] = -sum;
  });
  b.sync();
  b.for_each(chunk * chunk, [&](std::int64_t e) {
    const int i = static_cast<int>(e / chunk), j = static_cast<int>(e % chunk);
    float sum = 0.0f;
    for (int m = 0; m < dk; ++m) sum += tb[i * wl + m] * k_tile[j * kl + m];
    s2[i * cl + j] += cv.beta[j] * cv.gam[j] * sum;
  });
  b.for_each(static_cast<std::int64_t>(chunk) * dk, [&](std::int64_t e) {
    const int j = static_cast<int>(e / dk), m = static_cast<int>(e % dk);
    float sum = 0.0f;
    for (int i = j; i < chunk; ++i) sum += t[i * cl + j] * tb[i * wl + m];
    ta[j * wl + m] = sum;
  });
  b.sync();
  b.for_each(chunk, [&](std::int64_t j) {
    float dot = 0.0f;
    for (int m = 0; m < dk; ++m) dot += k_tile[j * kl + m] * ta[j * wl + m];
    db[j] += cv.gam[j] * dot;
    dgam[j] = cv.beta[j] * dot;
  });
  b.for_each(chunk * chunk, [&](std::int64_t e) {  // s1 = dT T^T
    const int i = static_cast<int>(e / chunk), j = static_cast<int>(e % chunk);
    float sum = 0.0f;
    for (int n = 0; n <= j; ++n) sum += s2[i * cl + n] * t[j * cl + n];
    s1[i * cl + j] = sum;
  });
  b.sync();
  b.for_each(static_cast<std::int64_t>(chunk) * dk, [&](std::int64_t e) {  // ta = d k from dY
    const int j = static_cast<int>(e / dk), m = static_cast<int>(e % dk);
    ta[j * wl + m] *= cv.beta[j] * cv.gam[j];
  });
  b.for_each(chunk * chunk, [&](std::int64_t e) {  // s2 = dA = -T^T s1, then o M below the diagonal
    const int i = static_cast<int>(e / chunk), j = static_cast<int>(e % chunk);
    float sum = 0.0f;
    for (int a = i; a < chunk; ++a) sum += t[a * cl + i] * s1[a * cl + j];
    s2[i * cl + j] = j < i ? -sum * decay_between(cv, i, j) : 0.0f;
  });
  b.sync();
  // s2 = E = dA o M; s1 = d log M = E beta_i (k_i . k_j); back to d beta, d k and d G.
  b.for_each(chunk * chunk, [&](std::int64_t e) {
    const int i = static_cast<int>(e / chunk), j = static_cast<int>(e % chunk);
    s1[i * cl + j] = s2[i * cl + j] * cv.beta[i] * kk[i * cl + j];
  });
  b.for_each(chunk, [&](std::int64_t i) {
    float sum = 0.0f;
    for (int j = 0; j < i; ++j) sum += s2[i * cl + j] * kk[i * cl + j];
    db[i] += sum;
  });
  b.for_each(static_cast<std::int64_t>(chunk) * dk, [&](std::int64_t e) {
    const int r = static_cast<int>(e / dk), m = static_cast<int>(e % dk);
    float row = 0.0f, col = 0.0f;
    for (int j = 0; j < r; ++j) row += s2[r * cl + j] * k_tile[j * kl + m];
    for (int i = r + 1; i < chunk; ++i) col += cv.beta[i] * s2[i * cl + r] * k_tile[i * kl + m];
    ta[r * wl + m] += cv.beta[r] * row + col;
  });
  b.sync();
  b.for_each(static_cast<std::int64_t>(rows) * dk, [&](std::int64_t e) {
    const int r = static_cast<int>(e / dk), m = static_cast<int>(e % dk);
    p.d_k_heads[row_head(p, base + r, h, dk) + m] = ta[r * wl + m];
  });
  b.for_each(rows, [&](std::int64_t i) {
    float net = dgam[i] * cv.gam[i];
    for (int j = 0; j < chunk; ++j) net += s1[i * cl + j] - s1[j * cl + i];
    p.d_beta.at(first + i, h) = db[i];
    p.d_g.at(first + i, h) = net;
  });
}

inline std::int64_t output_backward_smem_floats(std::int64_t dk, std::int64_t dv) {
  return (chunk_vector_count + 3) * chunk + block_threads + 1 + 2 * tile_floats(dk) + 2 * tile_floats(dv) +
         tile_floats(wide(dk, dv)) + 2 * tile_floats(chunk);
}

// One block per (chunk of the pass, value head), after wy_backward: reads delta, the
// chunk's entering state and d_state_end; writes d_q_heads, adds to d_k_heads, and turns
// wy_backward's part of d_G in d_g into d_g.
template <class B>
UPIPE_HD void output_backward(const B& b, const stage_params& p, std::int64_t local, std::int64_t h, float* smem) {
  const std::int64_t kh = h / (p.hv / p.hk), base = local * chunk, first = chunk_first_row(p, local);
  const int rows = chunk_rows(p, local), dk = static_cast<int>(p.dk), dv = static_cast<int>(p.dv);
  const chunk_vectors cv = carve_vectors(smem);
  float* dgam = smem + chunk_vector_count * chunk;
  float* dlam = dgam + chunk;
  float* dgs = dlam + chunk;
  float* partial = dgs + chunk;  // block_threads + 1: the sums of <dS_end, S>, then their total
  float* q_tile = partial + block_threads + 1;
  float* k_tile = q_tile + tile_floats(dk);
  float* o_tile = k_tile + tile_floats(dk);
  float* d_tile = o_tile + tile_floats(dv);
  float* z = d_tile + tile_floats(dv);
  float* qk = z + tile_floats(wide(dk, dv));
  float* dp = qk + tile_floats(chunk);
  const int kl = tile_ld(dk), vl = tile_ld(dv), wl = tile_ld(wide(dk, dv)), cl = tile_ld(chunk);
  const float* state = p.states + (local * p.hv + h) * p.dk * p.dv;
  const float* ds_end = p.d_state_end + (local * p.hv + h) * p.dk * p.dv;
  load_chunk_vectors(b, p, local, h, cv);
  load_normalized(b, p, p.q, local, kh, p.scale, nullptr, q_tile, kl, cv.inv);
  load_normalized(b, p, p.k, local, kh, 1.0f, nullptr, k_tile, kl, cv.inv);
  b.for_each(static_cast<std::int64_t>(chunk) * dv, [&](std::int64_t e) {
    const int r = static_cast<int>(e / dv), c = static_cast<int>(e % dv);
    o_tile[r * vl + c] = r < rows ? p.d_out.load(first + r, h, c) : 0.0f;
    d_tile[r * vl + c] = p.u[row_head(p, base + r, h, dv) + c];
  });
  b.for_each(chunk * chunk, [&](std::int64_t e) {
    const int i = static_cast<int>(e / chunk), j = static_cast<int>(e % chunk);
    float dot = 0.0f;
    for (int m = 0; m < dk; ++m) dot += q_tile[i * kl + m] * k_tile[j * kl + m];
    qk[i * cl + j] = j <= i ? dot : 0.0f;
  });
  b.sync();
  // dp = E = (d_o delta^T) o M on and below the diagonal; qk = d log M = E o (q k^T).
  b.for_each(chunk * chunk, [&](std::int64_t e) {
    const int i = static_cast<int>(e / chunk), j = static_cast<int>(e % chunk);
    float sum = 0.0f;
    if (j <= i)
      for (int c = 0; c < dv; ++c) sum += o_tile[i * vl + c] * d_tile[j * vl + c];
    const float scaled = j <= i ? sum * decay_between(cv, i, j) : 0.0f;
    dp[i * cl + j] = scaled;
    qk[i * cl + j] *= scaled;
  });
  b.for_each(static_cast<std::int64_t>(chunk) * dv, [&](std::int64_t e) {  // z = q S
    const int i = static_cast<int>(e / dv), c = static_cast<int>(e % dv);
    float sum = 0.0f;
    for (int m = 0; m < dk; ++m) sum += q_tile[i * kl + m] * state[m * dv + c];
    z[i * wl + c] = sum;
  });
  b.sync();
  b.for_each(chunk, [&](std::int64_t i) {
    float sum = 0.0f;
    for (int c = 0; c < dv; ++c) sum += z[i * wl + c] * o_tile[i * vl + c];
    dgam[i] = sum;
  });
  b.for_each(static_cast<std::int64_t>(rows) * dk, [&](std::int64_t e) {
    const int i = static_cast<int>(e / dk), m = static_cast<int>(e % dk);
    float intra = 0.0f, inter = 0.0f;
    for (int j = 0; j <= i; ++j) intra += dp[i * cl + j] * k_tile[j * kl + m];
    for (int c = 0; c < dv; ++c) inter += state[m * dv + c] * o_tile[i * vl + c];
    p.d_q_heads[row_head(p, base + i, h, dk) + m] = intra + cv.gam[i] * inter;
  });
  b.for_each(block_threads, [&](std::int64_t n) {
    float sum = 0.0f;
    for (std::int64_t e = n; e < p.dk * p.dv; e += block_threads) sum += ds_end[e] * state[e];
    partial[n] = sum;
  });
  b.sync();
  b.for_each(static_cast<std::int64_t>(chunk) * dk, [&](std::int64_t e) {  // z = delta dS_end^T
    const int j = static_cast<int>(e / dk), m = static_cast<int>(e % dk);
    float sum = 0.0f;
    for (int c = 0; c < dv; ++c) sum += d_tile[j * vl + c] * ds_end[m * dv + c];
    z[j * wl + m] = sum;
  });
  b.for_each(1, [&](std::int64_t) {
    float sum = 0.0f;
    for (int n = 0; n < block_threads; ++n) sum += partial[n];
    partial[block_threads] = sum;
  });
  b.sync();
  b.for_each(chunk, [&](std::int64_t j) {
    float sum = 0.0f;
    for (int m = 0; m < dk; ++m) sum += k_tile[j * kl + m] * z[j * wl + m];
    dlam[j] = sum;
  });
  b.for_each(static_cast<std::int64_t>(rows) * dk, [&](std::int64_t e) {
    const int j = static_cast<int>(e / dk), m = static_cast<int>(e % dk);
    float sum = cv.lam[j] * z[j * wl + m];
    for (int i = j; i < chunk; ++i) sum += dp[i * cl + j] * q_tile[i * kl + m];
    p.d_k_heads[row_head(p, base + j, h, dk) + m] += sum;
  });
  b.sync();
  // d_G: the output's decays, the in-chunk decays, the end's; then d_g_t = sum_{i >= t} d_G_i.
  b.for_each(chunk, [&](std::int64_t i) {
    float net = dgam[i] * cv.gam[i] - dlam[i] * cv.lam[i];
    for (int j = 0; j < chunk; ++j) net += qk[i * cl + j] - qk[j * cl + i];
    if (i == rows - 1) {
      for (int j = 0; j < chunk; ++j) net += dlam[j] * cv.lam[j];
      net += partial[block_threads] * gam_of_end(cv, rows);
    }
    dgs[i] = i < rows ? net + p.d_g.at(first + i, h) : 0.0f;
  });
  b.sync();
  b.for_each(rows, [&](std::int64_t t) {
    float sum = 0.0f;
    for (int i = rows - 1; i >= t; --i) sum += dgs[i];
    p.d_g.at(first + t, h) = sum;
  });
}

inline std::int64_t qk_backward_smem_floats(std::int64_t dk) { return 2 * dk + 2; }

// One block per (row of the pass, key head): the group's value heads' d q and d k summed,
// back through the scale and the L2 norm: d x = scale inv (dy - x^ (x^ . dy)), x^ = x inv.
template <class B>
UPIPE_HD void qk_backward(const B& b, const stage_params& p, std::int64_t r, std::int64_t kh, float* smem) {
  const std::int64_t row = p.pass_first * chunk + r, group = p.hv / p.hk;
  if (row >= p.s) return;
  const int dk = static_cast<int>(p.dk);
  float* dy = smem;
  float* x = smem + dk;
  float* sums = smem + 2 * dk;  // |x|^2, x . dy
  for (int which = 0; which < 2; ++which) {
    const tensor3& in = which == 0 ? p.q : p.k;
    const float* heads = which == 0 ? p.d_q_heads : p.d_k_heads;
    const float scale = which == 0 ? p.scale : 1.0f;
    b.for_each(dk, [&](std::int64_t m) {
      float sum = 0.0f;
      for (std::int64_t h = kh * group; h < (kh + 1) * group; ++h) sum += heads[row_head(p, r, h, dk) + m];
      dy[m] = sum;
      x[m] = in.load(row, kh, m);
    });
    b.sync();
    b.for_each(1, [&](std::int64_t) {
      float squares = 0.0f, dot = 0.0f;
      for (int m = 0; m < dk; ++m) {
        squares += x[m] * x[m];
        dot += x[m] * dy[m];
      }
      sums[0] = p.l2 ? 1.0f / sqrtf(squares + p.eps) : 1.0f;
      sums[1] = dot;
    });
    b.sync();
    b.for_each(dk, [&](std::int64_t m) {
      const float inv = sums[0];
      const float value = p.l2 ? scale * inv * (dy[m] - x[m] * inv * inv * sums[1]) : scale * dy[m];
      (which == 0 ? p.d_q : p.d_k).store(row, kh, m, value);
    });
    b.sync();
  }
}

}  // namespace upipe::gated_delta
