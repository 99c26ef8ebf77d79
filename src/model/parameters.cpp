#include "model/parameters.hpp"

#include <algorithm>
#include <charconv>
#include <span>
#include <utility>
#include <vector>

namespace upipe {

std::optional<std::int64_t> layer_of(std::string_view name) {
  constexpr std::string_view prefix = "model.layers.";
  if (!name.starts_with(prefix)) return std::nullopt;
  const std::string_view rest = name.substr(prefix.size());
  const std::string_view digits = rest.substr(0, rest.find('.'));
  std::int64_t layer = -1;
  const bool plain = !digits.empty() && digits.find_first_not_of("0123456789") == std::string_view::npos &&
                     (digits.size() == 1 || digits[0] != '0');
  if (!plain || std::from_chars(digits.data(), digits.data() + digits.size(), layer).ec != std::errc()) return -1;
  return layer;
}

namespace {

// Rows [first, first + count) of a view, or no rows of an empty one (a frozen gradient).
mat_view rows_of(const mat_view& m, std::int64_t first, std::int64_t count) {
  return m.rows == 0 ? mat_view{} : m.row_block(first, count);
}

const char* module_name(layer_projection p) {
  static const char* names[] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};
  return names[static_cast<int>(p)];
}

constexpr layer_projection attention_projections[] = {layer_projection::q, layer_projection::k, layer_projection::v,
                                                       layer_projection::o};
constexpr layer_projection mlp_projections[] = {layer_projection::gate, layer_projection::up, layer_projection::down};

// Appends the weights of `group`, one tensor per stored module (a fused module once, at
// its first projection), each followed by its projection's bias where it has one.
void add_projections(const model_config& c, const std::string& layer, std::span<const layer_projection> group,
                     std::vector<parameter_spec>& specs) {
  for (layer_projection p : group) {
    const stored_rows rows = projection_rows(c, p);
    if (rows.first == 0)  // not a later block of a fused module
      specs.push_back({layer + rows.module + ".weight", {module_rows(c, p), projection_shape(c, p).second},
                       param_kind::matrix});
    if (c.has_bias(p)) specs.push_back({layer + module_name(p) + ".bias", {module_rows(c, p)}, param_kind::bias});
  }
}

constexpr linear_projection linear_projections[] = {linear_projection::q, linear_projection::k, linear_projection::v,
                                                     linear_projection::z, linear_projection::b, linear_projection::a,
                                                     linear_projection::out};

// A Gated DeltaNet layer's tensors: each stored module once, the convolution (C, 1, Kc) as
// nn.Conv1d holds it, the decay's dt_bias and A_log, the gated norm's weight.
void add_linear(const model_config& c, const std::string& layer, std::vector<parameter_spec>& specs) {
  const linear_attention_config& l = c.linear;
  for (linear_projection p : linear_projections) {
    const stored_rows rows = linear_rows(c, p);
    if (rows.first == 0)
      specs.push_back({layer + rows.module + ".weight", {linear_module_rows(c, p), linear_shape(c, p).second},
                       param_kind::matrix});
  }
  specs.push_back({layer + "linear_attn.conv1d.weight", {l.conv_channels(), 1, l.conv_kernel}, param_kind::conv});
  specs.push_back({layer + "linear_attn.dt_bias", {l.value_heads}, param_kind::bias});
  specs.push_back({layer + "linear_attn.A_log", {l.value_heads}, param_kind::log_decay});
  specs.push_back({layer + "linear_attn.norm.weight", {l.value_dim}, param_kind::gated_norm});
}

// A sparse layer's router, experts (each one's gate, up and down) and shared expert.
void add_experts(const model_config& c, int layer, std::vector<parameter_spec>& specs) {
  const std::int64_t D = c.hidden_size, I = c.moe.expert_width, S = c.moe.shared_width;
  specs.push_back({router_name(c, layer), {c.moe.experts, D}, param_kind::matrix});
  for (int e = 0; e < c.moe.experts; ++e) {
    specs.push_back({expert_name(c, layer, e, 0), {I, D}, param_kind::matrix});
    specs.push_back({expert_name(c, layer, e, 1), {I, D}, param_kind::matrix});
    specs.push_back({expert_name(c, layer, e, 2), {D, I}, param_kind::matrix});
  }
  if (S == 0) return;
  const std::string shared = layer_prefix(layer) + c.traits().moe_block + ".shared_expert";
  specs.push_back({shared + ".gate_proj.weight", {S, D}, param_kind::matrix});
  specs.push_back({shared + ".up_proj.weight", {S, D}, param_kind::matrix});
  specs.push_back({shared + ".down_proj.weight", {D, S}, param_kind::matrix});
  specs.push_back({shared + "_gate.weight", {1, D}, param_kind::matrix});
}

}  // namespace

