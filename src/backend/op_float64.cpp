#include "backend/op_float64.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/dtype.hpp"
#include "ops/fp8_attention.hpp"
#include "ops/rope_frequencies.hpp"

namespace upipe::f64 {

namespace {

double silu(double x) { return x / (1.0 + std::exp(-x)); }

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double rounded(double x, double scale, fp8_format format) {
  return round_to_fp8(static_cast<float>(x) * static_cast<float>(scale), format) / scale;
}

double gelu_tanh(double x) {
  const double pi = std::acos(-1.0);
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / pi) * (x + 0.044715 * x * x * x)));
}

}  // namespace

void gemm(host_case& t, std::int64_t m, std::int64_t n, std::int64_t k, bool a_transposed, bool b_transposed,
          double alpha, double beta) {
  const auto& a = t["a"];
  const auto& b = t["b"];
  auto& c = t["c"];
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double sum = 0;
      for (std::int64_t p = 0; p < k; ++p)
        sum += a[a_transposed ? p * m + i : i * k + p] * b[b_transposed ? j * k + p : p * n + j];
      c[i * n + j] = alpha * sum + beta * c[i * n + j];
    }
}

namespace {

// FP8's online softmax over one row's scores: key tiles of fp8_key_tile from key 0, each
// exp(s - m) against the running max m, rounded to E4M3 at the probability scale where it
// meets V; the sum of the exact exponentials. Writes the row's out and lse.
template <class value_row, class visible>
void fp8_tiled_softmax(const std::vector<double>& scores, value_row v_row, std::int64_t d, visible sees, double* out,
                         double& lse) {
  const auto keys = static_cast<std::int64_t>(scores.size());
  std::vector<double> acc(static_cast<std::size_t>(d), 0.0);
  double running = -std::numeric_limits<double>::infinity(), sum = 0.0;
  for (std::int64_t lo = 0; lo < keys; lo += fp8_key_tile) {
    const std::int64_t hi = std::min(keys, lo + fp8_key_tile);
    double top = running;
    for (std::int64_t j = lo; j < hi; ++j)
      if (sees(j)) top = std::max(top, scores[j]);
    if (top == -std::numeric_limits<double>::infinity()) continue;  // no visible key yet
    const double rescale = running == -std::numeric_limits<double>::infinity() ? 0.0 : std::exp(running - top);
    sum *= rescale;
    for (double& a : acc) a *= rescale;
    running = top;
    for (std::int64_t j = lo; j < hi; ++j) {
      if (!sees(j)) continue;
      const double e = std::exp(scores[j] - top);
      sum += e;
      const double e8 = rounded(e, fp8_probability_scale, fp8_format::e4m3);
      const auto* v = v_row(j);
      for (std::int64_t x = 0; x < d; ++x) acc[x] += e8 * v[x];
    }
  }
  for (std::int64_t x = 0; x < d; ++x) out[x] = sum > 0.0 ? acc[x] / sum : 0.0;
  lse = sum > 0.0 ? running + std::log(sum) : -std::numeric_limits<double>::infinity();
}

}  // namespace

void sdpa_forward(host_case& t, std::int64_t sq, std::int64_t skv, std::int64_t hq, std::int64_t hk, std::int64_t d,
                  bool causal, double scale, attention_rows rows, bool fp8_probabilities) {
  const auto& q = t["q"];
  const auto& k = t["k"];
  const auto& v = t["v"];
  auto& out = t["out"];
  auto& lse = t["lse"];
  std::vector<double> p(static_cast<std::size_t>(skv));
  for (std::int64_t i = 0; i < sq; ++i)
    for (std::int64_t h = 0; h < hq; ++h) {
      const std::int64_t g = h / (hq / hk), at = rows.q_first + i;
      const auto sees = [&](std::int64_t j) {
        const std::int64_t key = rows.k_first + j;
        return (!causal || key <= at) && (rows.window <= 0 || at - key < rows.window);
      };
      double top = -std::numeric_limits<double>::infinity();
      for (std::int64_t j = 0; j < skv; ++j) {
        p[j] = -std::numeric_limits<double>::infinity();
        if (!sees(j)) continue;
        double s = 0;
        for (std::int64_t x = 0; x < d; ++x) s += q[(i * hq + h) * d + x] * k[(j * hk + g) * d + x];
        p[j] = scale * s;
        top = std::max(top, p[j]);
      }
      if (fp8_probabilities) {
        fp8_tiled_softmax(p, [&](std::int64_t j) { return &v[(j * hk + g) * d]; }, d, sees,
                                &out[(i * hq + h) * d], lse[i * hq + h]);
        continue;
      }
      double sum = 0;
      for (std::int64_t j = 0; j < skv; ++j) sum += sees(j) ? std::exp(p[j] - top) : 0.0;
      for (std::int64_t x = 0; x < d; ++x) {
        double o = 0;
        for (std::int64_t j = 0; j < skv; ++j)
          if (sees(j)) o += std::exp(p[j] - top) / sum * v[(j * hk + g) * d + x];
        out[(i * hq + h) * d + x] = o;
      }
      lse[i * hq + h] = top + std::log(sum);
    }
}

