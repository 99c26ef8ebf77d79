#include "cp/reference.hpp"

#include <algorithm>
#include <cmath>

#include "backend/ops.hpp"
#include "core/random.hpp"

namespace upipe {

namespace {

using matrix = std::vector<double>;

// c (m, n) = a (m, k) b^T where b is (n, k): the Hugging Face linear layer.
matrix linear(const matrix& a, const std::vector<float>& b, std::int64_t m, std::int64_t k, std::int64_t n) {
  matrix c(static_cast<std::size_t>(m * n), 0.0);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (std::int64_t p = 0; p < k; ++p) acc += a[i * k + p] * b[j * k + p];
      c[i * n + j] = acc;
    }
  return c;
}

// c (m, k) += a (m, n) b where b is (n, k).
void linear_input_grad(matrix& c, const matrix& a, const std::vector<float>& b, std::int64_t m, std::int64_t n,
                       std::int64_t k) {
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j)
      for (std::int64_t p = 0; p < k; ++p) c[i * k + p] += a[i * n + j] * b[j * k + p];
}

// (n, k) = a^T (m, n)^T b (m, k).
matrix weight_grad(const matrix& a, const matrix& b, std::int64_t m, std::int64_t n, std::int64_t k) {
  matrix c(static_cast<std::size_t>(n * k), 0.0);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j)
      for (std::int64_t p = 0; p < k; ++p) c[j * k + p] += a[i * n + j] * b[i * k + p];
  return c;
}

// Rotate-half RoPE on (S, heads, d) at positions s - start[s] (start[s]: the first row of
// row s's document); sign -1 is the inverse.
void rotate(matrix& t, const attention_config& c, int heads, double sign, const std::vector<std::int64_t>& start) {
  const int d = c.head_dim, rotary = c.rope.rotary_dim > 0 ? c.rope.rotary_dim : d, half = rotary / 2;
  const auto inv = ops::rope_inverse_frequencies(c.rope, rotary);
  const double factor = ops::rope_attention_factor(c.rope);
  for (std::int64_t s = 0; s < c.seq_len; ++s)
    for (int h = 0; h < heads; ++h) {
      double* row = &t[(s * heads + h) * d];
      for (int i = 0; i < half; ++i) {
        const double a = static_cast<double>(s - start[s]) * inv[i];
        const double cs = factor * std::cos(a), sn = factor * sign * std::sin(a);
        const double x1 = row[i], x2 = row[i + half];
        row[i] = x1 * cs - x2 * sn;
        row[i + half] = x2 * cs + x1 * sn;
      }
    }
}

matrix widen(const std::vector<float>& v) { return matrix(v.begin(), v.end()); }

// Qwen3's per-head RMSNorm over rows of d, in place; returns the inputs and 1/rms.
struct norm_rows {
  matrix pre;
  std::vector<double> rstd;
};
norm_rows head_norm(matrix& t, const std::vector<float>& w, std::int64_t d, double eps, double offset) {
  norm_rows saved{t, {}};
  for (std::size_t r = 0; r * d < t.size(); ++r) {
    double ss = 0;
    for (std::int64_t e = 0; e < d; ++e) ss += t[r * d + e] * t[r * d + e];
    const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(d) + eps);
    saved.rstd.push_back(rstd);
    for (std::int64_t e = 0; e < d; ++e) t[r * d + e] = t[r * d + e] * rstd * (offset + w[e]);
  }
  return saved;
}

// grad: d(normalized) -> d(pre-norm) in place; returns d(weight).
std::vector<double> head_norm_backward(matrix& grad, const norm_rows& saved, const std::vector<float>& w,
                                       std::int64_t d, double offset) {
  std::vector<double> d_w(static_cast<std::size_t>(d), 0.0);
  for (std::size_t r = 0; r < saved.rstd.size(); ++r) {
    const double rstd = saved.rstd[r];
    double dot = 0;
    for (std::int64_t e = 0; e < d; ++e) dot += grad[r * d + e] * (offset + w[e]) * saved.pre[r * d + e];
    for (std::int64_t e = 0; e < d; ++e) {
      const double x = saved.pre[r * d + e], g = grad[r * d + e];
      d_w[e] += g * x * rstd;
      grad[r * d + e] = rstd * (g * (offset + w[e]) - x * rstd * rstd * dot / static_cast<double>(d));
    }
  }
  return d_w;
}

}  // namespace

attention_inputs random_attention_inputs(const attention_config& c, unsigned long long seed) {
  const std::int64_t S = c.seq_len, D = c.model_dim, hd = std::int64_t{c.heads} * c.head_dim,
                     kd = std::int64_t{c.kv_heads} * c.head_dim;
  std::uint64_t stream = 0;  // one stream per array, on every core (S x D at 1M tokens is billions)
  auto draw = [&](std::int64_t n, float scale) {
    std::vector<float> v(static_cast<std::size_t>(n));
    fill_normal(v, seed, ++stream, scale);
    return v;
  };
  attention_inputs in;
  in.x = draw(S * D, 1.0f);
  in.wq = draw(hd * D, 1.0f / std::sqrt(static_cast<float>(D)));
  in.wk = draw(kd * D, 1.0f / std::sqrt(static_cast<float>(D)));
  in.wv = draw(kd * D, 1.0f / std::sqrt(static_cast<float>(D)));
  in.wo = draw(D * hd, 1.0f / std::sqrt(static_cast<float>(hd)));
  in.d_y = draw(S * D, 1.0f);
  if (c.qk_norm) {
    in.q_norm = draw(c.head_dim, 0.2f);
    in.k_norm = draw(c.head_dim, 0.2f);
    for (auto* v : {&in.q_norm, &in.k_norm})
      for (auto& e : *v) e += 1.0f;  // near one, as trained norms are, but not symmetric
  }
  return in;
}

