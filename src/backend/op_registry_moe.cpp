// The registry's entries for the mixture-of-experts ops (ops/op_args.hpp): the router's
// top-k and its backward, the gather and weighted scatter of a tile's rows in the experts'
// order and the scatter's backward, Qwen2-MoE's sigmoid gate. Forward ops are held to
// their float64 definitions below; backward ops to central differences of an objective.
// A case's gathered order is a fixed permutation of the (token, slot) pairs (prepare), as
// the routing makes one: no token twice in one scatter. Its i32 tensors start as ids 0.
#include <algorithm>
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

// n tokens, k slots each, D columns; the gathered rows are the n k pairs in an order that
// visits expert by expert (here: slot-major, a token once per slot block).
struct moe_shape {
  std::int64_t n, k, D, E;
};

std::string moe_text(const moe_shape& s) {
  return dims_text({{"tokens", s.n}, {"k", s.k}, {"cols", s.D}, {"experts", s.E}});
}

// Row i of the gathered tile: token (i % n) of slot i / n, its flat slot token k + slot.
void upload_dispatch(backend& be, const case_tensors& t, const moe_shape& s) {
  const std::int64_t m = s.n * s.k;
  std::vector<std::int32_t> index(static_cast<std::size_t>(m)), slot(index.size());
  for (std::int64_t i = 0; i < m; ++i) {
    const std::int64_t token = (i * 7) % s.n, j = i / s.n;  // 7 coprime with the cases' n: a permutation per block
    index[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(token);
    slot[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(token * s.k + j);
  }
  be.upload_bytes(t["index"], index.data(), index.size() * sizeof(std::int32_t));
  be.upload_bytes(t["slot"], slot.data(), slot.size() * sizeof(std::int32_t));
}

// The scatter one slot block at a time (no token twice in one call).
void scatter_blocks(backend& be, const case_tensors& t, const moe_shape& s, const char* src, bool weighted) {
  for (std::int64_t j = 0; j < s.k; ++j)
    ops::moe_scatter(be, {t[src].matrix().row_block(j * s.n, s.n), t["index"].matrix().row_block(j * s.n, s.n),
                          weighted ? t["slot"].matrix().row_block(j * s.n, s.n) : mat_view{},
                          weighted ? t["weights"].matrix() : mat_view{}, t["dst"].matrix()});
}

void dispatch_f64(const moe_shape& s, std::vector<std::int64_t>& index, std::vector<std::int64_t>& slot) {
  for (std::int64_t i = 0; i < s.n * s.k; ++i) {
    index.push_back((i * 7) % s.n);
    slot.push_back(index.back() * s.k + i / s.n);
  }
}

op_case gather_case(const moe_shape& s, double bytes) {
  op_case c;
  c.size = moe_text(s);
  c.tensors = {{.name = "src", .dims = {s.n, s.D}},
               {.name = "index", .type = case_dtype::i32, .dims = {s.n * s.k, 1}, .fill = case_fill::ids, .lo = 0.0f, .hi = 1.0f},
               {.name = "slot", .type = case_dtype::i32, .dims = {s.n * s.k, 1}, .fill = case_fill::ids, .lo = 0.0f, .hi = 1.0f},
               out({.name = "dst", .dims = {s.n * s.k, s.D}})};
  c.prepare = [s](backend& be, const case_tensors& t) { upload_dispatch(be, t, s); };
  c.run = [](backend& be, const case_tensors& t) {
    ops::moe_gather(be, {t["src"].matrix(), t["index"].matrix(), t["dst"].matrix()});
  };
  c.float64 = [s](f64::host_case& h) {
    std::vector<std::int64_t> index, slot;
    dispatch_f64(s, index, slot);
    for (std::size_t i = 0; i < index.size(); ++i)
      for (std::int64_t j = 0; j < s.D; ++j)
        h["dst"][i * static_cast<std::size_t>(s.D) + static_cast<std::size_t>(j)] =
            h["src"][static_cast<std::size_t>(index[i] * s.D + j)];
  };
  c.bytes = bytes;
  return c;
}

op_case scatter_case(const moe_shape& s, bool weighted, double bytes) {
  op_case c;
  c.size = moe_text(s) + (weighted ? " weighted" : "");
  c.tensors = {{.name = "src", .dims = {s.n * s.k, s.D}},
               {.name = "index", .type = case_dtype::i32, .dims = {s.n * s.k, 1}, .fill = case_fill::ids, .lo = 0.0f, .hi = 1.0f},
               {.name = "slot", .type = case_dtype::i32, .dims = {s.n * s.k, 1}, .fill = case_fill::ids, .lo = 0.0f, .hi = 1.0f},
               {.name = "weights", .type = case_dtype::f32, .dims = {s.n, s.k}, .lo = 0.0f},
               out({.name = "dst", .type = case_dtype::f32, .dims = {s.n, s.D}})};
  c.prepare = [s](backend& be, const case_tensors& t) { upload_dispatch(be, t, s); };
  c.run = [s, weighted](backend& be, const case_tensors& t) { scatter_blocks(be, t, s, "src", weighted); };
  c.float64 = [s, weighted](f64::host_case& h) {
    std::vector<std::int64_t> index, slot;
    dispatch_f64(s, index, slot);
    for (std::size_t i = 0; i < index.size(); ++i) {
      const double w = weighted ? h["weights"][static_cast<std::size_t>(slot[i])] : 1.0;
      for (std::int64_t j = 0; j < s.D; ++j)
        h["dst"][static_cast<std::size_t>(index[i] * s.D + j)] += w * h["src"][i * static_cast<std::size_t>(s.D) + static_cast<std::size_t>(j)];
    }
  };
  c.bytes = bytes;
  return c;
}

// The objective sum(dst . d_dst) over dst = the weighted scatter of src from zero: its
// gradients by src and by the weights are what moe_scatter_backward writes.
op_case scatter_backward_case(const moe_shape& s, double bytes) {
  op_case c;
  c.size = moe_text(s);
  c.tensors = {{.name = "src", .type = case_dtype::f32, .dims = {s.n * s.k, s.D}},
               {.name = "index", .type = case_dtype::i32, .dims = {s.n * s.k, 1}, .fill = case_fill::ids, .lo = 0.0f, .hi = 1.0f},
               {.name = "slot", .type = case_dtype::i32, .dims = {s.n * s.k, 1}, .fill = case_fill::ids, .lo = 0.0f, .hi = 1.0f},
               {.name = "weights", .type = case_dtype::f32, .dims = {s.n, s.k}, .lo = 0.0f},
               {.name = "dst", .type = case_dtype::f32, .dims = {s.n, s.D}, .fill = case_fill::zero},
               {.name = "d_dst", .type = case_dtype::f32, .dims = {s.n, s.D}},
               out({.name = "d_src", .type = case_dtype::f32, .dims = {s.n * s.k, s.D}}),
               out({.name = "d_weights", .type = case_dtype::f32, .dims = {s.n, s.k}}, bf16_tol, 1e-5)};
  c.prepare = [s](backend& be, const case_tensors& t) { upload_dispatch(be, t, s); };
  c.run = [](backend& be, const case_tensors& t) {
    ops::moe_scatter_backward(be, {t["d_dst"].matrix(), t["index"].matrix(), t["slot"].matrix(), t["weights"].matrix(),
                                   t["src"].matrix(), t["d_src"].matrix(), t["d_weights"].matrix()});
  };
  c.objective = [s](backend& be, const case_tensors& t) {
    ops::fill_heads(be, ops::as_heads(t["dst"].matrix()), 0.0f);
    scatter_blocks(be, t, s, "src", true);
    return host_dot(be, t["dst"], t["d_dst"]);
  };
  c.gradients = {{"src", "d_src"}, {"weights", "d_weights"}};
  c.bytes = bytes;
  return c;
}

// The router: softmax, the top k (descending, the lower expert among equals), renormalized.
op_case route_case(const moe_shape& s, bool normalize, double bytes) {
  op_case c;
  c.size = moe_text(s) + (normalize ? " normalized" : "");
  c.tensors = {{.name = "logits", .type = case_dtype::f32, .dims = {s.n, s.E}, .lo = -3.0f, .hi = 3.0f},
               out({.name = "probs", .type = case_dtype::f32, .dims = {s.n, s.E}}),
               out({.name = "weights", .type = case_dtype::f32, .dims = {s.n, s.k}}),
               {.name = "experts", .type = case_dtype::i32, .dims = {s.n, s.k}, .fill = case_fill::ids, .lo = 0.0f, .hi = 1.0f}};
  c.run = [normalize](backend& be, const case_tensors& t) {
    ops::moe_route(be, {t["logits"].matrix(), t["probs"].matrix(), t["weights"].matrix(), t["experts"].matrix(), normalize});
  };
  c.float64 = [s, normalize](f64::host_case& h) {
    for (std::int64_t r = 0; r < s.n; ++r) {
      const double* z = &h["logits"][static_cast<std::size_t>(r * s.E)];
      double* p = &h["probs"][static_cast<std::size_t>(r * s.E)];
      const double top = *std::max_element(z, z + s.E);
      double sum = 0;
      for (std::int64_t e = 0; e < s.E; ++e) sum += std::exp(z[e] - top);
      for (std::int64_t e = 0; e < s.E; ++e) p[e] = std::exp(z[e] - top) / sum;
      std::vector<std::int64_t> order(static_cast<std::size_t>(s.E));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [p](std::int64_t a, std::int64_t b) { return p[a] > p[b]; });
      double chosen = 0;
      for (std::int64_t j = 0; j < s.k; ++j) chosen += p[order[static_cast<std::size_t>(j)]];
      for (std::int64_t j = 0; j < s.k; ++j) {
        const double w = p[order[static_cast<std::size_t>(j)]];
        h["weights"][static_cast<std::size_t>(r * s.k + j)] = normalize ? w / chosen : w;
        h["experts"][static_cast<std::size_t>(r * s.k + j)] = static_cast<double>(order[static_cast<std::size_t>(j)]);
      }
    }
  };
  c.bytes = bytes;
  return c;
}

// The objective sum(weights . d_weights) + sum over rows of probs . aux_grad, with the
// routing from the logits: its gradient by the logits is what moe_route_backward writes.
op_case route_backward_case(const moe_shape& s, bool normalize, double bytes) {
  op_case c;
  c.size = moe_text(s) + (normalize ? " normalized" : "");
  c.tensors = {{.name = "logits", .type = case_dtype::f32, .dims = {s.n, s.E}, .lo = -2.0f, .hi = 2.0f},
               {.name = "probs", .type = case_dtype::f32, .dims = {s.n, s.E}, .fill = case_fill::zero},
               {.name = "weights", .type = case_dtype::f32, .dims = {s.n, s.k}, .fill = case_fill::zero},
               {.name = "experts", .type = case_dtype::i32, .dims = {s.n, s.k}, .fill = case_fill::ids, .lo = 0.0f, .hi = 1.0f},
               {.name = "d_weights", .type = case_dtype::f32, .dims = {s.n, s.k}},
               {.name = "aux_grad", .type = case_dtype::f32, .dims = {1, s.E}},
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
                                 t["aux_grad"].matrix(), t["d_logits"].matrix(), normalize});
  };
  c.objective = [s, route](backend& be, const case_tensors& t) {
    route(be, t);
    std::vector<float> probs(static_cast<std::size_t>(s.n * s.E)), aux(static_cast<std::size_t>(s.E));
    be.download_f32(probs.data(), t["probs"]);
    be.download_f32(aux.data(), t["aux_grad"]);
    double sum = host_dot(be, t["weights"], t["d_weights"]);
    for (std::size_t i = 0; i < probs.size(); ++i) sum += static_cast<double>(probs[i]) * aux[i % aux.size()];
    return sum;
  };
  c.gradients = {{"logits", "d_logits"}};
  c.bytes = bytes;
  return c;
}

