// The registry's entries for the mixture-of-experts ops (ops/op_args.hpp): the router's
// top-k (its own or given choices) and its backward, the dispatch (counts, offsets,
// positions, a capacity), the permute, the weighted combine (with a shared expert) and its
// backward, the load-balancing statistics and Qwen2-MoE's sigmoid gate's backward; the
// grouped expert GEMMs are op_registry_moe_gemm.cpp's. Forward ops are held to their
// float64 definitions below; backward ops to central differences of an objective. A case's
// choices are distinct experts per token, skewed so that some experts take many tokens and
// some none (prepare), and its dispatch is this file's definition of moe_dispatch.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "backend/op_cases.hpp"
#include "backend/op_float64.hpp"
#include "backend/ops.hpp"

namespace upipe::op_cases {

namespace {

// n tokens, k slots each, D columns, E experts; capacity 0: dropless.
struct moe_shape {
  std::int64_t n, k, D, E, capacity = 0;
};

std::string moe_text(const moe_shape& s) {
  std::string t = dims_text({{"tokens", s.n}, {"k", s.k}, {"cols", s.D}, {"experts", s.E}});
  if (s.capacity > 0) t += " capacity " + std::to_string(s.capacity);
  return t;
}

// Token t's j-th choice: distinct within a token for E coprime with 3, the low experts
// chosen more often than the high ones.
std::int32_t choice(const moe_shape& s, std::int64_t t, std::int64_t j) {
  const std::int64_t a = (t * t * 5 + t) % s.E / 2;
  return static_cast<std::int32_t>((a + 3 * j) % s.E);
}

// moe_dispatch's definition: expert by expert, each expert's tokens in order, at most
// `capacity` rows an expert (0: all); position -1 where dropped.
struct host_dispatch {
  std::vector<std::int64_t> position, offsets;
};
host_dispatch dispatch_of(const moe_shape& s, const std::vector<std::int64_t>& experts) {
  host_dispatch d;
  std::vector<std::int64_t> count(static_cast<std::size_t>(s.E), 0), seen(count.size(), 0);
  for (std::int64_t e : experts) ++count[static_cast<std::size_t>(e)];
  d.offsets.assign(static_cast<std::size_t>(s.E + 1), 0);
  for (std::int64_t e = 0; e < s.E; ++e) {
    const std::int64_t c = count[static_cast<std::size_t>(e)];
    const std::int64_t kept = s.capacity > 0 ? std::min(c, s.capacity) : c;
    d.offsets[static_cast<std::size_t>(e + 1)] = d.offsets[static_cast<std::size_t>(e)] + kept;
  }
  for (std::int64_t e : experts) {
    const std::int64_t rank = seen[static_cast<std::size_t>(e)]++;
    d.position.push_back(s.capacity > 0 && rank >= s.capacity ? -1 : d.offsets[static_cast<std::size_t>(e)] + rank);
  }
  return d;
}
std::vector<std::int64_t> choices_of(const moe_shape& s) {
  std::vector<std::int64_t> x;
  for (std::int64_t t = 0; t < s.n; ++t)
    for (std::int64_t j = 0; j < s.k; ++j) x.push_back(choice(s, t, j));
  return x;
}
std::int64_t dispatched_rows(const moe_shape& s) { return moe_dispatch_rows(s.n, s.k, s.E, s.capacity); }

void upload_ids(backend& be, const tensor& t, const std::vector<std::int64_t>& values) {
  const std::vector<std::int32_t> ids(values.begin(), values.end());
  be.upload_bytes(t, ids.data(), ids.size() * sizeof(std::int32_t));
}
void upload_choices(backend& be, const case_tensors& t, const moe_shape& s) { upload_ids(be, t["experts"], choices_of(s)); }
void upload_position(backend& be, const case_tensors& t, const moe_shape& s) {
  upload_ids(be, t["position"], dispatch_of(s, choices_of(s)).position);
}

case_tensor ids_tensor(const char* name, shape dims) {
  return {.name = name, .type = case_dtype::i32, .dims = std::move(dims), .fill = case_fill::ids, .lo = 0.0f, .hi = 1.0f};
}
// An exact output: ids and rows.
case_tensor exact(case_tensor t) { return out(std::move(t), 1e-12, 0.0); }

void softmax_row(const double* z, double* p, std::int64_t E) {
  const double top = *std::max_element(z, z + E);
  double sum = 0;
  for (std::int64_t e = 0; e < E; ++e) sum += std::exp(z[e] - top);
  for (std::int64_t e = 0; e < E; ++e) p[e] = std::exp(z[e] - top) / sum;
}

// The router: softmax, the top k (descending, the lower expert among equals) or the given
// choices, their probabilities renormalized.
op_case route_case(const moe_shape& s, bool normalize, bool given, double bytes) {
  op_case c;
  c.size = moe_text(s) + (normalize ? " normalized" : "") + (given ? " given" : "");
  case_tensor experts = ids_tensor("experts", {s.n, s.k});
  c.tensors = {{.name = "logits", .type = case_dtype::f32, .dims = {s.n, s.E}, .lo = -3.0f, .hi = 3.0f},
               out({.name = "probs", .type = case_dtype::f32, .dims = {s.n, s.E}}),
               out({.name = "weights", .type = case_dtype::f32, .dims = {s.n, s.k}}),
               given ? experts : exact(experts)};
  if (given) c.prepare = [s](backend& be, const case_tensors& t) { upload_choices(be, t, s); };
  c.run = [normalize, given](backend& be, const case_tensors& t) {
    ops::moe_route(be, {t["logits"].matrix(), t["probs"].matrix(), t["weights"].matrix(), t["experts"].matrix(),
                        normalize, given});
  };
  c.float64 = [s, normalize, given](f64::host_case& h) {
    for (std::int64_t r = 0; r < s.n; ++r) {
      double* p = &h["probs"][static_cast<std::size_t>(r * s.E)];
      softmax_row(&h["logits"][static_cast<std::size_t>(r * s.E)], p, s.E);
      std::vector<std::int64_t> order(static_cast<std::size_t>(s.E));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [p](std::int64_t a, std::int64_t b) { return p[a] > p[b]; });
      double* x = &h["experts"][static_cast<std::size_t>(r * s.k)];
      if (!given)
        for (std::int64_t j = 0; j < s.k; ++j) x[j] = static_cast<double>(order[static_cast<std::size_t>(j)]);
      double chosen = 0;
      for (std::int64_t j = 0; j < s.k; ++j) chosen += p[static_cast<std::int64_t>(x[j])];
      for (std::int64_t j = 0; j < s.k; ++j) {
        const double w = p[static_cast<std::int64_t>(x[j])];
        h["weights"][static_cast<std::size_t>(r * s.k + j)] = normalize ? w / chosen : w;
      }
    }
  };
  c.bytes = bytes;
  return c;
}

// The objective sum(weights . d_weights) + sum over the counted rows of probs . aux_grad,
// with the routing from the logits: its gradient by the logits is what moe_route_backward writes.
op_case route_backward_case(const moe_shape& s, bool normalize, double bytes) {
  op_case c;
  c.size = moe_text(s) + (normalize ? " normalized" : "");
  c.tensors = {{.name = "logits", .type = case_dtype::f32, .dims = {s.n, s.E}, .lo = -2.0f, .hi = 2.0f},
               {.name = "probs", .type = case_dtype::f32, .dims = {s.n, s.E}, .fill = case_fill::zero},
               {.name = "weights", .type = case_dtype::f32, .dims = {s.n, s.k}, .fill = case_fill::zero},
               ids_tensor("experts", {s.n, s.k}),
               {.name = "d_weights", .type = case_dtype::f32, .dims = {s.n, s.k}},
               {.name = "aux_grad", .type = case_dtype::f32, .dims = {1, s.E}},
               {.name = "counted", .type = case_dtype::u8, .dims = {s.n, 1}, .fill = case_fill::ids, .lo = 0.0f, .hi = 2.0f},
               out({.name = "d_logits", .type = case_dtype::f32, .dims = {s.n, s.E}}, bf16_tol, 1e-5)};
  const auto route = [normalize](backend& be, const case_tensors& t) {
    ops::moe_route(be, {t["logits"].matrix(), t["probs"].matrix(), t["weights"].matrix(), t["experts"].matrix(), normalize});
  };
  // Each row's logits a permutation of levels 0.5 apart, plus a little of the random fill:
  // no two cross under the differences' step, so no top-k choice or order flips.
  c.prepare = [s, route](backend& be, const case_tensors& t) {
    std::vector<float> z(static_cast<std::size_t>(s.n * s.E));
    be.download_f32(z.data(), t["logits"]);
    for (std::int64_t r = 0; r < s.n; ++r)
      for (std::int64_t e = 0; e < s.E; ++e) {
        float& v = z[static_cast<std::size_t>(r * s.E + e)];
        v = 0.5f * static_cast<float>((e * 3 + r) % s.E) - 1.5f + 0.05f * v;
      }
    be.upload_f32(t["logits"], z.data());
    route(be, t);
  };
  c.run = [normalize](backend& be, const case_tensors& t) {
    ops::moe_route_backward(be, {t["probs"].matrix(), t["experts"].matrix(), t["d_weights"].matrix(),
                                 t["aux_grad"].matrix(), t["counted"].matrix(), t["d_logits"].matrix(), normalize});
  };
  c.objective = [s, route](backend& be, const case_tensors& t) {
    route(be, t);
    std::vector<float> probs(static_cast<std::size_t>(s.n * s.E)), aux(static_cast<std::size_t>(s.E));
    std::vector<std::uint8_t> counted(static_cast<std::size_t>(s.n));
    be.download_f32(probs.data(), t["probs"]);
    be.download_f32(aux.data(), t["aux_grad"]);
    be.download_bytes(counted.data(), t["counted"], counted.size());
    double sum = host_dot(be, t["weights"], t["d_weights"]);
    for (std::size_t i = 0; i < probs.size(); ++i)
      if (counted[i / aux.size()] != 0) sum += static_cast<double>(probs[i]) * aux[i % aux.size()];
    return sum;
  };
  c.gradients = {{"logits", "d_logits"}};
  c.bytes = bytes;
  return c;
}

// The dispatch of the case's choices: positions and offsets exactly as defined above.
op_case dispatch_case(const moe_shape& s, double bytes) {
  op_case c;
  c.size = moe_text(s);
  c.tensors = {ids_tensor("experts", {s.n, s.k}), exact(ids_tensor("position", {s.n, s.k})),
               exact(ids_tensor("offsets", {1, s.E + 1})), ids_tensor("scratch", {moe_dispatch_scratch_rows(s.n), s.E})};
  c.prepare = [s](backend& be, const case_tensors& t) { upload_choices(be, t, s); };
  c.run = [s](backend& be, const case_tensors& t) {
    ops::moe_dispatch(be, {t["experts"].matrix(), t["position"].matrix(), t["offsets"].matrix(), t["scratch"].matrix(),
                           s.capacity});
  };
  c.float64 = [s](f64::host_case& h) {
    std::vector<std::int64_t> experts(h["experts"].begin(), h["experts"].end());
    const host_dispatch d = dispatch_of(s, experts);
    std::copy(d.position.begin(), d.position.end(), h["position"].begin());
    std::copy(d.offsets.begin(), d.offsets.end(), h["offsets"].begin());
  };
  c.bytes = bytes;
  return c;
}

// Permute: each kept slot's row a copy of its token's; the rows no slot names untouched.
op_case permute_case(const moe_shape& s, double bytes) {
  op_case c;
  c.size = moe_text(s);
  c.tensors = {{.name = "src", .dims = {s.n, s.D}}, ids_tensor("position", {s.n, s.k}),
               out({.name = "dst", .dims = {dispatched_rows(s), s.D}})};
  c.prepare = [s](backend& be, const case_tensors& t) { upload_position(be, t, s); };
  c.run = [](backend& be, const case_tensors& t) {
    ops::moe_permute(be, {t["src"].matrix(), t["position"].matrix(), t["dst"].matrix()});
  };
  c.float64 = [s](f64::host_case& h) {
    const std::vector<std::int64_t> position = dispatch_of(s, choices_of(s)).position;
    for (std::int64_t i = 0; i < s.n * s.k; ++i) {
      const std::int64_t at = position[static_cast<std::size_t>(i)];
      if (at < 0) continue;
      for (std::int64_t j = 0; j < s.D; ++j)
        h["dst"][static_cast<std::size_t>(at * s.D + j)] = h["src"][static_cast<std::size_t>(i / s.k * s.D + j)];
    }
  };
  c.bytes = bytes;
  return c;
}

// dst[t] += sum_j w[t][j] src[position[t][j]] (+ sigmoid(z[t]) shared[t]).
void combine_f64(f64::host_case& h, const moe_shape& s, bool weighted, bool shared) {
  const std::vector<std::int64_t> position = dispatch_of(s, choices_of(s)).position;
  for (std::int64_t t = 0; t < s.n; ++t)
    for (std::int64_t c = 0; c < s.D; ++c) {
      double sum = 0;
      for (std::int64_t j = 0; j < s.k; ++j) {
        const std::int64_t at = position[static_cast<std::size_t>(t * s.k + j)];
        if (at < 0) continue;
        const double w = weighted ? h["weights"][static_cast<std::size_t>(t * s.k + j)] : 1.0;
        sum += w * h["src"][static_cast<std::size_t>(at * s.D + c)];
      }
      if (shared)
        sum += h["shared"][static_cast<std::size_t>(t * s.D + c)] / (1.0 + std::exp(-h["z"][static_cast<std::size_t>(t)]));
      h["dst"][static_cast<std::size_t>(t * s.D + c)] += sum;
    }
}

op_case combine_case(const moe_shape& s, bool weighted, bool shared, double bytes) {
  op_case c;
  c.size = moe_text(s) + (weighted ? " weighted" : "") + (shared ? " shared" : "");
  c.tensors = {{.name = "src", .dims = {dispatched_rows(s), s.D}},
               ids_tensor("position", {s.n, s.k}),
               {.name = "weights", .type = case_dtype::f32, .dims = {s.n, s.k}, .lo = 0.0f},
               {.name = "shared", .dims = {s.n, s.D}},
               {.name = "z", .type = case_dtype::f32, .dims = {s.n, 1}, .lo = -4.0f, .hi = 4.0f},
               out({.name = "dst", .dims = {s.n, s.D}})};
  c.prepare = [s](backend& be, const case_tensors& t) { upload_position(be, t, s); };
  c.run = [weighted, shared](backend& be, const case_tensors& t) {
    ops::moe_combine(be, {t["src"].matrix(), t["position"].matrix(), weighted ? t["weights"].matrix() : mat_view{},
                          shared ? t["shared"].matrix() : mat_view{}, shared ? t["z"].matrix() : mat_view{},
                          t["dst"].matrix()});
  };
  c.float64 = [s, weighted, shared](f64::host_case& h) { combine_f64(h, s, weighted, shared); };
  c.bytes = bytes;
  return c;
}

// The objective sum(dst . d_dst) over dst = the weighted combine of src from zero: its
// gradients by src and by the weights are what moe_combine_backward writes.
op_case combine_backward_case(const moe_shape& s, double bytes) {
  op_case c;
  c.size = moe_text(s);
  c.tensors = {{.name = "src", .type = case_dtype::f32, .dims = {dispatched_rows(s), s.D}},
               ids_tensor("position", {s.n, s.k}),
               {.name = "weights", .type = case_dtype::f32, .dims = {s.n, s.k}, .lo = 0.0f},
               {.name = "dst", .type = case_dtype::f32, .dims = {s.n, s.D}, .fill = case_fill::zero},
               {.name = "d_dst", .type = case_dtype::f32, .dims = {s.n, s.D}},
               out({.name = "d_src", .type = case_dtype::f32, .dims = {dispatched_rows(s), s.D}}),
               out({.name = "d_weights", .type = case_dtype::f32, .dims = {s.n, s.k}}, bf16_tol, 1e-5)};
  c.prepare = [s](backend& be, const case_tensors& t) { upload_position(be, t, s); };
  c.run = [](backend& be, const case_tensors& t) {
    ops::moe_combine_backward(be, {t["d_dst"].matrix(), t["position"].matrix(), t["weights"].matrix(), t["src"].matrix(),
                                   t["d_src"].matrix(), t["d_weights"].matrix()});
  };
  c.objective = [](backend& be, const case_tensors& t) {
    ops::fill_heads(be, ops::as_heads(t["dst"].matrix()), 0.0f);
    ops::moe_combine(be, {t["src"].matrix(), t["position"].matrix(), t["weights"].matrix(), {}, {}, t["dst"].matrix()});
    return host_dot(be, t["dst"], t["d_dst"]);
  };
  c.gradients = {{"src", "d_src"}, {"weights", "d_weights"}};
  c.bytes = bytes;
  return c;
}

// The statistics over the counted rows, added to sums already there (the case starts them
// at zero and runs twice); the test cases read them back into `stats` (f32: counts, then
// probability sums), the perf case times the op alone.
op_case balance_case(const moe_shape& s, bool readable, double bytes) {
  op_case c;
  c.size = moe_text(s);
  c.tensors = {{.name = "probs", .type = case_dtype::f32, .dims = {s.n, s.E}, .lo = 0.0f},
               ids_tensor("experts", {s.n, s.k}),
               {.name = "counted", .type = case_dtype::u8, .dims = {s.n, 1}, .fill = case_fill::ids, .lo = 0.0f, .hi = 2.0f},
               ids_tensor("sums", {1, 4 * s.E}),  // ids in [0, 1): zero words
               out({.name = "stats", .type = case_dtype::f32, .dims = {1, 2 * s.E}, .fill = case_fill::zero})};
  c.prepare = [s](backend& be, const case_tensors& t) { upload_choices(be, t, s); };
  c.run = [s, readable](backend& be, const case_tensors& t) {
    const moe_balance_args a{t["probs"].matrix(), t["experts"].matrix(), t["counted"].matrix(), t["sums"].matrix()};
    ops::moe_balance(be, a);
    if (!readable) return;
    ops::moe_balance(be, a);
    std::vector<std::uint64_t> words(static_cast<std::size_t>(2 * s.E));
    be.download_bytes(words.data(), t["sums"], words.size() * sizeof(std::uint64_t));
    std::vector<float> stats;
    for (std::int64_t e = 0; e < 2 * s.E; ++e)
      stats.push_back(e < s.E ? static_cast<float>(words[static_cast<std::size_t>(e)])
                              : static_cast<float>(std::bit_cast<double>(words[static_cast<std::size_t>(e)])));
    be.upload_f32(t["stats"], stats.data());
  };
  c.float64 = [s](f64::host_case& h) {
    for (std::int64_t r = 0; r < s.n; ++r) {
      if (h["counted"][static_cast<std::size_t>(r)] == 0) continue;
      for (std::int64_t j = 0; j < s.k; ++j)
        h["stats"][static_cast<std::size_t>(choice(s, r, j))] += 2;
      for (std::int64_t e = 0; e < s.E; ++e)
        h["stats"][static_cast<std::size_t>(s.E + e)] += 2 * h["probs"][static_cast<std::size_t>(r * s.E + e)];
    }
  };
  c.bytes = bytes;
  return c;
}

// Qwen2-MoE's shared expert's gate: the objective sum(sigmoid(z) s . d_y), on the host.
op_case sigmoid_gate_backward_case(const moe_shape& s, double bytes) {
  op_case c;
  c.size = dims_text({{"rows", s.n}, {"cols", s.D}});
  c.tensors = {{.name = "z", .type = case_dtype::f32, .dims = {s.n, 1}, .lo = -4.0f, .hi = 4.0f},
               {.name = "s", .type = case_dtype::f32, .dims = {s.n, s.D}},
               {.name = "d_y", .type = case_dtype::f32, .dims = {s.n, s.D}},
               out({.name = "d_s", .type = case_dtype::f32, .dims = {s.n, s.D}}),
               out({.name = "d_z", .type = case_dtype::f32, .dims = {s.n, 1}}, bf16_tol, 1e-5)};
  c.run = [](backend& be, const case_tensors& t) {
    ops::sigmoid_gate_backward(be, {t["z"].matrix(), t["s"].matrix(), t["d_y"].matrix(), t["d_s"].matrix(),
                                    t["d_z"].matrix()});
  };
  c.objective = [s](backend& be, const case_tensors& t) {
    std::vector<float> z(static_cast<std::size_t>(s.n)), v(static_cast<std::size_t>(s.n * s.D)), d_y(v.size());
    be.download_f32(z.data(), t["z"]);
    be.download_f32(v.data(), t["s"]);
    be.download_f32(d_y.data(), t["d_y"]);
    double sum = 0;
    for (std::size_t i = 0; i < v.size(); ++i) {
      const double gate = 1.0 / (1.0 + std::exp(-static_cast<double>(z[i / static_cast<std::size_t>(s.D)])));
      sum += gate * v[i] * d_y[i];
    }
    return sum;
  };
  c.gradients = {{"z", "d_z"}, {"s", "d_s"}};
  c.bytes = bytes;
  return c;
}

// Small tiles, one of E = 128 experts, and capacities that drop rows; the router's
// differences take experts whose count is coprime with 3 (prepare's levels).
const std::vector<moe_shape> moe_test_shapes = {{9, 2, 37, 8}, {33, 3, 64, 7}, {20, 8, 16, 128}, {40, 2, 24, 8, 6},
                                                {300, 4, 8, 16, 40}};
const std::vector<moe_shape> router_gradient_shapes = {{9, 2, 1, 8}, {13, 3, 1, 7}};

template <class Make>
op_entry moe_entry(const char* name, Make make, double bytes_per_element,
                   const std::vector<moe_shape>& shapes = moe_test_shapes) {
  return {name,
          [make, &shapes] {
            std::vector<op_case> cases;
            for (const moe_shape& s : shapes) cases.push_back(make(s, 0.0, true));
            return cases;
          },
          [make, bytes_per_element](std::int64_t tokens, dtype work) {
            // Qwen3-30B-A3B's router and dispatch: 128 experts, top 8, D 2048.
            const moe_shape s{tokens, 8, 2048, 128};
            return make(s, bytes_per_element * static_cast<double>(tokens * s.k * s.D) * dtype_size(work), false);
          }};
}

}  // namespace

