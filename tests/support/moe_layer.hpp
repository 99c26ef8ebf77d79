// A sparse layer alone (model/moe_mlp.hpp) on any backend, with random weights, for the
// layer tests of the cpu (tests/model/moe_layer_test.cpp) and of the GPU
// (tests/gpu/moe_test.cpp): its weights and gradients as views of tensors of their own, a
// tile of normed rows, the residual, the incoming gradient and the load-balancing
// statistics' buffers, all filled from one seed; and the layer's forward in float64 on
// the host, from the same values, for any choices and capacity.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "backend/ops.hpp"
#include "core/random.hpp"
#include "model/config.hpp"
#include "model/moe_mlp.hpp"
#include "model/parameters.hpp"

namespace upipe::testing {

class moe_layer {
 public:
  // n tokens of `model`'s sparse layer; values normal with `scale` (the router's larger,
  // so that the routing is far from uniform), rounded to bf16 where the backend stores bf16
  // or `bf16_values` asks (a cpu layer beside a GPU one: the same inputs).
  moe_layer(const model_config& model, backend& be, std::int64_t n, bool bf16_values = false, std::uint64_t seed = 7)
      : model_(model), be_(be), n_(n), seed_(seed), bf16_values_(bf16_values || be.work_dtype() == dtype::bf16) {
    const std::int64_t D = model.hidden_size, I = model.moe.expert_width, E = model.moe.experts;
    router_ = make({E, D}, 1.0f, "router");
    w_.router = router_.matrix();
    g_.router = make_grad({E, D});
    for (std::int64_t e = 0; e < E; ++e) {
      w_.gate.emplace_back(keep(make({I, D}, 0.15f, "gate")));
      w_.up.emplace_back(keep(make({I, D}, 0.15f, "up")));
      w_.down.emplace_back(keep(make({D, I}, 0.2f, "down")));
      g_.gate.emplace_back(make_grad({I, D}));
      g_.up.emplace_back(make_grad({I, D}));
      g_.down.emplace_back(make_grad({D, I}));
    }
    if (model.moe.shared_width > 0) {
      const std::int64_t S = model.moe.shared_width;
      w_.shared_gate = keep(make({S, D}, 0.15f, "shared_gate"));
      w_.shared_up = keep(make({S, D}, 0.15f, "shared_up"));
      w_.shared_down = keep(make({D, S}, 0.2f, "shared_down"));
      w_.shared_expert_gate = keep(make({1, D}, 0.2f, "shared_expert_gate"));
      g_.shared_gate = make_grad({S, D});
      g_.shared_up = make_grad({S, D});
      g_.shared_down = make_grad({D, S});
      g_.shared_expert_gate = make_grad({1, D});
    }
    h_ = make({n, D}, 1.0f, "h");
    y0_ = host(make({n, D}, 1.0f, "y0"));
    d_y_ = make({n, D}, 1.0f, "d_y", dtype::f32);
    counted_ = be.allocate(mem_tag::activations, dtype::u8, {n, 1}, "counted");
    std::vector<std::uint8_t> marks(static_cast<std::size_t>(n));
    for (std::int64_t t = 0; t < n; ++t) marks[static_cast<std::size_t>(t)] = t % 5 == 3 ? 0 : 1;
    be.upload_bytes(counted_, marks.data(), marks.size());
    balance_ = be.allocate_zeroed(mem_tag::activations, dtype::i32, {1, 4 * E}, "balance");
    aux_grad_ = make({1, E}, 0.05f, "aux_grad", dtype::f32);
  }

  const moe_weights& weights() const { return w_; }
  const moe_grads& grads() const { return g_; }
  mat_view h() const { return h_.matrix(); }
  const std::vector<float>& h_host() const { return h_host_; }
  const std::vector<float>& y0() const { return y0_; }
  const tensor& balance() const { return balance_; }

  struct result {
    std::vector<float> y, d_h;
    std::vector<std::vector<float>> grads;  // router, then each expert's gate, up and down
  };
  // Forward then backward of one tile (layer 1, its first token 0), the statistics
  // collected and the aux gradient taken on the counted rows; the host waits counted apart.
  result run(const moe_options& options, std::uint64_t* syncs_inside = nullptr, int rank = 0) {
    moe_mlp layer(model_, be_, options, rank);
    tensor y = be_.allocate(mem_tag::activations, be_.work_dtype(), {n_, model_.hidden_size}, "y");
    be_.upload_f32(y, y0_.data());
    tensor d_h = be_.allocate(mem_tag::activations, dtype::f32, {n_, model_.hidden_size}, "d_h");
    zero_grads();
    moe_mlp::tile at{1, 0, counted_.matrix(), &balance_, nullptr};
    const std::uint64_t before = be_.host_syncs();
    layer.forward(w_, at, h_.matrix(), y.matrix());
    at.balance = nullptr;
    at.aux_grad = &aux_grad_;
    layer.backward(w_, g_, at, h_.matrix(), d_y_.matrix(), d_h.matrix());
    if (syncs_inside != nullptr) *syncs_inside = be_.host_syncs() - before;
    result r{host(y), host(d_h), {}};
    for (const tensor& g : grads_) r.grads.push_back(host(g));
    return r;
  }