// Qwen2-MoE's shared expert: y += sigmoid(z) s.
op_case sigmoid_gate_case(const moe_shape& s, double bytes) {
  op_case c;
  c.size = dims_text({{"rows", s.n}, {"cols", s.D}});
  c.tensors = {{.name = "z", .type = case_dtype::f32, .dims = {s.n, 1}, .lo = -4.0f, .hi = 4.0f},
               {.name = "s", .dims = {s.n, s.D}},
               out({.name = "y", .dims = {s.n, s.D}})};
  c.run = [](backend& be, const case_tensors& t) {
    ops::sigmoid_gate_forward(be, {t["z"].matrix(), t["s"].matrix(), t["y"].matrix()});
  };
  c.float64 = [s](f64::host_case& h) {
    for (std::int64_t r = 0; r < s.n; ++r) {
      const double g = 1.0 / (1.0 + std::exp(-h["z"][static_cast<std::size_t>(r)]));
      for (std::int64_t j = 0; j < s.D; ++j)
        h["y"][static_cast<std::size_t>(r * s.D + j)] += g * h["s"][static_cast<std::size_t>(r * s.D + j)];
    }
  };
  c.bytes = bytes;
  return c;
}

op_case sigmoid_gate_backward_case(const moe_shape& s, double bytes) {
  op_case c;
  c.size = dims_text({{"rows", s.n}, {"cols", s.D}});
  c.tensors = {{.name = "z", .type = case_dtype::f32, .dims = {s.n, 1}, .lo = -4.0f, .hi = 4.0f},
               {.name = "s", .type = case_dtype::f32, .dims = {s.n, s.D}},
               {.name = "y", .type = case_dtype::f32, .dims = {s.n, s.D}, .fill = case_fill::zero},
               {.name = "d_y", .type = case_dtype::f32, .dims = {s.n, s.D}},
               out({.name = "d_s", .type = case_dtype::f32, .dims = {s.n, s.D}}),
               out({.name = "d_z", .type = case_dtype::f32, .dims = {s.n, 1}}, bf16_tol, 1e-5)};
  c.run = [](backend& be, const case_tensors& t) {
    ops::sigmoid_gate_backward(be, {t["z"].matrix(), t["s"].matrix(), t["d_y"].matrix(), t["d_s"].matrix(),
                                    t["d_z"].matrix()});
  };
  c.objective = [](backend& be, const case_tensors& t) {
    ops::fill_heads(be, ops::as_heads(t["y"].matrix()), 0.0f);
    ops::sigmoid_gate_forward(be, {t["z"].matrix(), t["s"].matrix(), t["y"].matrix()});
    return host_dot(be, t["y"], t["d_y"]);
  };
  c.gradients = {{"z", "d_z"}, {"s", "d_s"}};
  c.bytes = bytes;
  return c;
}