std::vector<op_entry> moe_op_entries() {
  std::vector<op_entry> entries = {
      moe_entry("moe_route", [](const moe_shape& s, double b, bool) { return route_case(s, true, false, b); }, 0.1),
      moe_entry("moe_route_given", [](const moe_shape& s, double b, bool) { return route_case(s, false, true, b); }, 0.1),
      moe_entry("moe_route_backward", [](const moe_shape& s, double b, bool) { return route_backward_case(s, true, b); },
                0.1, router_gradient_shapes),
      moe_entry("moe_route_backward_plain",
                [](const moe_shape& s, double b, bool) { return route_backward_case(s, false, b); }, 0.1,
                router_gradient_shapes),
      moe_entry("moe_dispatch", [](const moe_shape& s, double b, bool) { return dispatch_case(s, b); }, 0.01),
      moe_entry("moe_permute", [](const moe_shape& s, double b, bool) { return permute_case(s, b); }, 2.0),
      moe_entry("moe_combine", [](const moe_shape& s, double b, bool) { return combine_case(s, true, false, b); }, 2.5),
      moe_entry("moe_combine_shared", [](const moe_shape& s, double b, bool) { return combine_case(s, true, true, b); },
                2.75),
      moe_entry("moe_combine_unweighted",
                [](const moe_shape& s, double b, bool) { return combine_case(s, false, false, b); }, 2.5),
      moe_entry("moe_combine_backward", [](const moe_shape& s, double b, bool) { return combine_backward_case(s, b); }, 4.0),
      moe_entry("moe_balance", [](const moe_shape& s, double b, bool test) { return balance_case(s, test, b); }, 0.1),
      moe_entry("sigmoid_gate_backward", [](const moe_shape& s, double b, bool) { return sigmoid_gate_backward_case(s, b); },
                4.0 / 8)};
  for (op_entry& e : moe_gemm_op_entries()) entries.push_back(std::move(e));
  return entries;
}

}  // namespace upipe::op_cases
