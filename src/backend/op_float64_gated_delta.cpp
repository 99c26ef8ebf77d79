// The Gated DeltaNet ops in float64: the gated delta rule token by token (its recurrent
// form in double), the causal conv and the gates as loops from their definitions.
#include <cmath>
#include <vector>

#include "backend/op_float64.hpp"
#include "ops/gated_delta/recurrent.hpp"

namespace upipe::f64 {

namespace {

using gated_delta::contiguous3;
using gated_delta::view2;
using gated_delta::view3;

struct recurrence {
  std::vector<std::uint8_t> reset;
  std::vector<double> identity, zeros;
  gated_delta::recurrent_inputs<double> in;
};

recurrence inputs_of(host_case& t, const gated_delta_case& c, bool with_v, bool with_initial) {
  recurrence r;
  r.reset = gated_delta::reset_rows({c.starts, c.first}, c.tokens);
  r.in.q = contiguous3<const double>(t.at("q").data(), c.tokens, c.k_heads, c.d_k);
  r.in.k = contiguous3<const double>(t.at("k").data(), c.tokens, c.k_heads, c.d_k);
  if (with_v) {
    r.in.v = contiguous3<const double>(t.at("v").data(), c.tokens, c.v_heads, c.d_v);
  } else {
    r.zeros.assign(static_cast<std::size_t>(c.tokens * c.v_heads * c.d_v), 0.0);
    r.in.v = contiguous3<const double>(r.zeros.data(), c.tokens, c.v_heads, c.d_v);
  }
  r.in.g = {t.at("g").data(), c.tokens, c.v_heads, c.v_heads};
  r.in.beta = {t.at("beta").data(), c.tokens, c.v_heads, c.v_heads};
  if (with_initial && c.initial_state)
    r.in.initial = contiguous3<const double>(t.at("initial_state").data(), c.v_heads, c.d_k, c.d_v);
  r.in.reset = r.reset.data();
  r.in.scale = c.scale;
  r.in.l2 = c.l2;
  return r;
}

view3<double> states_of(host_case& t, const char* name, const gated_delta_case& c, std::int64_t cols) {
  const auto it = t.find(name);
  if (it == t.end()) return {};
  return contiguous3(it->second.data(), c.v_heads, c.d_k, cols);
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double softplus(double x) { return x > 20.0 ? x : std::log(1.0 + std::exp(x)); }

}  // namespace

void gated_delta_forward(host_case& t, const gated_delta_case& c) {
  const recurrence r = inputs_of(t, c, true, true);
  gated_delta::recurrent_forward(r.in, contiguous3(t.at("out").data(), c.tokens, c.v_heads, c.d_v),
                                 states_of(t, "final_state", c, c.d_v));
}

void gated_delta_backward(host_case& t, const gated_delta_case& c) {
  const recurrence r = inputs_of(t, c, true, true);
  const auto d_final = t.find("d_final_state");
  gated_delta::recurrent_backward<double>(
      r.in, {contiguous3<const double>(t.at("d_out").data(), c.tokens, c.v_heads, c.d_v),
             d_final == t.end() ? view3<const double>{}
                                : contiguous3<const double>(d_final->second.data(), c.v_heads, c.d_k, c.d_v),
             contiguous3(t.at("d_q").data(), c.tokens, c.k_heads, c.d_k),
             contiguous3(t.at("d_k").data(), c.tokens, c.k_heads, c.d_k),
             contiguous3(t.at("d_v").data(), c.tokens, c.v_heads, c.d_v),
             view2<double>{t.at("d_g").data(), c.tokens, c.v_heads, c.v_heads},
             view2<double>{t.at("d_beta").data(), c.tokens, c.v_heads, c.v_heads},
             states_of(t, "d_initial_state", c, c.d_v)});
}

void gated_delta_summary(host_case& t, const gated_delta_case& c) {
  recurrence r = inputs_of(t, c, true, false);
  gated_delta::recurrent_forward(r.in, view3<double>{}, states_of(t, "local_state", c, c.d_v));
  r.zeros.assign(static_cast<std::size_t>(c.tokens * c.v_heads * c.d_k), 0.0);
  r.identity.assign(static_cast<std::size_t>(c.v_heads * c.d_k * c.d_k), 0.0);
  for (std::int64_t h = 0; h < c.v_heads; ++h)
    for (std::int64_t i = 0; i < c.d_k; ++i) r.identity[(h * c.d_k + i) * c.d_k + i] = 1.0;
  r.in.v = contiguous3<const double>(r.zeros.data(), c.tokens, c.v_heads, c.d_k);
  r.in.initial = contiguous3<const double>(r.identity.data(), c.v_heads, c.d_k, c.d_k);
  gated_delta::recurrent_forward(r.in, view3<double>{}, states_of(t, "transition", c, c.d_k));
}

void gated_delta_summary_backward(host_case& t, const gated_delta_case& c) {
  const recurrence r = inputs_of(t, c, false, false);
  std::vector<double> d_q(static_cast<std::size_t>(c.tokens * c.k_heads * c.d_k)), d_k(d_q.size());
  std::vector<double> d_v(static_cast<std::size_t>(c.tokens * c.v_heads * c.d_v));
  std::vector<double> d_g(static_cast<std::size_t>(c.tokens * c.v_heads)), d_beta(d_g.size());
  gated_delta::recurrent_backward<double>(
      r.in, {contiguous3<const double>(t.at("d_out").data(), c.tokens, c.v_heads, c.d_v), view3<const double>{},
             contiguous3(d_q.data(), c.tokens, c.k_heads, c.d_k), contiguous3(d_k.data(), c.tokens, c.k_heads, c.d_k),
             contiguous3(d_v.data(), c.tokens, c.v_heads, c.d_v), view2<double>{d_g.data(), c.tokens, c.v_heads, c.v_heads},
             view2<double>{d_beta.data(), c.tokens, c.v_heads, c.v_heads}, states_of(t, "local_d_initial", c, c.d_v)});
}

void gated_delta_scan(host_case& t, std::int64_t segments, std::int64_t heads, std::int64_t d_k, std::int64_t d_v,
                      bool backward) {
  const auto& m = t.at("transitions");
  const auto& local = t.at("locals");
  auto& states = t.at("states");
  const std::int64_t matrix = d_k * d_v, square = d_k * d_k;
  for (std::int64_t h = 0; h < heads; ++h) {
    std::vector<double> carry(static_cast<std::size_t>(matrix), 0.0);
    for (std::int64_t step = 0; step < segments; ++step) {
      const std::int64_t r = backward ? segments - 1 - step : step, at = r * heads + h;
      for (std::int64_t n = 0; n < matrix; ++n) states[at * matrix + n] = carry[n];
      std::vector<double> next(carry.size());
      for (std::int64_t i = 0; i < d_k; ++i)
        for (std::int64_t j = 0; j < d_v; ++j) {
          double sum = local[at * matrix + i * d_v + j];
          for (std::int64_t p = 0; p < d_k; ++p)
            sum += (backward ? m[at * square + p * d_k + i] : m[at * square + i * d_k + p]) * carry[p * d_v + j];
          next[i * d_v + j] = sum;
        }
      carry = next;
    }
  }
}

namespace {

// z[t, c] = sum_j w[c, j] x[t - (taps - 1) + j, c] over the rows of t's document (the halo
// counting as the rows before 0), and the input row each tap reads (or none).
struct conv_reads {
  std::vector<std::int64_t> first;  // per row: the first readable row (halo rows are negative)
};

conv_reads readable(const causal_conv_case& c) {
  conv_reads r;
  const std::vector<std::uint8_t> reset = gated_delta::reset_rows({c.starts, c.first}, c.rows);
  std::int64_t start = c.halo ? -(c.taps - 1) : 0;
  for (std::int64_t t = 0; t < c.rows; ++t) {
    if (reset[t]) start = t;
    r.first.push_back(start);
  }
  return r;
}

double conv_input(host_case& t, const causal_conv_case& c, std::int64_t row, std::int64_t ch) {
  return row >= 0 ? t.at("x")[row * c.channels + ch] : t.at("halo")[(c.taps - 1 + row) * c.channels + ch];
}

double conv_sum(host_case& t, const causal_conv_case& c, const conv_reads& r, std::int64_t row, std::int64_t ch) {
  double z = 0;
  for (std::int64_t j = 0; j < c.taps; ++j) {
    const std::int64_t in = row - (c.taps - 1) + j;
    if (in >= r.first[row]) z += t.at("weight")[ch * c.taps + j] * conv_input(t, c, in, ch);
  }
  return z;
}

}  // namespace

void causal_conv_forward(host_case& t, const causal_conv_case& c) {
  const conv_reads r = readable(c);
  for (std::int64_t row = 0; row < c.rows; ++row)
    for (std::int64_t ch = 0; ch < c.channels; ++ch) {
      const double z = conv_sum(t, c, r, row, ch);
      t.at("y")[row * c.channels + ch] = z * sigmoid(z);
    }
}

void causal_conv_backward(host_case& t, const causal_conv_case& c) {
  const conv_reads r = readable(c);
  const std::int64_t halo = c.taps - 1;
  std::vector<double> d_in(static_cast<std::size_t>((c.rows + halo) * c.channels), 0.0);
  auto& d_w = t.at("d_weight");
  for (std::int64_t row = 0; row < c.rows; ++row)
    for (std::int64_t ch = 0; ch < c.channels; ++ch) {
      const double z = conv_sum(t, c, r, row, ch), s = sigmoid(z);
      const double dz = t.at("d_y")[row * c.channels + ch] * (s + z * s * (1.0 - s));
      for (std::int64_t j = 0; j < c.taps; ++j) {
        const std::int64_t in = row - (c.taps - 1) + j;
        if (in < r.first[row]) continue;
        d_in[(in + halo) * c.channels + ch] += dz * t.at("weight")[ch * c.taps + j];
        d_w[ch * c.taps + j] += dz * conv_input(t, c, in, ch);
      }
    }
  for (std::int64_t n = 0; n < c.rows * c.channels; ++n) t.at("d_x")[n] = d_in[halo * c.channels + n];
  if (c.halo)
    for (std::int64_t n = 0; n < halo * c.channels; ++n) t.at("d_halo")[n] = d_in[n];
}

void gated_delta_gates_forward(host_case& t, std::int64_t rows, std::int64_t heads) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::int64_t n = r * heads + h;
      t.at("g")[n] = -std::exp(t.at("a_log")[h]) * softplus(t.at("a")[n] + t.at("dt_bias")[h]);
      t.at("beta")[n] = sigmoid(t.at("b")[n]);
    }
}

void gated_delta_gates_backward(host_case& t, std::int64_t rows, std::int64_t heads) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::int64_t n = r * heads + h;
      const double x = t.at("a")[n] + t.at("dt_bias")[h], e = std::exp(t.at("a_log")[h]), dg = t.at("d_g")[n];
      const double da = -e * (x > 20.0 ? 1.0 : sigmoid(x)) * dg;
      t.at("d_a")[n] = da;
      t.at("d_dt_bias")[h] += da;
      t.at("d_a_log")[h] += -e * softplus(x) * dg;
      const double beta = sigmoid(t.at("b")[n]);
      t.at("d_b")[n] = t.at("d_beta")[n] * beta * (1.0 - beta);
    }
}

}  // namespace upipe::f64