attention_outputs reference_attention_layer(const attention_config& c, const attention_inputs& in,
                                            std::span<const std::int64_t> documents) {
  const std::int64_t S = c.seq_len, D = c.model_dim, H = c.heads, K = c.kv_heads, d = c.head_dim;
  std::vector<std::int64_t> start(static_cast<std::size_t>(S), 0);  // each row's document start
  std::vector<std::int64_t> first(static_cast<std::size_t>(S), 0);  // each row's first key: document and window
  for (std::int64_t s = 0, doc = 0; s < S; ++s) {
    while (doc + 1 < static_cast<std::int64_t>(documents.size()) && documents[doc + 1] <= s) ++doc;
    start[s] = documents.empty() ? 0 : documents[doc];
    first[s] = c.window > 0 ? std::max(start[s], s - c.window + 1) : start[s];
  }
  const std::int64_t G = H / K, hd = H * d, kd = K * d;
  const double scale = c.score_scale > 0 ? c.score_scale : 1.0 / std::sqrt(static_cast<double>(d));
  const matrix x = widen(in.x), d_y = widen(in.d_y);
  matrix q = linear(x, in.wq, S, D, hd), k = linear(x, in.wk, S, D, kd), v = linear(x, in.wv, S, D, kd);
  norm_rows q_saved, k_saved;
  if (c.qk_norm) {
    q_saved = head_norm(q, in.q_norm, d, c.norm_eps, c.norm_offset);
    k_saved = head_norm(k, in.k_norm, d, c.norm_eps, c.norm_offset);
  }
  rotate(q, c, static_cast<int>(H), 1.0, start);
  rotate(k, c, static_cast<int>(K), 1.0, start);

  attention_outputs r;
  r.attn_out.assign(static_cast<std::size_t>(S * hd), 0.0);
  matrix d_q(q.size(), 0.0), d_k(k.size(), 0.0), d_v(v.size(), 0.0);
  const matrix d_o = [&] {
    matrix m(static_cast<std::size_t>(S * hd), 0.0);
    linear_input_grad(m, d_y, in.wo, S, D, hd);
    return m;
  }();
  std::vector<double> p(static_cast<std::size_t>(S));
  for (std::int64_t h = 0; h < H; ++h) {
    const std::int64_t g = h / G;
    for (std::int64_t i = 0; i < S; ++i) {
      const double* qi = &q[(i * H + h) * d];
      double mx = -INFINITY, sum = 0;
      for (std::int64_t j = first[i]; j <= i; ++j) {
        double dot = 0;
        for (std::int64_t e = 0; e < d; ++e) dot += qi[e] * k[(j * K + g) * d + e];
        p[j] = dot * scale;
        mx = std::max(mx, p[j]);
      }
      for (std::int64_t j = first[i]; j <= i; ++j) sum += (p[j] = std::exp(p[j] - mx));
      double* oi = &r.attn_out[(i * H + h) * d];
      for (std::int64_t j = first[i]; j <= i; ++j) {
        p[j] /= sum;
        for (std::int64_t e = 0; e < d; ++e) oi[e] += p[j] * v[(j * K + g) * d + e];
      }
      // Backward of this row: dS = P (dP - rowsum(dO * O)).
      const double* doi = &d_o[(i * H + h) * d];
      double delta = 0;
      for (std::int64_t e = 0; e < d; ++e) delta += doi[e] * oi[e];
      for (std::int64_t j = first[i]; j <= i; ++j) {
        double dp = 0;
        for (std::int64_t e = 0; e < d; ++e) dp += doi[e] * v[(j * K + g) * d + e];
        const double ds = p[j] * (dp - delta) * scale;
        for (std::int64_t e = 0; e < d; ++e) {
          d_q[(i * H + h) * d + e] += ds * k[(j * K + g) * d + e];
          d_k[(j * K + g) * d + e] += ds * qi[e];
          d_v[(j * K + g) * d + e] += p[j] * doi[e];
        }
      }
    }
  }
  r.y = linear(r.attn_out, in.wo, S, hd, D);
  r.d_wo = weight_grad(d_y, r.attn_out, S, D, hd);
  rotate(d_q, c, static_cast<int>(H), -1.0, start);
  rotate(d_k, c, static_cast<int>(K), -1.0, start);
  if (c.qk_norm) {
    r.d_q_norm = head_norm_backward(d_q, q_saved, in.q_norm, d, c.norm_offset);
    r.d_k_norm = head_norm_backward(d_k, k_saved, in.k_norm, d, c.norm_offset);
  }
  r.d_x.assign(static_cast<std::size_t>(S * D), 0.0);
  linear_input_grad(r.d_x, d_q, in.wq, S, hd, D);
  linear_input_grad(r.d_x, d_k, in.wk, S, kd, D);
  linear_input_grad(r.d_x, d_v, in.wv, S, kd, D);
  r.d_wq = weight_grad(d_q, x, S, hd, D);
  r.d_wk = weight_grad(d_k, x, S, kd, D);
  r.d_wv = weight_grad(d_v, x, S, kd, D);
  return r;
}

double relative_error(std::span<const double> a, std::span<const double> b) {
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    ref = std::max(ref, std::abs(b[i]));
  }
  if (a.size() != b.size()) return INFINITY;
  return ref == 0 ? (diff == 0 ? 0 : INFINITY) : diff / ref;
}

}  // namespace upipe
