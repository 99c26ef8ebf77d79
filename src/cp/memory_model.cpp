#include "cp/memory_model.hpp"

#include <algorithm>

#include "cp/head_schedule.hpp"

namespace upipe {

namespace {

attention_peak_model staged_model(const attention_config& c, std::size_t w) {
  const head_schedule schedule(c.heads, c.kv_heads, c.all_to_all_size(), c.head_chunk);
  bool spans = false;
  for (const kv_block& b : schedule.blocks(0)) spans = spans || b.spans_stages();
  const std::size_t sd = static_cast<std::size_t>(c.local_tokens()) * c.head_dim;
  const std::size_t U = c.head_chunk, Kr = static_cast<std::size_t>(c.all_to_all_size()) * schedule.max_resident();
  attention_peak_model m;
  // docs/design.md section 4 with one departure: its backward counts cuDNN's f32 dQ accumulator
  // (2 sd U elements) here, but cuDNN keeps that in its own workspace (tag workspace), and
  // the engine holds no second one.
  m.forward = w * sd * (2 * U + 2 * Kr);
  m.backward = w * sd * (4 * U + 4 * Kr) + (spans ? 4 * sd * 2 * Kr : 0);
  // Qwen3's qk-norm keeps the pre-norm q of the stage and the resident k for backward.
  if (c.qk_norm) m.backward += w * sd * (U + Kr);
  return m;
}

// Ring, per rank with s local tokens and chunk c = s/2: forward holds q, k/v and the
// incoming k/v, the f32 output accumulator and one block's partial output; backward
// holds q, k/v, the f32 dq accumulator, the circulating f32 dk/dv and its incoming
// copy and one block's gradients. (cuDNN's own dq accumulator is in its workspace.)
attention_peak_model ring_model(const attention_config& c, std::size_t w) {
  const std::size_t s = static_cast<std::size_t>(c.local_tokens()), half = s / 2;
  const std::size_t Hd = static_cast<std::size_t>(c.heads) * c.head_dim;
  const std::size_t Kd = static_cast<std::size_t>(c.kv_heads) * c.head_dim;
  attention_peak_model m;
  m.forward = w * (s * Hd + 4 * s * Kd + half * Hd) + 4 * (s * Hd + half * c.heads);
  const std::size_t common = w * (s * Hd + 2 * s * Kd + half * Hd + 2 * half * Kd) + 4 * s * Hd;
  const std::size_t during_dkv = common + 4 * (4 * s * Kd);
  const std::size_t during_kv = common + w * 2 * s * Kd + 4 * (2 * s * Kd);
  m.backward = std::max(during_dkv, during_kv);
  if (c.qk_norm) m.backward += w * (s * Hd + s * Kd);
  return m;
}

// Hybrid: the stages' buffers of the all-to-all group (staged_model with A ranks; a
// buffer holds the group's G = S / R tokens), and during a call the ring over the groups
// for the call's heads (at most U / A query heads and the resident kv heads): forward a
// copy of the call's k/v and its incoming copy, the f32 output accumulator and one half's
// partial output; backward the k/v copy, the f32 dq and circulating dk/dv (and its
// incoming copy, or the incoming k/v) and one half's gradients. The staged backward's
// per-call dk/dv stage buffers are not needed: the ring brings them home in f32.
attention_peak_model hybrid_model(const attention_config& c, std::size_t w) {
  const head_schedule schedule(c.heads, c.kv_heads, c.all_to_all_size(), c.head_chunk);
  attention_peak_model m = staged_model(c, w);
  const std::size_t G = static_cast<std::size_t>(c.local_tokens()) * c.all_to_all_size(), half = G / 2;
  const std::size_t d = c.head_dim, nq = static_cast<std::size_t>(c.head_chunk / c.all_to_all_size());
  const std::size_t nkv = schedule.max_resident();
  m.forward += w * (4 * G * nkv * d + half * nq * d) + 4 * (G * nq * d + half * nq);
  const std::size_t common = w * (2 * G * nkv * d + half * nq * d + 2 * half * nkv * d) + 4 * (G * nq * d + 2 * G * nkv * d);
  m.backward += common + std::max(4 * 2 * G * nkv * d, w * 2 * G * nkv * d);
  return m;
}

}  // namespace

attention_peak_model attention_peak_formula(const attention_config& config, dtype work) {
  const std::size_t w = dtype_size(work);
  switch (config.strategy) {
    case strategy_kind::ring: return ring_model(config, w);
    case strategy_kind::hybrid: return hybrid_model(config, w);
    default: return staged_model(config, w);
  }
}

}  // namespace upipe