std::string router_name(const model_config& c, int layer) {
  return layer_prefix(layer) + c.traits().moe_block + ".gate.weight";
}

std::string expert_name(const model_config& c, int layer, int expert, int role) {
  const family_row& row = c.traits();
  return layer_prefix(layer) + row.moe_block + ".experts." + std::to_string(expert) + "." + row.expert_names[role] +
         ".weight";
}

fused_expert_place fused_expert(const model_config& c, int layer, int expert, int role) {
  const std::int64_t D = c.hidden_size, I = c.moe.expert_width;
  const std::string experts = layer_prefix(layer) + "mlp.experts.";  // transformers 5 names the block mlp in every family
  if (role == 2) return {experts + "down_proj", std::int64_t{expert} * D * I};
  return {experts + "gate_up_proj", (std::int64_t{expert} * 2 + role) * I * D};
}

std::optional<expert_place> expert_of(const model_config& c, std::string_view name) {
  const std::optional<std::int64_t> layer = layer_of(name);
  if (!layer || *layer < 0 || *layer >= c.num_layers || !c.sparse_layer(static_cast<int>(*layer))) return std::nullopt;
  const std::string experts = layer_prefix(static_cast<int>(*layer)) + c.traits().moe_block + ".experts.";
  if (!name.starts_with(experts)) return std::nullopt;
  const std::string_view rest = name.substr(experts.size());
  int expert = -1;
  const auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), expert);
  if (ec != std::errc() || end == rest.data() || *end != '.' || expert < 0 || expert >= c.moe.experts) return std::nullopt;
  return expert_place{static_cast<int>(*layer), expert};
}

std::pair<std::int64_t, std::int64_t> projection_shape(const model_config& c, layer_projection p) {
  const std::int64_t D = c.hidden_size, F = c.intermediate_size;
  const std::int64_t q = std::int64_t{c.num_heads} * c.head_dim, kv = std::int64_t{c.num_kv_heads} * c.head_dim;
  switch (p) {
    case layer_projection::q: return {q, D};
    case layer_projection::k:
    case layer_projection::v: return {kv, D};
    case layer_projection::o: return {D, q};
    case layer_projection::gate:
    case layer_projection::up: return {F, D};
    case layer_projection::down: break;
  }
  return {D, F};
}

std::string layer_prefix(int layer) { return "model.layers." + std::to_string(layer) + "."; }

std::int64_t stored_rows::extent() const {
  return blocks.interleaved() ? (count / blocks.block - 1) * blocks.stride + blocks.block : count;
}

stored_rows attention_gate_rows(const model_config& c) {
  const std::int64_t d = c.head_dim;
  return {module_name(layer_projection::q), d, std::int64_t{c.num_heads} * d, {d, 2 * d}};
}

std::int64_t module_rows(const model_config& c, layer_projection p) {
  const std::string module = projection_rows(c, p).module;
  std::int64_t total = 0;
  for (layer_projection other : {layer_projection::q, layer_projection::k, layer_projection::v, layer_projection::o,
                                 layer_projection::gate, layer_projection::up, layer_projection::down})
    if (projection_rows(c, other).module == module) total += projection_shape(c, other).first;
  if (c.attention_gate && module == attention_gate_rows(c).module) total += attention_gate_rows(c).count;
  return total;
}

std::pair<std::int64_t, std::int64_t> linear_shape(const model_config& c, linear_projection p) {
  const linear_attention_config& l = c.linear;
  const std::int64_t D = c.hidden_size;
  switch (p) {
    case linear_projection::q:
    case linear_projection::k: return {l.key_width(), D};
    case linear_projection::v:
    case linear_projection::z: return {l.value_width(), D};
    case linear_projection::b:
    case linear_projection::a: return {l.value_heads, D};
    case linear_projection::out: break;
  }
  return {D, l.value_width()};
}

