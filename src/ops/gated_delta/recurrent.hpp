// The gated delta rule token by token, as transformers' torch_recurrent_gated_delta_rule
// writes it, with its backward by hand: the form a reader checks by eye. Templated on the
// real type: the float64 references (backend/op_float64.hpp) run it in double. The chunked
// form that the backends run (ops/gated_delta/chunk_stages.hpp) is held to it.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "ops/op_args.hpp"

namespace upipe::gated_delta {

// Strided views over host memory: element (i, j, k) at data[i * s0 + j * s1 + k].
template <class T>
struct view3 {
  T* data = nullptr;
  std::int64_t n0 = 0, n1 = 0, n2 = 0, s0 = 0, s1 = 0;
  T& operator()(std::int64_t i, std::int64_t j, std::int64_t k) const { return data[i * s0 + j * s1 + k]; }
  bool empty() const { return data == nullptr; }
};
template <class T>
view3<T> contiguous3(T* data, std::int64_t n0, std::int64_t n1, std::int64_t n2) {
  return {data, n0, n1, n2, n1 * n2, n2};
}
// Element (i, j) at data[i * ld + j].
template <class T>
struct view2 {
  T* data = nullptr;
  std::int64_t rows = 0, cols = 0, ld = 0;
  T& operator()(std::int64_t i, std::int64_t j) const { return data[i * ld + j]; }
  bool empty() const { return data == nullptr; }
};

// reset[r] = 1 where the state resets before row r (a document starts there, row 0 included).
std::vector<std::uint8_t> reset_rows(const sequence_documents& documents, std::int64_t rows);

template <class real>
struct recurrent_inputs {
  view3<const real> q, k;   // (s, H_k, d_k)
  view3<const real> v;      // (s, H_v, d_v)
  view2<const real> g, beta;  // (s, H_v)
  view3<const real> initial;  // (H_v, d_k, d_v) or empty
  const std::uint8_t* reset = nullptr;  // (s) reset_rows
  real scale = 0;  // 0: d_k^-0.5
  bool l2 = true;
  real l2_eps = real(1e-6);
};

namespace detail {

// The normalized, scaled rows of one key head: out[t * d + i], and 1 / norm per row.
template <class real>
void normalized_rows(const view3<const real>& x, std::int64_t head, bool l2, real eps, real scale,
                     std::vector<real>& out, std::vector<real>& inv_norm) {
  const std::int64_t s = x.n0, d = x.n2;
  out.assign(static_cast<std::size_t>(s * d), real(0));
  inv_norm.assign(static_cast<std::size_t>(s), real(1));
  for (std::int64_t t = 0; t < s; ++t) {
    real sum = 0;
    for (std::int64_t i = 0; i < d; ++i) sum += x(t, head, i) * x(t, head, i);
    if (l2) inv_norm[t] = real(1) / std::sqrt(sum + eps);
    for (std::int64_t i = 0; i < d; ++i) out[t * d + i] = x(t, head, i) * inv_norm[t] * scale;
  }
}

template <class real>
real resolved_scale(const recurrent_inputs<real>& in) {
  return in.scale != real(0) ? in.scale : real(1) / std::sqrt(static_cast<real>(in.q.n2));
}

// One head's states S_t (after row t), (s + 1) (d_k, d_v) matrices: index 0 the initial.
template <class real>
std::vector<real> head_states(const recurrent_inputs<real>& in, std::int64_t h, const std::vector<real>& kn,
                              const std::vector<real>& qn, const view3<real>* out) {
  const std::int64_t s = in.v.n0, dk = in.q.n2, dv = in.v.n2;
  std::vector<real> states(static_cast<std::size_t>((s + 1) * dk * dv), real(0));
  if (!in.initial.empty())
    for (std::int64_t i = 0; i < dk; ++i)
      for (std::int64_t j = 0; j < dv; ++j) states[i * dv + j] = in.initial(h, i, j);
  std::vector<real> kv(static_cast<std::size_t>(dv));
  for (std::int64_t t = 0; t < s; ++t) {
    const real* prev = &states[t * dk * dv];
    real* next = &states[(t + 1) * dk * dv];
    const real a = in.reset[t] ? real(0) : std::exp(in.g(t, h));
    for (std::int64_t n = 0; n < dk * dv; ++n) next[n] = a * prev[n];
    for (std::int64_t j = 0; j < dv; ++j) {
      real sum = 0;
      for (std::int64_t i = 0; i < dk; ++i) sum += next[i * dv + j] * kn[t * dk + i];
      kv[j] = in.beta(t, h) * (in.v(t, h, j) - sum);
    }
    for (std::int64_t i = 0; i < dk; ++i)
      for (std::int64_t j = 0; j < dv; ++j) next[i * dv + j] += kn[t * dk + i] * kv[j];
    if (out != nullptr)
      for (std::int64_t j = 0; j < dv; ++j) {
        real sum = 0;
        for (std::int64_t i = 0; i < dk; ++i) sum += next[i * dv + j] * qn[t * dk + i];
        (*out)(t, h, j) = sum;
      }
  }
  return states;
}

// d x from d (x * inv_norm * scale): scale * inv_norm * (dy - y (y . dy)) with y = x * inv_norm.
template <class real>
void l2_backward(const view3<const real>& x, std::int64_t t, std::int64_t head, real inv_norm, real scale,
                 bool l2, const real* dy, real* dx) {
  const std::int64_t d = x.n2;
  if (!l2) {
    for (std::int64_t i = 0; i < d; ++i) dx[i] += scale * dy[i];
    return;
  }
  real dot = 0;
  for (std::int64_t i = 0; i < d; ++i) dot += x(t, head, i) * inv_norm * dy[i];
  for (std::int64_t i = 0; i < d; ++i) dx[i] += scale * inv_norm * (dy[i] - x(t, head, i) * inv_norm * dot);
}

}  // namespace detail

// out (s, H_v, d_v) and, unless empty, final_state (H_v, d_k, d_v).
template <class real>
void recurrent_forward(const recurrent_inputs<real>& in, const view3<real>& out, const view3<real>& final_state) {
  const std::int64_t s = in.v.n0, hv = in.v.n1, group = hv / in.q.n1, dk = in.q.n2, dv = in.v.n2;
  std::vector<real> qn, kn, rq, rk;
  for (std::int64_t h = 0; h < hv; ++h) {
    detail::normalized_rows(in.q, h / group, in.l2, in.l2_eps, detail::resolved_scale(in), qn, rq);
    detail::normalized_rows(in.k, h / group, in.l2, in.l2_eps, real(1), kn, rk);
    const std::vector<real> states = detail::head_states(in, h, kn, qn, out.empty() ? nullptr : &out);
    if (final_state.empty()) continue;
    for (std::int64_t i = 0; i < dk; ++i)
      for (std::int64_t j = 0; j < dv; ++j) final_state(h, i, j) = states[(s * dk + i) * dv + j];
  }
}

template <class real>
struct recurrent_gradients {
  view3<const real> d_out;          // (s, H_v, d_v)
  view3<const real> d_final;        // (H_v, d_k, d_v) or empty
  view3<real> d_q, d_k;             // (s, H_k, d_k), written
  view3<real> d_v;                  // (s, H_v, d_v), written
  view2<real> d_g, d_beta;          // (s, H_v), written
  view3<real> d_initial;            // (H_v, d_k, d_v), written, or empty
};

// Back through the recurrence row by row from the last, the states recomputed first.
template <class real>
void recurrent_backward(const recurrent_inputs<real>& in, const recurrent_gradients<real>& gr) {
  const std::int64_t s = in.v.n0, hk = in.q.n1, hv = in.v.n1, group = hv / hk, dk = in.q.n2, dv = in.v.n2;
  const real scale = detail::resolved_scale(in);
  for (std::int64_t t = 0; t < s; ++t)
    for (std::int64_t h = 0; h < hk; ++h)
      for (std::int64_t i = 0; i < dk; ++i) gr.d_q(t, h, i) = gr.d_k(t, h, i) = 0;
  std::vector<real> qn, kn, rq, rk, ds(static_cast<std::size_t>(dk * dv)), dsp(ds.size());
  std::vector<real> dqn(static_cast<std::size_t>(dk)), dkn(dqn.size()), ddelta(static_cast<std::size_t>(dv));
  std::vector<real> dkv(ddelta.size()), kv(ddelta.size()), delta(ddelta.size()), sp(ds.size());
  for (std::int64_t h = 0; h < hv; ++h) {
    const std::int64_t kh = h / group;
    detail::normalized_rows(in.q, kh, in.l2, in.l2_eps, scale, qn, rq);
    detail::normalized_rows(in.k, kh, in.l2, in.l2_eps, real(1), kn, rk);
    const std::vector<real> states = detail::head_states(in, h, kn, qn, static_cast<const view3<real>*>(nullptr));
    for (std::int64_t n = 0; n < dk * dv; ++n) ds[n] = gr.d_final.empty() ? real(0) : gr.d_final(h, n / dv, n % dv);
    for (std::int64_t t = s - 1; t >= 0; --t) {
      const real* st = &states[(t + 1) * dk * dv];
      const real* prev = &states[t * dk * dv];
      const real* q = &qn[t * dk];
      const real* k = &kn[t * dk];
      const real a = in.reset[t] ? real(0) : std::exp(in.g(t, h)), b = in.beta(t, h);
      // o_t = S_t^T q: dS += q do^T, dq = S_t do.
      for (std::int64_t i = 0; i < dk; ++i) {
        real sum = 0;
        for (std::int64_t j = 0; j < dv; ++j) {
          ds[i * dv + j] += q[i] * gr.d_out(t, h, j);
          sum += st[i * dv + j] * gr.d_out(t, h, j);
        }
        dqn[i] = sum;
      }
      // S_t = S' + k delta^T, delta = b (v - S'^T k), S' = a S_{t-1}.
      for (std::int64_t n = 0; n < dk * dv; ++n) sp[n] = a * prev[n];
      for (std::int64_t j = 0; j < dv; ++j) {
        real sum = 0, dsum = 0;
        for (std::int64_t i = 0; i < dk; ++i) {
          sum += sp[i * dv + j] * k[i];
          dsum += ds[i * dv + j] * k[i];
        }
        kv[j] = sum;
        ddelta[j] = dsum;
      }
      real db = 0;
      for (std::int64_t j = 0; j < dv; ++j) {
        delta[j] = b * (in.v(t, h, j) - kv[j]);
        gr.d_v(t, h, j) = b * ddelta[j];
        db += ddelta[j] * (in.v(t, h, j) - kv[j]);
        dkv[j] = -b * ddelta[j];
      }
      for (std::int64_t i = 0; i < dk; ++i) {
        real sum = 0, sum2 = 0;
        for (std::int64_t j = 0; j < dv; ++j) {
          sum += ds[i * dv + j] * delta[j];
          sum2 += sp[i * dv + j] * dkv[j];
        }
        dkn[i] = sum + sum2;
      }
      real da = 0;
      for (std::int64_t i = 0; i < dk; ++i)
        for (std::int64_t j = 0; j < dv; ++j) {
          dsp[i * dv + j] = ds[i * dv + j] + k[i] * dkv[j];
          da += dsp[i * dv + j] * prev[i * dv + j];
        }
      gr.d_beta(t, h) = db;
      gr.d_g(t, h) = a * da;
      for (std::int64_t n = 0; n < dk * dv; ++n) ds[n] = a * dsp[n];
      detail::l2_backward(in.q, t, kh, rq[t], scale, in.l2, dqn.data(), &gr.d_q(t, kh, 0));
      detail::l2_backward(in.k, t, kh, rk[t], real(1), in.l2, dkn.data(), &gr.d_k(t, kh, 0));
    }
    if (!gr.d_initial.empty())
      for (std::int64_t n = 0; n < dk * dv; ++n) gr.d_initial(h, n / dv, n % dv) = ds[n];
  }
}

}  // namespace upipe::gated_delta