void sdpa_backward_fp8(host_case& t, std::int64_t sq, std::int64_t skv, std::int64_t hq, std::int64_t hk,
                       std::int64_t d, bool causal, double scale, double d_s_scale) {
  const auto& q = t["q"];
  const auto& k = t["k"];
  const auto& v = t["v"];
  const auto& out = t["out"];
  const auto& d_out = t["d_out"];
  const auto& lse = t["lse"];
  auto& d_q = t["d_q"];
  auto& d_k = t["d_k"];
  auto& d_v = t["d_v"];
  std::fill(d_k.begin(), d_k.end(), 0.0);
  std::fill(d_v.begin(), d_v.end(), 0.0);
  const auto dot = [d](const std::vector<double>& a, std::int64_t a_row, const std::vector<double>& b,
                       std::int64_t b_row) {
    double s = 0;
    for (std::int64_t x = 0; x < d; ++x) s += a[a_row * d + x] * b[b_row * d + x];
    return s;
  };
  for (std::int64_t i = 0; i < sq; ++i)
    for (std::int64_t h = 0; h < hq; ++h) {
      const std::int64_t g = h / (hq / hk), row = i * hq + h;
      const double row_dot = dot(d_out, row, out, row);
      std::vector<double> dq(static_cast<std::size_t>(d), 0.0);
      for (std::int64_t j = 0; j < (causal ? std::min(i + 1, skv) : skv); ++j) {
        const std::int64_t key = j * hk + g;
        const double p = std::exp(scale * dot(q, row, k, key) - lse[row]);
        const double d_s = rounded(scale * p * (dot(d_out, row, v, key) - row_dot), d_s_scale, fp8_format::e5m2);
        const double p8 = rounded(p, fp8_probability_scale, fp8_format::e4m3);
        for (std::int64_t x = 0; x < d; ++x) {
          dq[x] += d_s * k[key * d + x];
          d_k[key * d + x] += d_s * q[row * d + x];
          d_v[key * d + x] += p8 * d_out[row * d + x];
        }
      }
      for (std::int64_t x = 0; x < d; ++x) d_q[row * d + x] = dq[x];
    }
}

void lse_merge(host_case& t, std::int64_t tokens, std::int64_t heads, std::int64_t dim) {
  auto& out = t["out"];
  auto& lse = t["lse"];
  const auto& part = t["out_part"];
  const auto& part_lse = t["lse_part"];
  for (std::int64_t r = 0; r < tokens * heads; ++r) {
    const double a = lse[r], b = part_lse[r];
    if (std::isinf(b) && b < 0) continue;
    const double merged = std::isinf(a) && a < 0 ? b : std::max(a, b) + std::log1p(std::exp(-std::abs(a - b)));
    for (std::int64_t x = 0; x < dim; ++x)
      out[r * dim + x] = (std::isinf(a) ? 0.0 : out[r * dim + x] * std::exp(a - merged)) +
                         part[r * dim + x] * std::exp(b - merged);
    lse[r] = merged;
  }
}

void rope(host_case& t, std::int64_t heads, std::int64_t dim, std::int64_t token_stride, std::int64_t head_stride,
          const std::vector<position_run>& runs, const rope_config& config, bool inverse) {
  auto& x = t["x"];
  // Partial RoPE: the first rotary_dim dimensions rotate, at a head of rotary_dim's frequencies.
  const std::int64_t rotary = config.rotary_dim > 0 ? config.rotary_dim : dim, half = rotary / 2;
  const std::vector<double> inv_freq = ops::rope_inverse_frequencies(config, rotary);
  const double factor = ops::rope_attention_factor(config), sign = inverse ? -1.0 : 1.0;
  for (const position_run& run : runs)
    for (std::int64_t n = 0; n < run.count; ++n)
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::int64_t base = (run.token_begin + n) * token_stride + h * head_stride;
        for (std::int64_t i = 0; i < half; ++i) {
          const double angle = static_cast<double>(run.position_begin + n) * inv_freq[static_cast<std::size_t>(i)];
          const double c = factor * std::cos(angle), s = factor * sign * std::sin(angle);
          const double x1 = x[base + i], x2 = x[base + half + i];
          x[base + i] = x1 * c - x2 * s;
          x[base + half + i] = x2 * c + x1 * s;
        }
      }
}