stored_rows linear_rows(const model_config& c, linear_projection p) {
  const family_row& row = c.traits();
  const linear_attention_config& l = c.linear;
  const std::int64_t out = linear_shape(c, p).first, dk = l.key_dim, kw = l.key_width();
  if (p == linear_projection::out) return {"linear_attn.out_proj", 0, out};
  if (row.linear_qkvz_fused == nullptr) {  // Qwen3.5: q, k and v side by side, the others apart
    switch (p) {
      case linear_projection::q: return {"linear_attn.in_proj_qkv", 0, out};
      case linear_projection::k: return {"linear_attn.in_proj_qkv", kw, out};
      case linear_projection::v: return {"linear_attn.in_proj_qkv", 2 * kw, out};
      case linear_projection::z: return {"linear_attn.in_proj_z", 0, out};
      case linear_projection::b: return {"linear_attn.in_proj_b", 0, out};
      default: return {"linear_attn.in_proj_a", 0, out};
    }
  }
  // Qwen3-Next: per key head its q (dk), k (dk), v (G dv) and z (G dv) rows, then per key head
  // its b (G) and a (G) rows (Qwen3NextGatedDeltaNet.fix_query_key_value_ordering).
  const std::int64_t G = l.value_heads / std::max(l.key_heads, 1), gv = G * l.value_dim;
  const std::int64_t group = 2 * dk + 2 * gv;
  switch (p) {
    case linear_projection::q: return {row.linear_qkvz_fused, 0, out, {dk, group}};
    case linear_projection::k: return {row.linear_qkvz_fused, dk, out, {dk, group}};
    case linear_projection::v: return {row.linear_qkvz_fused, 2 * dk, out, {gv, group}};
    case linear_projection::z: return {row.linear_qkvz_fused, 2 * dk + gv, out, {gv, group}};
    case linear_projection::b: return {row.linear_ba_fused, 0, out, {G, 2 * G}};
    default: return {row.linear_ba_fused, G, out, {G, 2 * G}};
  }
}

std::int64_t linear_module_rows(const model_config& c, linear_projection p) {
  const std::string module = linear_rows(c, p).module;
  std::int64_t total = 0;
  for (linear_projection other : linear_projections)
    if (linear_rows(c, other).module == module) total += linear_shape(c, other).first;
  return total;
}

stored_rows projection_rows(const model_config& c, layer_projection p) {
  const family_row& row = c.traits();
  const std::int64_t q = std::int64_t{c.num_heads} * c.head_dim, kv = std::int64_t{c.num_kv_heads} * c.head_dim;
  const std::int64_t out = projection_shape(c, p).first;
  if (c.attention_gate && p == layer_projection::q)  // each head's query rows, then its gate's
    return {module_name(p), 0, out, {c.head_dim, 2 * std::int64_t{c.head_dim}}};
  if (row.qkv_fused != nullptr && (p == layer_projection::q || p == layer_projection::k || p == layer_projection::v)) {
    const std::int64_t first = p == layer_projection::q ? 0 : p == layer_projection::k ? q : q + kv;
    return {row.qkv_fused, first, out};
  }
  if (row.gate_up_fused != nullptr && (p == layer_projection::gate || p == layer_projection::up))
    return {row.gate_up_fused, p == layer_projection::gate ? 0 : c.intermediate_size, out};
  return {module_name(p), 0, out};
}

std::vector<parameter_spec> parameter_specs(const model_config& config) {
  const family_row& row = config.traits();
  const std::int64_t D = config.hidden_size, V = config.vocab_size, d = config.head_dim;
  std::vector<parameter_spec> specs;
  specs.reserve(3 + static_cast<std::size_t>(std::max(config.num_layers, 0)) * 16);
  specs.push_back({"model.embed_tokens.weight", {V, D}, param_kind::embedding});
  for (int i = 0; i < config.num_layers; ++i) {
    const std::string layer = layer_prefix(i);
    specs.push_back({layer + "input_layernorm.weight", {D}, param_kind::norm});
    if (config.linear_layer(i)) {
      add_linear(config, layer, specs);
    } else {
      add_projections(config, layer, attention_projections, specs);
    }
    if (config.qk_norm && !config.linear_layer(i)) {
      specs.push_back({layer + "self_attn.q_norm.weight", {d}, param_kind::norm});
      specs.push_back({layer + "self_attn.k_norm.weight", {d}, param_kind::norm});
    }
    if (row.attention_post_norm != nullptr)
      specs.push_back({layer + row.attention_post_norm + ".weight", {D}, param_kind::norm});
    specs.push_back({layer + row.mlp_norm + ".weight", {D}, param_kind::norm});
    if (row.mlp_post_norm != nullptr) specs.push_back({layer + row.mlp_post_norm + ".weight", {D}, param_kind::norm});
    if (config.sparse_layer(i))
      add_experts(config, i, specs);
    else
      add_projections(config, layer, mlp_projections, specs);
  }
  specs.push_back({"model.norm.weight", {D}, param_kind::norm});
  if (!config.tie_embeddings) specs.push_back({"lm_head.weight", {V, D}, param_kind::matrix});
  return specs;
}

