// Reference attention: scaled dot-product attention forward and backward (GQA, causal
// or unmasked, packed documents, a sliding window) and the fp32 log-sum-exp merge of ring attention. fp32 data, fp64 sums.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/dtype.hpp"
#include "ops/cpu/cpu_ops.hpp"
#include "ops/fp8_attention.hpp"

namespace upipe::cpu {

namespace {

constexpr double neg_inf = -std::numeric_limits<double>::infinity();

// The dim-long contiguous vector of (token t, head h).
float* at(const head_view& v, std::int64_t t, std::int64_t h) {
  return static_cast<float*>(v.data) + t * v.token_stride + h * v.head_stride;
}

double dot(const float* a, const float* b, std::int64_t n) {
  double sum = 0.0;
  for (std::int64_t i = 0; i < n; ++i) sum += static_cast<double>(a[i]) * b[i];
  return sum;
}

// Keys visible to query i: [first, end) with end = all of them, or i + 1 under the causal
// mask, and first the later of the start of query i's document and the window's reach.
std::int64_t visible_keys(attn_mask mask, std::int64_t i, std::int64_t keys) {
  return mask == attn_mask::causal ? std::min(i + 1, keys) : keys;
}

// P as FP8's kernels multiply it: E4M3 at the fixed probability scale (P <= 1).
double fp8_probability(double p) {
  return round_to_fp8(static_cast<float>(p) * fp8_probability_scale, fp8_format::e4m3) / fp8_probability_scale;
}

// One query row: scores, a max-shifted softmax, out = P v and the log-sum-exp. Under FP8 the
// sum is of the exact P (as the kernels keep it in fp32) and P meets V rounded.
void forward_row(const sdpa_forward_args& args, std::int64_t i, std::int64_t h, std::int64_t g,
                 std::vector<double>& scores, std::vector<double>& acc, const fp8_inner_rounding& fp8) {
  const std::int64_t d = args.q.dim, keys = visible_keys(args.mask, i, args.k.tokens);
  const std::int64_t first = args.documents.first_key(i, args.window);
  const float* q = at(args.q, i, h);
  double max_score = neg_inf;
  for (std::int64_t j = first; j < keys; ++j) {
    scores[j] = args.scale * dot(q, at(args.k, j, g), d);
    max_score = std::max(max_score, scores[j]);
  }
  std::fill(acc.begin(), acc.end(), 0.0);
  double sum = 0.0;
  if (fp8.on && fp8.p_block > 0) {
    // The online softmax over key blocks: P rounded against the max seen so far.
    const std::int64_t blocks = (keys + fp8.p_block - 1) / fp8.p_block;
    double running = neg_inf;
    for (std::int64_t n = 0; n < blocks; ++n) {
      const std::int64_t b = fp8.p_block_reverse ? blocks - 1 - n : n;
      const std::int64_t lo = std::max(first, b * fp8.p_block), hi = std::min(keys, (b + 1) * fp8.p_block);
      if (lo >= hi) continue;
      double top = running;
      for (std::int64_t j = lo; j < hi; ++j) top = std::max(top, scores[j]);
      const double rescale = running == neg_inf ? 0.0 : std::exp(running - top);
      sum *= rescale;
      for (double& a : acc) a *= rescale;
      running = top;
      for (std::int64_t j = lo; j < hi; ++j) {
        const double p = std::exp(scores[j] - top);
        const double p_v = fp8.round_p ? fp8_probability(p) : p;
        sum += fp8.sum_rounded ? p_v : p;
        const float* v = at(args.v, j, g);
        for (std::int64_t x = 0; x < d; ++x) acc[x] += p_v * v[x];
      }
    }
    max_score = running;
  } else
  for (std::int64_t j = first; j < keys; ++j) {
    const double p = std::exp(scores[j] - max_score);
    const double p_v = fp8.on && fp8.round_p ? fp8_probability(p) : p;
    sum += fp8.on && fp8.sum_rounded ? p_v : p;
    const float* v = at(args.v, j, g);
    for (std::int64_t x = 0; x < d; ++x) acc[x] += p_v * v[x];
  }
  float* out = at(args.out, i, h);
  // A row without keys (an empty block) has out 0 and lse -inf, which lse_merge ignores.
  const double inv_sum = sum > 0.0 ? 1.0 / sum : 0.0;
  for (std::int64_t x = 0; x < d; ++x) out[x] = static_cast<float>(acc[x] * inv_sum);
  *at(args.lse, i, h) = static_cast<float>(sum > 0.0 ? max_score + std::log(sum) : neg_inf);
}

// Per kv head: fp64 accumulators of d_k and d_v over the query heads of its group.
struct kv_grads {
  std::vector<double> d_k, d_v;  // (skv, d) each
};

// One query row of the backward: writes d_q and adds this row's contributions to the
// group's d_k and d_v. Under FP8, P meets dO rounded (E4M3) and dS = scale P (dP - D), cuDNN's
// dP, meets K and Q rounded (E5M2 at its scale).
void backward_row(const sdpa_backward_args& args, std::int64_t i, std::int64_t h, std::int64_t g,
                  std::vector<double>& d_q, kv_grads& kv, const fp8_inner_rounding& fp8) {
  const std::int64_t d = args.q.dim, keys = visible_keys(args.mask, i, args.k.tokens);
  const std::int64_t first = args.documents.first_key(i, args.window);
  const float* q = at(args.q, i, h);
  const float* d_out = at(args.d_out, i, h);
  const double lse = *at(args.lse, i, h);
  const double row_dot = dot(d_out, at(args.out, i, h), d);
  std::fill(d_q.begin(), d_q.end(), 0.0);
  for (std::int64_t j = first; j < keys; ++j) {
    const float* k = at(args.k, j, g);
    // The final lse of the whole row: within a ring block P need not sum to one.
    const double p = lse == neg_inf ? 0.0 : std::exp(args.scale * dot(q, k, d) - lse);
    const double d_p = dot(d_out, at(args.v, j, g), d);
    double* d_k = kv.d_k.data() + j * d;
    double* d_v = kv.d_v.data() + j * d;
    if (fp8.on) {
      const double raw = fp8.d_s_unscaled ? p * (d_p - row_dot) : args.scale * p * (d_p - row_dot);
      double d_s = fp8.round_d_s ? round_to_fp8(static_cast<float>(raw) * fp8.d_s_scale, fp8_format::e5m2) /
                                       fp8.d_s_scale
                                 : raw;
      if (fp8.d_s_unscaled) d_s *= args.scale;
      const double p_o = fp8.round_p ? fp8_probability(p) : p;
      for (std::int64_t x = 0; x < d; ++x) {
        d_q[x] += d_s * k[x];
        d_k[x] += d_s * q[x];
        d_v[x] += p_o * d_out[x];
      }
      continue;
    }
    const double d_s = p * (d_p - row_dot);
    for (std::int64_t x = 0; x < d; ++x) {
      d_q[x] += d_s * k[x];
      d_k[x] += args.scale * d_s * q[x];
      d_v[x] += p * d_out[x];
    }
  }
  // Under FP8 the scale is inside dS already.
  const double d_q_scale = fp8.on ? 1.0 : args.scale;
  float* d_q_out = at(args.d_q, i, h);
  for (std::int64_t x = 0; x < d; ++x) d_q_out[x] = static_cast<float>(d_q_scale * d_q[x]);
}

void write_rows(const head_view& dst, std::int64_t g, const std::vector<double>& rows) {
  for (std::int64_t j = 0; j < dst.tokens; ++j) {
    float* row = at(dst, j, g);
    for (std::int64_t x = 0; x < dst.dim; ++x) row[x] = static_cast<float>(rows[j * dst.dim + x]);
  }
}

}  // namespace

void run(const sdpa_forward_args& args) {
  if (args.arithmetic == attention_dtype::fp8) return run_fp8(args);
  run_attention(args, {});
}

void run(const sdpa_backward_args& args) {
  if (args.arithmetic == attention_dtype::fp8) return run_fp8(args);
  run_attention(args, {});
}

void run_attention(const sdpa_forward_args& args, const fp8_inner_rounding& fp8) {
  const std::int64_t group = args.q.heads / args.k.heads;
  std::vector<double> scores(static_cast<std::size_t>(args.k.tokens)), acc(static_cast<std::size_t>(args.q.dim));
  for (std::int64_t h = 0; h < args.q.heads; ++h)
    for (std::int64_t i = 0; i < args.q.tokens; ++i) forward_row(args, i, h, h / group, scores, acc, fp8);
}

void run_attention(const sdpa_backward_args& args, const fp8_inner_rounding& fp8) {
  const std::int64_t group = args.q.heads / args.k.heads, d = args.q.dim;
  std::vector<double> d_q(static_cast<std::size_t>(d));
  kv_grads kv;
  for (std::int64_t g = 0; g < args.k.heads; ++g) {
    kv.d_k.assign(static_cast<std::size_t>(args.k.tokens * d), 0.0);
    kv.d_v.assign(static_cast<std::size_t>(args.k.tokens * d), 0.0);
    for (std::int64_t h = g * group; h < (g + 1) * group; ++h)
      for (std::int64_t i = 0; i < args.q.tokens; ++i) backward_row(args, i, h, g, d_q, kv, fp8);
    write_rows(args.d_k, g, kv.d_k);
    write_rows(args.d_v, g, kv.d_v);
  }
}

void run(const lse_merge_args& args) {
  const std::int64_t d = args.out.dim;
  for (std::int64_t t = 0; t < args.out.tokens; ++t) {
    for (std::int64_t h = 0; h < args.out.heads; ++h) {
      float* lse = at(args.lse, t, h);
      const double old_lse = *lse, part_lse = *at(args.lse_part, t, h);
      if (part_lse == neg_inf) continue;  // an empty part changes nothing (both -inf included)
      float* out = at(args.out, t, h);
      const float* part = at(args.out_part, t, h);
      if (old_lse == neg_inf) {
        // The accumulator is still empty and out may hold garbage: take the part as is.
        std::copy(part, part + d, out);
        *lse = static_cast<float>(part_lse);
        continue;
      }
      const double top = std::max(old_lse, part_lse);
      const double new_lse = top + std::log(std::exp(old_lse - top) + std::exp(part_lse - top));
      const double w_old = std::exp(old_lse - new_lse), w_part = std::exp(part_lse - new_lse);
      for (std::int64_t x = 0; x < d; ++x) out[x] = static_cast<float>(w_old * out[x] + w_part * part[x]);
      *lse = static_cast<float>(new_lse);
    }
  }
}

}  // namespace upipe::cpu