void rmsnorm_forward(host_case& t, std::int64_t rows, std::int64_t cols, std::int64_t width, std::int64_t first,
                     double eps, double weight_offset) {
  const auto& x = t["x"];
  const auto& w = t["weight"];
  auto& y = t["y"];
  auto& rstd = t["rstd"];
  for (std::int64_t r = 0; r < rows; ++r) {
    double squares = 0;
    for (std::int64_t c = 0; c < cols; ++c) squares += x[r * width + first + c] * x[r * width + first + c];
    const double inv = 1.0 / std::sqrt(squares / static_cast<double>(cols) + eps);
    for (std::int64_t c = 0; c < cols; ++c) y[r * width + first + c] = x[r * width + first + c] * inv * (w[c] + weight_offset);
    rstd[r * 2] = inv;
  }
}

void heads(host_case& t, heads_op op, std::int64_t tokens, std::int64_t heads, std::int64_t dim, double value) {
  auto& dst = t["dst"];
  const std::vector<double> none;
  const auto& src = op == heads_op::fill ? none : t["src"];
  for (std::int64_t s = 0; s < tokens; ++s)
    for (std::int64_t h = 1; h <= heads; ++h)
      for (std::int64_t x = 0; x < dim; ++x) {
        double& d = dst[(s * (heads + 2) + h) * dim + x];
        const double from = op == heads_op::fill ? value : src[(h * tokens + s) * dim + x];
        d = op == heads_op::add ? d + from : from;
      }
}

void embedding_forward(host_case& t, std::int64_t n, std::int64_t dim, double scale) {
  const auto& table = t["table"];
  const auto& ids = t["ids"];
  auto& out = t["out"];
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t x = 0; x < dim; ++x) out[i * dim + x] = table[static_cast<std::int64_t>(ids[i]) * dim + x] * scale;
}

void swiglu_forward(host_case& t, std::int64_t rows, std::int64_t cols, std::int64_t width, std::int64_t first,
                    gate_activation activation) {
  const auto& gate = t["gate"];
  const auto& up = t["up"];
  auto& out = t["out"];
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = first; c < first + cols; ++c)
      out[r * width + c] = (activation == gate_activation::silu      ? silu(gate[r * width + c])
                            : activation == gate_activation::sigmoid ? sigmoid(gate[r * width + c])
                                                                     : gelu_tanh(gate[r * width + c])) *
                           up[r * width + c];
}

void cross_entropy(host_case& t, std::int64_t n, std::int64_t vocab, double grad_scale) {
  auto& logits = t["logits"];
  const auto& labels = t["labels"];
  auto& loss = t["row_loss"];
  for (std::int64_t r = 0; r < n; ++r) {
    double* x = logits.data() + r * vocab;
    const auto label = static_cast<std::int64_t>(labels[r]);
    if (label < 0) {
      std::fill(x, x + vocab, 0.0);
      loss[r] = 0;
      continue;
    }
    double sum = 0;
    for (std::int64_t j = 0; j < vocab; ++j) sum += std::exp(x[j]);
    const double lse = std::log(sum);
    loss[r] = lse - x[label];
    for (std::int64_t j = 0; j < vocab; ++j) x[j] = (std::exp(x[j] - lse) - (j == label ? 1.0 : 0.0)) * grad_scale;
  }
}

void adamw(host_case& t, const adamw_args& a, std::int64_t n) {
  auto& p = t["master"];
  auto& m = t["exp_avg"];
  auto& v = t["exp_avg_sq"];
  const auto& grad = t["grad"];
  auto& weights = t["weights"];
  const double lr = a.lr, b1 = a.beta1, b2 = a.beta2, step = static_cast<double>(a.step);
  for (std::int64_t i = 0; i < n; ++i) {
    const double g = grad[i] * a.grad_scale;
    m[i] = b1 * m[i] + (1 - b1) * g;
    v[i] = b2 * v[i] + (1 - b2) * g * g;
    const double m_hat = m[i] / (1 - std::pow(b1, step)), v_hat = v[i] / (1 - std::pow(b2, step));
    p[i] = p[i] * (1 - lr * a.weight_decay) - lr * m_hat / (std::sqrt(v_hat) + a.eps);
    if (static_cast<std::int64_t>(weights.size()) == n) weights[i] = p[i];
  }
}

void sum_squares(host_case& t, std::int64_t rows, std::int64_t cols, std::int64_t width) {
  const auto& x = t["x"];
  double sum = 0;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) sum += x[r * width + c] * x[r * width + c];
  t["sum"][0] = sum;
}

void bias_add(host_case& t, std::int64_t rows, std::int64_t cols, std::int64_t width, std::int64_t first) {
  auto& y = t["y"];
  const auto& bias = t["bias"];
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) y[r * width + first + c] += bias[c];
}

}  // namespace upipe::f64