  // The forward in float64: y0 + each token's kept experts, weighted by its renormalized (or
  // plain) probabilities at `choices` (n x k; empty: the top k of the float64 probabilities),
  // an expert keeping its first `capacity` tokens (0: all); plus the shared expert.
  std::vector<double> reference(std::int64_t capacity, std::vector<std::int32_t> choices = {}) const {
    const std::int64_t D = model_.hidden_size, E = model_.moe.experts, k = model_.moe.top_k;
    std::vector<double> y(y0_.begin(), y0_.end());
    std::vector<std::int64_t> seen(static_cast<std::size_t>(E), 0);
    for (std::int64_t t = 0; t < n_; ++t) {
      const std::vector<double> p = probabilities(t);
      if (choices.size() < static_cast<std::size_t>((t + 1) * k)) {
        std::vector<std::int32_t> order(static_cast<std::size_t>(E));
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return p[a] > p[b]; });
        choices.insert(choices.end(), order.begin(), order.begin() + k);
      }
      double chosen = 0;
      for (std::int64_t j = 0; j < k; ++j) chosen += p[choices[static_cast<std::size_t>(t * k + j)]];
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int32_t e = choices[static_cast<std::size_t>(t * k + j)];
        if (capacity > 0 && seen[static_cast<std::size_t>(e)]++ >= capacity) continue;
        const double w = model_.moe.normalize_top_k ? p[e] / chosen : p[e];
        const std::vector<double> out = gated(t, hosts_.at(index("gate", e)), hosts_.at(index("up", e)),
                                              hosts_.at(index("down", e)), model_.moe.expert_width);
        for (std::int64_t c = 0; c < D; ++c) y[static_cast<std::size_t>(t * D + c)] += w * out[static_cast<std::size_t>(c)];
      }
      if (model_.moe.shared_width > 0) {
        const std::vector<double> s = gated(t, named("shared_gate"), named("shared_up"), named("shared_down"),
                                            model_.moe.shared_width);
        const double z = dot(named("shared_expert_gate"), 0, t);
        for (std::int64_t c = 0; c < D; ++c)
          y[static_cast<std::size_t>(t * D + c)] += s[static_cast<std::size_t>(c)] / (1.0 + std::exp(-z));
      }
    }
    return y;
  }

 private:
  tensor make(const shape& dims, float scale, const char* label, dtype type = dtype::bf16) {
    tensor t = be_.allocate(mem_tag::weights, type == dtype::f32 ? dtype::f32 : be_.work_dtype(), dims, label);
    std::vector<float> v(static_cast<std::size_t>(t.numel()));
    fill_normal(v, seed_, stream_++, scale);
    if (bf16_values_ && type != dtype::f32)
      for (float& x : v) x = round_to_bf16(x);  // the host's copy is what the device holds
    be_.upload_f32(t, v.data());
    names_.push_back(label);
    hosts_.push_back(v);
    if (std::string(label) == "h") h_host_ = v;
    return t;
  }
  mat_view keep(tensor t) {
    tensors_.push_back(std::move(t));
    return tensors_.back().matrix();
  }
  mat_view make_grad(const shape& dims) {
    grads_.push_back(be_.allocate(mem_tag::grads, dtype::f32, dims, "grad"));
    return grads_.back().matrix();
  }
  void zero_grads() {
    for (const tensor& g : grads_) ops::fill_heads(be_, ops::as_heads(g.matrix()), 0.0f);
  }
  std::vector<float> host(const tensor& t) const {
    std::vector<float> v(static_cast<std::size_t>(t.numel()));
    be_.download_f32(v.data(), t);
    return v;
  }
  // The i-th tensor made with `label` (experts: one each, in order).
  std::size_t index(const char* label, std::int64_t i) const {
    for (std::size_t at = 0; at < names_.size(); ++at)
      if (names_[at] == label && i-- == 0) return at;
    return names_.size();
  }
  const std::vector<float>& named(const char* label) const { return hosts_.at(index(label, 0)); }
  // Row r of a (rows, D) matrix . row t of h.
  double dot(const std::vector<float>& m, std::int64_t r, std::int64_t t) const {
    const std::int64_t D = model_.hidden_size;
    double s = 0;
    for (std::int64_t c = 0; c < D; ++c)
      s += static_cast<double>(m[static_cast<std::size_t>(r * D + c)]) * h_host_[static_cast<std::size_t>(t * D + c)];
    return s;
  }
  std::vector<double> probabilities(std::int64_t t) const {
    const std::int64_t E = model_.moe.experts;
    std::vector<double> z(static_cast<std::size_t>(E));
    for (std::int64_t e = 0; e < E; ++e) z[static_cast<std::size_t>(e)] = dot(named("router"), e, t);
    const double top = *std::max_element(z.begin(), z.end());
    double sum = 0;
    for (double& v : z) sum += (v = std::exp(v - top));
    for (double& v : z) v /= sum;
    return z;
  }
  // down (silu(gate h) * (up h)) for token t, width `width`.
  std::vector<double> gated(std::int64_t t, const std::vector<float>& gate, const std::vector<float>& up,
                            const std::vector<float>& down, std::int64_t width) const {
    const std::int64_t D = model_.hidden_size;
    std::vector<double> act(static_cast<std::size_t>(width)), out(static_cast<std::size_t>(D), 0.0);
    for (std::int64_t i = 0; i < width; ++i) {
      const double g = dot(gate, i, t), u = dot(up, i, t);
      act[static_cast<std::size_t>(i)] = g / (1.0 + std::exp(-g)) * u;
    }
    for (std::int64_t c = 0; c < D; ++c)
      for (std::int64_t i = 0; i < width; ++i)
        out[static_cast<std::size_t>(c)] += down[static_cast<std::size_t>(c * width + i)] * act[static_cast<std::size_t>(i)];
    return out;
  }

  const model_config& model_;
  backend& be_;
  std::int64_t n_;
  std::uint64_t seed_, stream_ = 1;
  bool bf16_values_;
  moe_weights w_;
  moe_grads g_;
  tensor router_, h_, d_y_, counted_, balance_, aux_grad_;
  std::vector<float> h_host_, y0_;
  std::vector<tensor> tensors_, grads_;
  std::vector<std::string> names_;
  std::vector<std::vector<float>> hosts_;
};

}  // namespace upipe::testing
