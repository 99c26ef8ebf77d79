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
  double layer = 0, attention_inputs = 0, attention_output = 0, head = 0;
};

matmul_params params_of(const model_config& m) {
  const double D = m.hidden_size, d = m.head_dim;
  matmul_params p;
  p.attention_inputs = D * d * (m.num_heads + 2.0 * m.num_kv_heads);  // q, k, v
  p.attention_output = D * d * m.num_heads;                           // o
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

// A mixture's routed experts' parameters, every sparse layer's.
double expert_weights(const model_config& m) {
  return static_cast<double>(m.sparse_layer_count()) * m.moe.experts * 3.0 * m.moe.expert_width * m.hidden_size;
}

// Expert parallelism's exchanges (model/moe_exchange.hpp): each of a rank's s k routed rows
// of a sparse layer leaves for its expert's rank, E - 1 of E times, out and back: in the
// forward (and its recompute) the row with its expert id and its output (bf16), in the
// backward the row, its output, the output's gradient (bf16) and the row's input gradient
// (f32). Inside a node when the EP group is, else its share across nodes.
double expert_exchange_seconds(const step_time_request& r, const throughput_rates& rates, double s,
                               double recompute) {
  const model_config& m = r.model;
  const int E = r.ep;
  if (E <= 1 || m.sparse_layer_count() == 0) return 0;
  const double D = m.hidden_size, rows = s * m.moe.top_k * m.sparse_layer_count();
  const double leaving = static_cast<double>(E - 1) / E;
  const double bytes = rows * leaving * ((1 + recompute) * (2 * 2 * D + 4) + (3 * 2 * D + 4 * D + 4));
  const int G = r.gpus_per_node;
  const double off_node = E <= G ? 0.0 : static_cast<double>(E - G) / (E - 1);
  return std::max(bytes * (1 - off_node) / (rates.nvlink_gbytes * giga),
                  bytes * off_node / (rates.network_gbits / 8 * giga));
}

}  // namespace