// Small tiles (n coprime with 7, so that the dispatch permutes), one of E = 128 experts;
// the router's differences take experts whose count is coprime with 3 (prepare's levels).
const std::vector<moe_shape> moe_test_shapes = {{9, 2, 37, 8}, {33, 3, 64, 6}, {20, 8, 16, 128}};
const std::vector<moe_shape> router_gradient_shapes = {{9, 2, 1, 8}, {13, 3, 1, 7}};

template <class Make>
op_entry moe_entry(const char* name, Make make, double bytes_per_element,
                   const std::vector<moe_shape>& shapes = moe_test_shapes) {
  return {name,
          [make, &shapes] {
            std::vector<op_case> cases;
            for (const moe_shape& s : shapes) cases.push_back(make(s, 0.0));
            return cases;
          },
          [make, bytes_per_element](std::int64_t tokens, dtype work) {
            // Qwen3-30B-A3B's router and dispatch: 128 experts, top 8, D 2048.
            const moe_shape s{tokens, 8, 2048, 128};
            return make(s, bytes_per_element * static_cast<double>(tokens * s.k * s.D) * dtype_size(work));
          }};
}

}  // namespace

std::vector<op_entry> moe_op_entries() {
  return {moe_entry("moe_route", [](const moe_shape& s, double b) { return route_case(s, true, b); }, 0.1),
          moe_entry("moe_route_backward", [](const moe_shape& s, double b) { return route_backward_case(s, true, b); }, 0.1,
                    router_gradient_shapes),
          moe_entry("moe_route_backward_plain", [](const moe_shape& s, double b) { return route_backward_case(s, false, b); },
                    0.1, router_gradient_shapes),
          moe_entry("moe_gather", gather_case, 2.0),
          moe_entry("moe_scatter", [](const moe_shape& s, double b) { return scatter_case(s, true, b); }, 3.0),
          moe_entry("moe_scatter_backward", scatter_backward_case, 4.0),
          moe_entry("sigmoid_gate_forward", sigmoid_gate_case, 3.0 / 8),
          moe_entry("sigmoid_gate_backward", sigmoid_gate_backward_case, 4.0 / 8)};
}

}  // namespace upipe::op_cases
