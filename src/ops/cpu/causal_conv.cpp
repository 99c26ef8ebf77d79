// Reference causal depthwise conv (then SiLU) and the Gated DeltaNet gates: plain loops,
// fp64 arithmetic per element, fp32 storage.
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops/cpu/cpu_ops.hpp"
#include "ops/gated_delta/recurrent.hpp"

namespace upipe::cpu {

namespace {

float& at(const mat_view& m, std::int64_t i, std::int64_t j) { return static_cast<float*>(m.data)[i * m.ld + j]; }

double sigmoid(double x) {
  if (x >= 0.0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}

// torch's softplus (beta 1, threshold 20).
double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

// The first row (as an index that may be negative, into the halo) that row t may read:
// its document's start, or the halo's first row.
struct conv_rows {
  std::vector<std::int64_t> first;  // per row t
  std::int64_t taps = 0, halo_rows = 0;
};

conv_rows readable_rows(const mat_view& x, const mat_view& weight, const mat_view& halo,
                        const sequence_documents& documents) {
  conv_rows rows;
  rows.taps = weight.cols;
  rows.halo_rows = halo.rows;
  rows.first.resize(static_cast<std::size_t>(x.rows));
  const std::vector<std::uint8_t> reset = gated_delta::reset_rows(documents, x.rows);
  std::int64_t start = -halo.rows;
  for (std::int64_t t = 0; t < x.rows; ++t) {
    if (reset[t]) start = t;
    rows.first[t] = start;
  }
  return rows;
}

// x's row r, or the halo's row halo_rows + r for r < 0.
double input(const mat_view& x, const mat_view& halo, std::int64_t r, std::int64_t c) {
  return r >= 0 ? at(x, r, c) : at(halo, halo.rows + r, c);
}

}  // namespace

void run(const causal_conv_forward_args& args) {
  const conv_rows rows = readable_rows(args.x, args.weight, args.halo, args.documents);
  const std::int64_t taps = rows.taps;
  for (std::int64_t t = 0; t < args.x.rows; ++t)
    for (std::int64_t c = 0; c < args.x.cols; ++c) {
      double sum = 0;
      for (std::int64_t j = 0; j < taps; ++j) {
        const std::int64_t r = t - (taps - 1) + j;
        if (r >= rows.first[t]) sum += static_cast<double>(at(args.weight, c, j)) * input(args.x, args.halo, r, c);
      }
      at(args.y, t, c) = static_cast<float>(sum * sigmoid(sum));
    }
}

// y = silu(z): dz = dy * s (1 + z (1 - s)); each input row's gradient gathers the taps
// that read it.
void run(const causal_conv_backward_args& args) {
  const conv_rows rows = readable_rows(args.x, args.weight, args.halo, args.documents);
  const std::int64_t taps = rows.taps, s = args.x.rows, channels = args.x.cols, halo = rows.halo_rows;
  std::vector<double> d_in(static_cast<std::size_t>((s + halo) * channels), 0.0);
  std::vector<double> d_w(static_cast<std::size_t>(channels * taps), 0.0);
  for (std::int64_t t = 0; t < s; ++t)
    for (std::int64_t c = 0; c < channels; ++c) {
      double z = 0;
      for (std::int64_t j = 0; j < taps; ++j) {
        const std::int64_t r = t - (taps - 1) + j;
        if (r >= rows.first[t]) z += static_cast<double>(at(args.weight, c, j)) * input(args.x, args.halo, r, c);
      }
      const double sg = sigmoid(z), dz = at(args.d_y, t, c) * sg * (1.0 + z * (1.0 - sg));
      for (std::int64_t j = 0; j < taps; ++j) {
        const std::int64_t r = t - (taps - 1) + j;
        if (r < rows.first[t]) continue;
        d_in[(r + halo) * channels + c] += dz * at(args.weight, c, j);
        d_w[c * taps + j] += dz * input(args.x, args.halo, r, c);
      }
    }
  for (std::int64_t t = 0; t < s; ++t)
    for (std::int64_t c = 0; c < channels; ++c) at(args.d_x, t, c) = static_cast<float>(d_in[(t + halo) * channels + c]);
  if (args.d_halo.rows > 0)
    for (std::int64_t r = 0; r < halo; ++r)
      for (std::int64_t c = 0; c < channels; ++c) at(args.d_halo, r, c) = static_cast<float>(d_in[r * channels + c]);
  if (args.d_weight.rows > 0)
    for (std::int64_t c = 0; c < channels; ++c)
      for (std::int64_t j = 0; j < taps; ++j) at(args.d_weight, c, j) += static_cast<float>(d_w[c * taps + j]);
}

void run(const gated_delta_gates_forward_args& args) {
  for (std::int64_t t = 0; t < args.a.rows; ++t)
    for (std::int64_t h = 0; h < args.a.cols; ++h) {
      const double decay = std::exp(static_cast<double>(at(args.a_log, 0, h)));
      at(args.g, t, h) = static_cast<float>(-decay * softplus(at(args.a, t, h) + static_cast<double>(at(args.dt_bias, 0, h))));
      at(args.beta, t, h) = static_cast<float>(sigmoid(at(args.b, t, h)));
    }
}

// g = -e^A softplus(a + dt): dg/da = dg/d dt = -e^A sigmoid(a + dt) (1 where softplus is
// the identity), dg/dA = g; beta' = beta (1 - beta).
void run(const gated_delta_gates_backward_args& args) {
  const std::int64_t heads = args.a.cols;
  std::vector<double> d_a_log(static_cast<std::size_t>(heads), 0.0), d_dt(d_a_log.size(), 0.0);
  for (std::int64_t t = 0; t < args.a.rows; ++t)
    for (std::int64_t h = 0; h < heads; ++h) {
      const double decay = std::exp(static_cast<double>(at(args.a_log, 0, h)));
      const double x = at(args.a, t, h) + static_cast<double>(at(args.dt_bias, 0, h));
      const double dg = at(args.d_g, t, h), slope = x > 20.0 ? 1.0 : sigmoid(x);
      const double d_x = -decay * slope * dg;
      at(args.d_a, t, h) = static_cast<float>(d_x);
      d_dt[h] += d_x;
      d_a_log[h] += -decay * softplus(x) * dg;
      const double beta = sigmoid(at(args.b, t, h));
      at(args.d_b, t, h) = static_cast<float>(at(args.d_beta, t, h) * beta * (1.0 - beta));
    }
  if (args.d_a_log.rows > 0)
    for (std::int64_t h = 0; h < heads; ++h) at(args.d_a_log, 0, h) += static_cast<float>(d_a_log[h]);
  if (args.d_dt_bias.rows > 0)
    for (std::int64_t h = 0; h < heads; ++h) at(args.d_dt_bias, 0, h) += static_cast<float>(d_dt[h]);
}

}  // namespace upipe::cpu