step_time layer_attention_time(const attention_config& layer, const step_time_request& r,
                               const throughput_rates& rates, double passes_forward) {
  step_time t;
  // 4 H d FLOPs a scored pair forward, twice that backward (docs/design.md section 7); head
  // dim 64 runs slower than 128 (step_rates.hpp).
  const double forward = 4 * attention_pairs(layer.seq_len, layer.window) * layer.heads * layer.head_dim / layer.cp;
  const double rate = rates.attention_tflops * (layer.head_dim <= 64 ? step_rates::attention_d64_share : 1.0);
  t.attention = forward * (2 + passes_forward) / (rate * tera);
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

layer_passes forward_passes(const checkpoint_policy& policy, int layers, int layer) {
  const int k = std::max(1, policy.every);
  const int last_of_block = std::min(layer - layer % k + k, layers) - 1;
  const double block = layer < last_of_block ? 1 : 0;  // re-forwarded to rebuild the next layer's input
  const bool kept = layer % k == 0 && policy.what == checkpoint_content::layer_input_and_attention;
  layer_passes f;
  f.attention = 1 + (kept ? 0 : 1) + block;
  f.inputs = f.attention + 1;
  f.rest = 2 + block;
  f.down = 1 + block;
  return f;
}

double step_gemm_flops(const step_time_request& r) {
  const model_config& m = r.model;
  const double s = static_cast<double>(r.seq_len) / r.cp.cp;
  const matmul_params p = params_of(m);
  // Backward: the input gradients and (but a frozen base's) the weight gradients.
  const double backward = r.lora ? 2 : 4;
  double flops = (2 + backward) * p.head * s;
  for (int l = 0; l < m.num_layers; ++l) {
    const layer_passes f = forward_passes(r.policy, m.num_layers, l);
    // The MLP's matrices (a mixture of experts': those a token passes) in thirds: gate and
    // up, then down.
    const double mlp = p.layer - p.attention_inputs - p.attention_output;
    flops += 2 * s * (p.attention_inputs * f.inputs + (p.attention_output + mlp * 2 / 3) * f.rest + mlp / 3 * f.down);
    flops += backward * s * p.layer;
  }
  return flops;
}

namespace {

// The elements of the rank's shard of every unit (ZeRO over D x C ranks), and of the first
// unit the next forward needs (the embedding) and the last the backward closes (the same).
struct shard_elements {
  double all = 0, embedding = 0;
};

shard_elements shard_elements_of(const step_time_request& r) {
  const double W = static_cast<double>(r.dp) * r.cp.cp;
  shard_elements e;
  const auto units = parameter_units(r.model);
  for (std::size_t u = 0; u < units.size(); ++u) {
    double numel = 0;
    for (const unit_parameter& p : units[u]) numel += static_cast<double>(p.numel);
    e.all += numel / W;
    if (u == 0) e.embedding = numel / W;
  }
  return e;
}

// Bytes a parameter's update reads and writes: on the host (the whole update, or the
// master's half from the f32 steps) and on the device (the whole update, or the moments'
// half writing the steps). Working weights in bf16; bf16-kahan's master is the working copy.
struct update_bytes {
  double host = 0, device = 0;
};

update_bytes update_bytes_of(const step_time_request& r) {
  const double moments = r.state.moments == moment_format::f32 ? 16 : r.state.moments == moment_format::bf16 ? 8 : 4;
  const bool kahan = r.state.master == master_format::bf16_kahan;
  const double master = 8;        // f32 read and written, or bf16 weights and bf16 compensation read and written
  const double working = kahan ? 0 : 2;  // the bf16 copy written beside an f32 master
  const double grad = r.grad_bytes;
  update_bytes b;
  if (r.offload_optimizer) {
    b.host = grad + master + moments + working;
  } else if (r.offload_master) {
    b.host = 4 + master + working;  // the steps, the master's half
    b.device = grad + moments + 4;  // the moments' half, its steps written
  } else {
    b.device = grad + master + moments + working;
  }
  return b;
}

// The update: the device's AdamW (or its moments' half) and, offloaded, the host's AdamW
// and what of it the step waits for, and its copies on the step's stream.
void add_update(step_time& t, const step_time_request& r, const throughput_rates& rates) {
  const shard_elements e = shard_elements_of(r);
  const update_bytes b = update_bytes_of(r);
  const double host_seconds_per_element = b.host / (rates.host_adamw_gbytes * 1e9);
  t.update = e.all * b.device / (rates.device_gbytes * 1e9);
  if (r.lora || !(r.offload_optimizer || r.offload_master)) return;
  const double pcie = rates.pcie_gbytes * 1e9;
  t.host_adamw = e.all * host_seconds_per_element;
  // On the step's stream: the gradient shards (the optimizer on the host) or the master's
  // steps (the master alone) out, and AdamW's bf16 output back unless the weights live on
  // the host (then they come in beside the compute, below).
  t.offload_copies = e.all * (r.offload_optimizer ? r.grad_bytes : 4) / pcie;
  if (!r.offload_params) t.offload_copies += e.all * 2 / pcie;
  // What the step waits for: all of it without the overlap; with it, the first unit's
  // update (the next forward needs it first; the backward closes it last without clipping)
  // and whatever the host needs beyond the compute it runs beside.
  const double first = e.embedding * host_seconds_per_element;
  const double beside = r.streamed ? t.compute() - t.forward : t.forward;
  t.host_adamw_exposed =
      r.overlap ? std::min(t.host_adamw, first + std::max(0.0, t.host_adamw - first - beside)) : t.host_adamw;
  t.lone_step_extra = r.streamed ? 0 : t.host_adamw - t.host_adamw_exposed;
}

}  // namespace

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
  step_time t;
  const double gemm = rates.gemm_tflops * tera;
  t.gemm = step_gemm_flops(r) / gemm;
  t.elementwise = s * L * rates.elementwise_ns * 1e-9;
  // The attention, its collectives and its host copies, layer by layer: a family's layers
  // may differ in their window (Gemma 3's local and global layers) and in how often a
  // checkpoint policy runs them, and layers alike cost alike, so each distinct pair is
  // timed once; the hybrids' Gated DeltaNet layers likewise by their passes.
  std::map<std::pair<std::int64_t, double>, step_time> by_layer;
  std::map<double, step_time> linear_by_passes;
  double attention_host = 0, attention_forward = 0;  // seconds
  for (int l = 0; l < m.num_layers; ++l) {
    const attention_config layer = attention_config_for(m, r.cp, r.seq_len, l);
    const double passes = forward_passes(r.policy, m.num_layers, l).attention;
    if (m.linear_layer(l)) {
      auto lt = linear_by_passes.find(passes);
      if (lt == linear_by_passes.end())
        lt = linear_by_passes.emplace(passes, layer_linear_time(layer, r, rates, passes)).first;
      t.attention += lt->second.attention;
      t.all_to_all += lt->second.all_to_all;
      t.ring += lt->second.ring;
      attention_forward += lt->second.attention / (2 + passes);
      continue;
    }
    auto it = by_layer.find({layer.window, passes});
    if (it == by_layer.end())
      it = by_layer.emplace(std::pair{layer.window, passes}, layer_attention_time(layer, r, rates, passes)).first;
    t.attention += it->second.attention;
    t.all_to_all += it->second.all_to_all;
    t.ring += it->second.ring;
    attention_host += it->second.host;
    attention_forward += it->second.attention / (2 + passes);
  }
  // The first forward alone: its GEMMs and attention (what the overlap hides the update behind).
  t.forward = 2 * s * (L * p.layer + p.head) / gemm + attention_forward + t.elementwise / 3;
  const double network = rates.network_gbits / 8 * giga, nvlink = rates.nvlink_gbytes * giga,
               pcie = rates.pcie_gbytes * giga;

  // ZeRO over every rank of the mesh (comm/replica_mesh.hpp): the bf16 weights gathered
  // (twice under ZeRO-3: forward and backward), the f32 gradients reduce-scattered, each in
  // two levels: over the CP group (its ring across nodes at the network's pace), then the
  // group's 1/C of the unit across the D replicas (data parallelism: across nodes unless the
  // whole mesh shares one).
  // Every stored weight takes part (a mixture's every expert, not the k a token passes);
  // under expert parallelism a rank's experts (1 / E of them) go over the W / E ranks that
  // hold them instead (their ranks spread over the EP groups: across nodes when the mesh is).
  const int D = r.dp, W = D * C, E = std::max(r.ep, 1);
  const double experts = expert_weights(m);
  const double weights = static_cast<double>(m.parameter_count()) - (E > 1 ? experts : 0.0);
  const double gathers = r.zero == zero_stage::three ? 2 : (r.zero == zero_stage::two ? 1 : 0);
  const bool reduces = r.zero != zero_stage::replicated && !r.lora;  // a LoRA base has no gradients
  const double per_weight = gathers * 2 + (reduces ? 4 : 0);
  const double zero_bytes = per_weight * weights;
  const double in_group = C > 1 ? static_cast<double>(C - 1) / C : 0.0;
  const double across = D > 1 ? static_cast<double>(D - 1) / D / C : 0.0;
  t.zero = zero_bytes * in_group / (multi_node ? network : nvlink);
  t.data_parallel = zero_bytes * across / (W > r.gpus_per_node ? network : nvlink);
  if (E > 1 && W > E)
    t.zero += per_weight * experts / E * (W / E - 1) / (W / E) / (W > r.gpus_per_node ? network : nvlink);
  // The exchange runs with every forward of the MLP (forward_passes' rest), averaged over the layers.
  double mlp_passes = 0;
  for (int l = 0; l < m.num_layers; ++l) mlp_passes += forward_passes(r.policy, m.num_layers, l).rest;
  t.experts = expert_exchange_seconds(r, rates, s, mlp_passes / L - 1);

  // Host copies: the attention's chunks (above) and the checkpoints (out and back).
  double host = attention_host * pcie;
  if (r.policy.where != checkpoint_location::device) {
    const double kept_layers = std::max(0.0, std::ceil(L / r.policy.every) - 1);  // layer 0's input is not kept
    double per_layer = s * m.hidden_size * 2;
    if (r.policy.what == checkpoint_content::layer_input_and_attention)
      per_layer += s * m.num_heads * m.head_dim * 2 + s * m.num_heads * 4;
    host += 2 * kept_layers * per_layer;
  }
  t.host = host / pcie;
  add_update(t, r, rates);
  // The weights in host memory come in beside the compute, a unit for every acquire
  // (ZeRO-3: forward, the blocks' re-forward, backward; ZeRO-2: forward and backward):
  // the step waits only where the copies outlast the compute.
  if (r.offload_params && !r.lora) {
    double acquires = 0;
    for (int l = 0; l < m.num_layers; ++l) acquires += forward_passes(r.policy, m.num_layers, l).rest;
    const double per_layer = weights / L / (r.zero == zero_stage::three ? W : 1) * 2;
    t.weights_in = std::max(0.0, acquires * per_layer / pcie - t.compute());
  }
  return t;
}

}  // namespace upipe