layer_params make_layer_params(const model_config& config, int index,
                               const std::function<mat_view(const std::string&)>& view, expert_range experts) {
  const family_row& row = config.traits();
  const std::string p = layer_prefix(index);
  const auto stored = [&](const stored_rows& rows) {
    projection w(rows_of(view(p + rows.module + ".weight"), rows.first, rows.extent()));
    w.rows = rows.blocks;
    return w;
  };
  const auto weight = [&](layer_projection which) {
    const stored_rows rows = projection_rows(config, which);
    projection w = stored(rows);
    if (config.has_bias(which)) {
      w.bias = view(p + module_name(which) + ".bias");
      if (rows.blocks.interleaved()) w.bias = w.bias.col_block(0, rows.extent());
    }
    return w;
  };
  layer_params l;
  l.input_norm = view(p + "input_layernorm.weight");
  if (config.linear_layer(index)) {
    delta_weights& d = l.linear;
    d.q = stored(linear_rows(config, linear_projection::q));
    d.k = stored(linear_rows(config, linear_projection::k));
    d.v = stored(linear_rows(config, linear_projection::v));
    d.z = stored(linear_rows(config, linear_projection::z));
    d.b = stored(linear_rows(config, linear_projection::b));
    d.a = stored(linear_rows(config, linear_projection::a));
    d.out = stored(linear_rows(config, linear_projection::out));
    d.conv = view(p + "linear_attn.conv1d.weight");
    d.dt_bias = view(p + "linear_attn.dt_bias");
    d.a_log = view(p + "linear_attn.A_log");
    d.norm = view(p + "linear_attn.norm.weight");
  } else {
    l.attention.wq = weight(layer_projection::q);
    l.attention.wk = weight(layer_projection::k);
    l.attention.wv = weight(layer_projection::v);
    l.attention.wo = weight(layer_projection::o);
  }
  if (config.attention_gate && !config.linear_layer(index)) {
    const stored_rows rows = attention_gate_rows(config);
    l.attention.gate = stored(rows);
    if (config.has_bias(layer_projection::q))
      l.attention.gate.bias = view(p + module_name(layer_projection::q) + ".bias").col_block(rows.first, rows.extent());
  }
  if (config.qk_norm && !config.linear_layer(index)) {
    l.attention.q_norm = view(p + "self_attn.q_norm.weight");
    l.attention.k_norm = view(p + "self_attn.k_norm.weight");
  }
  if (row.attention_post_norm != nullptr) l.attention_post_norm = view(p + row.attention_post_norm + ".weight");
  l.mlp_norm = view(p + row.mlp_norm + ".weight");
  if (row.mlp_post_norm != nullptr) l.mlp_post_norm = view(p + row.mlp_post_norm + ".weight");
  if (config.sparse_layer(index)) {
    moe_weights& m = l.moe;
    m.router = view(router_name(config, index));
    m.first_expert = experts.first;
    const int last = experts.count < 0 ? config.moe.experts : experts.first + experts.count;
    for (int e = experts.first; e < last; ++e) {
      m.gate.emplace_back(view(expert_name(config, index, e, 0)));
      m.up.emplace_back(view(expert_name(config, index, e, 1)));
      m.down.emplace_back(view(expert_name(config, index, e, 2)));
    }
    if (config.moe.shared_width > 0) {
      const std::string shared = p + row.moe_block + ".shared_expert";
      m.shared_gate = view(shared + ".gate_proj.weight");
      m.shared_up = view(shared + ".up_proj.weight");
      m.shared_down = view(shared + ".down_proj.weight");
      m.shared_expert_gate = view(shared + "_gate.weight");
    }
    return l;
  }
  l.gate = weight(layer_projection::gate);
  l.up = weight(layer_projection::up);
  l.down = weight(layer_projection::down);
  return l;
}

layer_gradients as_gradients(const layer_params& g) {
  const attention_weights& a = g.attention;
  const auto grads = [](const projection& w) {
    projection_grads out(w.weight);
    out.bias = w.bias;
    return out;
  };
  const auto all = [&](const std::vector<projection>& ws) {
    std::vector<projection_grads> out;
    out.reserve(ws.size());
    for (const projection& w : ws) out.push_back(grads(w));
    return out;
  };
  const moe_weights& m = g.moe;
  const delta_weights& d = g.linear;
  return {g.input_norm,
          {grads(a.wq), grads(a.wk), grads(a.wv), grads(a.wo), a.q_norm, a.k_norm, grads(a.gate)},
          {grads(d.q), grads(d.k), grads(d.v), grads(d.z), grads(d.b), grads(d.a), d.conv, d.dt_bias, d.a_log, d.norm,
           grads(d.out)},
          g.attention_post_norm,
          g.mlp_norm,
          g.mlp_post_norm,
          grads(g.gate),
          grads(g.up),
          grads(g.down),
          {m.router, all(m.gate), all(m.up), all(m.down), grads(m.shared_gate), grads(m.shared_up),
           grads(m.shared_down), m.shared_expert_gate}};
}

}  // namespace upipe
