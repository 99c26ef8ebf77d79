#include "plan/step_time.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>

#include "cp/stage_plan.hpp"
#include "cp/strategy_table.hpp"

namespace upipe {

namespace {

constexpr double giga = 1e9, tera = 1e12;

// Weights that take part in a matmul: a layer's projections and MLP, and the lm head.
struct matmul_params {
  double layer = 0, attention_inputs = 0, head = 0;
};

matmul_params params_of(const model_config& m) {
  const double D = m.hidden_size, d = m.head_dim;
  matmul_params p;
  p.attention_inputs = D * d * (m.num_heads + 2.0 * m.num_kv_heads);  // q, k, v
  p.head = D * static_cast<double>(m.vocab_size);
  // A layer's share of the active matrices (the experts a token passes, in a mixture of
  // experts; o, gate, up and down in a dense model), averaged over the layers.
  p.layer = (static_cast<double>(m.matmul_parameter_count()) - p.head) / m.num_layers;
  return p;
}

// The bytes one rank moves in one pass of one layer's attention, by link; an all-to-all
// counts what leaves the rank, split between the node's links and the network.
struct pass_bytes {
  double nvlink = 0, network_a2a = 0, ring = 0, host = 0;
};

pass_bytes bytes_of(const pass_plan& pass, const step_time_request& r) {
  const int C = r.cp.cp, G = std::min(r.gpus_per_node, C);
  const bool hybrid = row_of(r.cp.strategy).mesh;
  pass_bytes b;
  for (const plan_message& m : pass.messages()) {
    const double bytes = static_cast<double>(m.bytes(dtype::bf16));
    switch (m.link) {
      case plan_link::all_to_all: {
        const double leaving = static_cast<double>(m.bytes_leaving(dtype::bf16));
        // Hybrid's groups are a node's GPUs; otherwise each rank sends equal parts to the C - 1
        // others, G - 1 of them in its node.
        const double off_node = hybrid || C == 1 ? 0 : leaving * (C - G) / (C - 1);
        b.nvlink += leaving - off_node;
        b.network_a2a += off_node;
        break;
      }
      case plan_link::ring: b.ring += bytes; break;
      case plan_link::device_to_host:
      case plan_link::host_to_device: b.host += bytes; break;
    }
  }
  return b;
}

}  // namespace

step_time layer_attention_time(const attention_config& layer, const step_time_request& r,
                               const throughput_rates& rates, double passes_forward) {
  step_time t;
  // 4 H d FLOPs a scored pair forward, twice that backward (docs/design.md section 7).
  const double forward = 4 * attention_pairs(layer.seq_len, layer.window) * layer.heads * layer.head_dim / layer.cp;
  t.attention = forward * (2 + passes_forward) / (rates.attention_tflops * tera);
  const stage_plan plan = make_stage_plan(layer, 0);
  const pass_bytes fwd = bytes_of(plan.forward, r), bwd = bytes_of(plan.backward, r);
  const double network = rates.network_gbits / 8 * giga, nvlink = rates.nvlink_gbytes * giga,
               pcie = rates.pcie_gbytes * giga;
  const auto a2a = [&](const pass_bytes& b) { return std::max(b.nvlink / nvlink, b.network_a2a / network); };
  t.all_to_all = passes_forward * a2a(fwd) + a2a(bwd);
  // A ring step is as slow as its slowest hop: across nodes when the ring spans them.
  t.ring = (passes_forward * fwd.ring + bwd.ring) / (r.cp.cp > r.gpus_per_node ? network : nvlink);
  t.host = (passes_forward * fwd.host + bwd.host) / pcie;
  return t;
}

step_time layer_linear_time(const attention_config& layer, const step_time_request& r, const throughput_rates& rates,
                            double passes_forward) {
  const linear_attention_config& l = r.model.linear;
  const int C = layer.cp, G = std::min(r.gpus_per_node, C);
  const double s = static_cast<double>(layer.seq_len) / C, Hv = l.value_heads, dk = l.key_dim, dv = l.value_dim;
  step_time t;
  // 6 Hv dk dv FLOPs a token forward (2 each for S^T k, the update and S^T q), 12 backward.
  t.attention = 6 * Hv * dk * dv * s * (2 + passes_forward) / (rates.attention_tflops * tera);
  if (C == 1) return t;
  const double network = rates.network_gbits / 8 * giga, nvlink = rates.nvlink_gbytes * giga;
  const bool heads = (layer.strategy == strategy_kind::ulysses || layer.strategy == strategy_kind::upipe) &&
                     layer.seq_chunks <= 1;
  if (heads) {
    // bf16 rows of q | k | v | b | a out and o back, per pass; backward: d_o out, the stage's
    // inputs again, and their gradients home.
    const double in = s * (static_cast<double>(l.conv_channels()) + 2 * Hv) * 2, out = s * Hv * dv * 2;
    const double leaving = (passes_forward * (in + out) + out + 2 * in) * (C - 1) / C;
    const double off_node = leaving * (C - G) / std::max(C - 1, 1);
    t.all_to_all = std::max((leaving - off_node) / nvlink, off_node / network);
    return t;
  }
  // Sequence layouts: every segment's summary reaches every rank (an all-gather receives C - 1
  // ranks' segments); ring layouts hold two segments a rank, chunked ones N.
  const double segments = layer.strategy == strategy_kind::ring || layer.strategy == strategy_kind::hybrid
                              ? 2
                              : std::max(layer.seq_chunks, 1);
  const double forward = segments * Hv * dk * (dk + dv) * 4, backward = segments * Hv * dk * dv * 4;
  const double halos = 2 * segments * (l.conv_kernel - 1) * static_cast<double>(l.conv_channels()) * 2;
  const double received = (passes_forward * forward + backward + halos) * (C - 1);
  t.ring = received / (C > r.gpus_per_node ? network : nvlink);
  return t;
}

step_time estimate_step_time(const step_time_request& r, const throughput_rates& rates) {
  const model_config& m = r.model;
  const int C = r.cp.cp;
  const bool multi_node = C > r.gpus_per_node;
  const double s = static_cast<double>(r.seq_len) / C, L = m.num_layers;
  const matmul_params p = params_of(m);
  // Recompute from the checkpoints: every layer's forward again, but for the attention of
  // the layers whose attention output is kept (the first of each block of `every`).
  const bool keeps_attention = r.policy.what == checkpoint_content::layer_input_and_attention;
  const double recompute_attention = keeps_attention ? 1.0 - 1.0 / r.policy.every : 1.0;
  const double recompute_gemm =
      L * (p.layer - (keeps_attention ? p.attention_inputs / r.policy.every : 0.0));
  step_time t;
  // Forward 2, backward 4 (input and weight gradients; a frozen base's weight gradients are
  // not run), and the recompute's forward.
  const double passes = r.lora ? 4 : 6;
  t.gemm = (passes * (L * p.layer + p.head) * s + 2 * recompute_gemm * s) / (rates.gemm_tflops * tera);
  // The attention, its collectives and its host copies, layer by layer: a family's layers
  // may differ in their window (Gemma 3's local and global layers), and layers alike cost
  // alike, so each distinct window is timed once.
  std::map<std::int64_t, step_time> by_window;
  double attention_host = 0;  // seconds: the attention's chunks to and from the host, every layer
  std::optional<step_time> linear;  // the hybrids' Gated DeltaNet layers, alike
  for (int l = 0; l < m.num_layers; ++l) {
    const attention_config layer = attention_config_for(m, r.cp, r.seq_len, l);
    if (m.linear_layer(l)) {
      if (!linear) linear = layer_linear_time(layer, r, rates, 1 + recompute_attention);
      t.attention += linear->attention;
      t.all_to_all += linear->all_to_all;
      t.ring += linear->ring;
      continue;
    }
    auto it = by_window.find(layer.window);
    if (it == by_window.end())
      it = by_window.emplace(layer.window, layer_attention_time(layer, r, rates, 1 + recompute_attention)).first;
    t.attention += it->second.attention;
    t.all_to_all += it->second.all_to_all;
    t.ring += it->second.ring;
    attention_host += it->second.host;
  }
  const double network = rates.network_gbits / 8 * giga, nvlink = rates.nvlink_gbytes * giga,
               pcie = rates.pcie_gbytes * giga;

  // ZeRO over every rank of the mesh (comm/replica_mesh.hpp): the bf16 weights gathered
  // (twice under ZeRO-3: forward and backward), the f32 gradients reduce-scattered, each in
  // two levels: over the CP group (its ring across nodes at the network's pace), then the
  // group's 1/C of the unit across the D replicas (data parallelism: across nodes unless the
  // whole mesh shares one).
  const int D = r.dp, W = D * C;
  const double weights = L * p.layer + p.head * (m.tie_embeddings ? 1 : 2);  // with the embedding
  const double gathers = r.zero == zero_stage::three ? 2 : (r.zero == zero_stage::two ? 1 : 0);
  const bool reduces = r.zero != zero_stage::replicated && !r.lora;  // a LoRA base has no gradients
  const double zero_bytes = (gathers * 2 + (reduces ? 4 : 0)) * weights;
  const double in_group = C > 1 ? static_cast<double>(C - 1) / C : 0.0;
  const double across = D > 1 ? static_cast<double>(D - 1) / D / C : 0.0;
  t.zero = zero_bytes * in_group / (multi_node ? network : nvlink);
  t.data_parallel = zero_bytes * across / (W > r.gpus_per_node ? network : nvlink);

  // Host copies: the attention's chunks (above), the checkpoints (out and back) and the
  // offloaded optimizer's gradients and weights.
  double host = attention_host * pcie;
  if (r.policy.where != checkpoint_location::device) {
    const double kept_layers = std::max(0.0, std::ceil(L / r.policy.every) - 1);  // layer 0's input is not kept
    double per_layer = s * m.hidden_size * 2;
    if (keeps_attention) per_layer += s * m.num_heads * m.head_dim * 2 + s * m.num_heads * 4;
    host += 2 * kept_layers * per_layer;
  }
  // The offloaded optimizer's gradients out (f32, or bf16 kept shards) and bf16 weights
  // back; the master alone: the moments' f32 steps out, the weights back.
  if (r.offload_optimizer && !r.lora) host += weights / W * (r.grad_bytes + 2);
  if (r.offload_master && !r.offload_optimizer && !r.lora) host += weights / W * (4 + 2);
  if (r.offload_params) host += weights / W * 2 * (r.zero == zero_stage::three ? 2 : 1);
  t.host = host / pcie;
  return t;
}

}  // namespace upipe
