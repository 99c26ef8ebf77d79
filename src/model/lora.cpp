#include "model/lora.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "core/error.hpp"
#include "core/key_values.hpp"
#include "core/random.hpp"

namespace upipe {

namespace {

constexpr lora_target all_targets[] = {
    lora_target::q,        lora_target::k,        lora_target::v,        lora_target::o,
    lora_target::gate,     lora_target::up,       lora_target::down,     lora_target::linear_q,
    lora_target::linear_k, lora_target::linear_v, lora_target::linear_z, lora_target::linear_b,
    lora_target::linear_a, lora_target::linear_out};
constexpr lora_target_bits bit(lora_target t) { return static_cast<lora_target_bits>(1u << static_cast<int>(t)); }
constexpr lora_target_bits every_target = (1u << lora_target_count) - 1;
constexpr lora_target_bits attention_targets = bit(lora_target::q) | bit(lora_target::k) | bit(lora_target::v) |
                                               bit(lora_target::o);
constexpr lora_target_bits mlp_targets = bit(lora_target::gate) | bit(lora_target::up) | bit(lora_target::down);
constexpr lora_target_bits linear_targets = every_target & ~attention_targets & ~mlp_targets;

bool is_linear(lora_target t) { return static_cast<int>(t) >= layer_projection_count; }
layer_projection as_layer(lora_target t) { return static_cast<layer_projection>(t); }
linear_projection as_linear(lora_target t) {
  return static_cast<linear_projection>(static_cast<int>(t) - layer_projection_count);
}

// Where a target's rows lie, its (out, in), and its module's stored rows.
stored_rows target_rows(const model_config& m, lora_target t) {
  return is_linear(t) ? linear_rows(m, as_linear(t)) : projection_rows(m, as_layer(t));
}
std::pair<std::int64_t, std::int64_t> target_shape(const model_config& m, lora_target t) {
  return is_linear(t) ? linear_shape(m, as_linear(t)) : projection_shape(m, as_layer(t));
}

// Does layer `layer` hold the target: the linear ones on a hybrid's Gated DeltaNet layers,
// the attention's on the others, the MLP's on the dense layers.
bool layer_has(const model_config& m, int layer, lora_target t) {
  if (is_linear(t)) return m.linear_layer(layer);
  if (bit(t) & attention_targets) return !m.linear_layer(layer);
  return !m.sparse_layer(layer);
}

// What LoRA may adapt in `model`: every projection its layers have, but on a mixture of
// experts not the MLP. Its experts are 3-D parameters (transformers 5's
// experts.gate_up_proj), which PEFT adapts only through target_parameters, not the modules
// upipe's adapters are.
lora_target_bits adaptable_targets(const model_config& model) {
  lora_target_bits bits = model.sparse_layer_count() > 0 ? every_target & ~mlp_targets : every_target;
  if (model.linear_layer_count() == 0) bits &= ~linear_targets;
  if (model.linear_layer_count() == model.num_layers) bits &= ~attention_targets;
  return bits;
}

const char* short_name(lora_target t) {
  static const char* names[] = {"q",        "k",        "v",        "o",        "gate",     "up",       "down",
                                "linear_q", "linear_k", "linear_v", "linear_z", "linear_b", "linear_a", "linear_out"};
  return names[static_cast<int>(t)];
}

// "self_attn.qkv_proj" -> "qkv_proj".
std::string leaf(const std::string& module) { return module.substr(module.rfind('.') + 1); }

// The targets stored in the same module as t (t alone unless the family fuses it).
lora_target_bits module_targets(const model_config& m, lora_target t) {
  const std::string module = target_rows(m, t).module;
  lora_target_bits bits = 0;
  for (lora_target other : all_targets)
    if (is_linear(other) == is_linear(t) && target_rows(m, other).module == module) bits |= bit(other);
  return bits;
}

// (out, in) of a target's module: a fused module's rows are its projections' together (a
// gated q_proj's gate rows too).
std::pair<std::int64_t, std::int64_t> module_shape(const model_config& m, lora_target t) {
  const std::int64_t out = is_linear(t) ? linear_module_rows(m, as_linear(t)) : module_rows(m, as_layer(t));
  return {out, target_shape(m, t).second};
}

std::string adapter_name(const model_config& m, int layer, lora_target t, char which) {
  return layer_prefix(layer) + target_rows(m, t).module + ".lora_" + which + ".weight";
}

std::string number_text(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

// The projections of any layer of this model, for messages.
std::string valid_targets_text(const model_config& m) {
  std::string modules;
  for (lora_target t : all_targets) {
    if ((adaptable_targets(m) & bit(t)) == 0 || target_rows(m, t).first > 0) continue;  // named by its module's first
    modules += (modules.empty() ? "" : ", ") + leaf(target_rows(m, t).module);
  }
  const bool fused = m.traits().qkv_fused != nullptr || m.traits().gate_up_fused != nullptr || m.linear_layer_count() > 0;
  return (fused ? modules : "q, k, v, o, gate, up, down (or " + modules + ")") + ", or all";
}

// Modules of other architectures, or of this family that this model lacks: named as such.
bool names_another_architecture(const std::string& name, const model_config& model) {
  static const char* others[] = {"qkv_proj", "gate_up_proj", "c_attn", "c_proj", "c_fc", "query_key_value",
                                 "dense", "dense_h_to_4h", "dense_4h_to_h", "fc1", "fc2", "w1", "w2", "w3",
                                 "wqkv", "Wqkv", "out_proj", "in_proj", "q_proj", "k_proj", "v_proj", "gate_proj",
                                 "up_proj"};
  if (std::find(std::begin(others), std::end(others), name) != std::end(others)) return true;
  return !model.qk_norm && (name == "q_norm" || name == "k_norm");
}

}  // namespace

std::string lora_module_name(const model_config& model, lora_target t) { return leaf(target_rows(model, t).module); }

std::vector<std::string> lora_module_names(const model_config& model, const lora_config& lora) {
  std::vector<std::string> out;
  for (lora_target t : lora.target_list()) {
    const std::string name = lora_module_name(model, t);
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  }
  return out;
}

std::vector<lora_target> lora_config::target_list() const {
  std::vector<lora_target> out;
  for (lora_target t : all_targets)
    if (adapts(t)) out.push_back(t);
  return out;
}

std::string lora_text(const lora_config& lora) {
  std::string text = "r=" + std::to_string(lora.rank) + ",alpha=" + number_text(lora.alpha) + ",targets=";
  bool first = true;
  for (lora_target t : lora.target_list()) {
    if (!first) text += ',';  // appended piece by piece: GCC 12's -Wrestrict false positive
    text += short_name(t);
    first = false;
  }
  return text;
}

lora_target_bits parse_lora_targets(const std::vector<std::string>& names, const model_config& model,
                                    const std::string& what) {
  lora_target_bits bits = 0;
  const std::string valid = valid_targets_text(model);
  for (const std::string& name : names) {
    if (name == "all" || name == "all-linear") {
      bits = adaptable_targets(model);
      continue;
    }
    // A projection's short name, or the module holding it (a fused one stands for all of its
    // projections: PEFT adapts the module whole).
    const auto it = std::find_if(std::begin(all_targets), std::end(all_targets), [&](lora_target t) {
      if ((adaptable_targets(model) & bit(t)) == 0 && (bit(t) & mlp_targets) == 0) return false;  // none in this model
      return name == short_name(t) || name == lora_module_name(model, t) ||
             (name + "_proj" == lora_module_name(model, t) && target_rows(model, t).first == 0);
    });
    if (it != std::end(all_targets)) {
      bits |= name == short_name(*it) ? bit(*it) : module_targets(model, *it);
      continue;
    }
    const std::string family(model.traits().model_type);
    if (names_another_architecture(name, model))
      throw config_error(what + " names '" + name + "', a module " + model.name + " (" + family +
                         ") does not have: its adaptable projections are " + valid);
    if (name == "embed_tokens" || name == "lm_head" || name == "q_norm" || name == "k_norm" || name == "norm" ||
        name.find("layernorm") != std::string::npos)
      throw config_error(what + " names '" + name + "', which is not a linear projection of a layer: LoRA here "
                         "adapts " + valid);
    throw config_error(what + " names an unknown target '" + name + "': the targets are " + valid);
  }
  if (bits == 0) throw config_error(what + " is empty: name at least one of " + valid);
  return bits;
}

void validate(const lora_config& lora, const model_config& model, const std::string& what) {
  if (lora.rank <= 0 || lora.rank > max_lora_rank)
    throw config_error(what + " r=" + std::to_string(lora.rank) + " must be a whole number between 1 and " +
                       std::to_string(max_lora_rank) + " (the adapters' rank; for example r=16)");
  if (!std::isfinite(lora.alpha) || !(lora.alpha > 0))
    throw config_error(what + " alpha=" + number_text(lora.alpha) +
                       " must be a positive finite number (the adapters' output is scaled by alpha / r; for example "
                       "alpha=" + std::to_string(2 * lora.rank) + ")");
  if (lora.alpha / lora.rank > max_lora_scale)
    throw config_error(what + " alpha=" + number_text(lora.alpha) + " with r=" + std::to_string(lora.rank) +
                       " scales the adapters' output by alpha / r = " + number_text(lora.alpha / lora.rank) +
                       ", beyond " + number_text(max_lora_scale) + ": the adapters would swamp the frozen weights "
                       "(recipes use alpha / r of 0.5 to 32); for example alpha=" + std::to_string(2 * lora.rank));
  if (lora.targets == 0 || (lora.targets & ~every_target) != 0)
    throw config_error(what + " needs targets among " + valid_targets_text(model));
  if ((lora.targets & ~adaptable_targets(model)) != 0)
    throw config_error(what + " targets the MLP (gate, up or down) of " + model.name + ", a mixture of experts: its "
                       "experts are 3-D parameters that PEFT adapts only through target_parameters, which upipe's "
                       "adapters do not express; use targets=q,k,v,o");
  for (lora_target t : lora.target_list()) {
    const lora_target_bits together = module_targets(model, t);
    if ((lora.targets & together) != together)
      throw config_error(what + " adapts " + short_name(t) + " alone, but " + model.name + " stores it in " +
                         lora_module_name(model, t) + " with other projections, which PEFT adapts whole: target " +
                         lora_module_name(model, t) + " (all of its projections) or none of them");
    const auto [out, in] = module_shape(model, t);
    const std::int64_t widest = std::min(out, in);
    if (lora.rank > widest)
      throw config_error(what + " r=" + std::to_string(lora.rank) + " exceeds " + lora_module_name(model, t) + "'s " +
                         std::to_string(out) + " x " + std::to_string(in) + " of " + model.name +
                         ": a rank above min(out, in) adds nothing; use r <= " + std::to_string(widest));
  }
}

lora_config parse_lora(std::string_view text, const model_config& model) {
  const key_values items(text, "--lora",
                         {{"r", {"rank"}}, {"alpha", {"lora_alpha"}}, {"dropout", {"lora_dropout"}},
                          {"targets", {"target_modules"}, option_key::takes::list}},
                         "r=16,alpha=32,targets=q,k,v,o,gate,up,down");
  if (!items.has("r"))
    throw config_error("--lora " + std::string(text) + " gives no rank: begin with r=N, e.g. --lora r=16,alpha=32");
  lora_config lora;
  lora.rank = static_cast<int>(items.whole_number("r", 1, max_lora_rank, "16"));
  lora.alpha = items.has("alpha") ? items.real_number("alpha", "32") : lora.rank;
  if (items.has("dropout") && items.real_number("dropout", "0") != 0)
    throw config_error("--lora dropout=" + *items.find("dropout") + " is not supported: upipe's adapters run without "
                       "dropout (PEFT's lora_dropout = 0), which the exactness tests hold every strategy to; use "
                       "dropout=0");
  const std::optional<std::string> targets = items.find("targets");
  if (targets && targets->empty())
    throw config_error("--lora targets= names no projection: name some of " + valid_targets_text(model) +
                       ", or leave targets out for all seven");
  std::vector<std::string> names;
  for (std::size_t start = 0; targets && start <= targets->size();) {
    const std::size_t comma = std::min(targets->find(',', start), targets->size());
    names.push_back(targets->substr(start, comma - start));
    start = comma + 1;
  }
  lora.targets = names.empty() ? adaptable_targets(model) : parse_lora_targets(names, model);
  validate(lora, model);
  return lora;
}

std::vector<parameter_spec> lora_parameter_specs(const model_config& model, const lora_config& lora) {
  std::vector<parameter_spec> specs;
  for (int l = 0; l < model.num_layers; ++l)
    for (lora_target t : lora.target_list()) {
      if (!layer_has(model, l, t) || target_rows(model, t).first > 0) continue;  // a fused module's later block: one adapter
      const auto [out, in] = module_shape(model, t);
      specs.push_back({adapter_name(model, l, t, 'A'), {lora.rank, in}});
      specs.push_back({adapter_name(model, l, t, 'B'), {out, lora.rank}});
    }
  return specs;
}

std::int64_t lora_layer_parameter_count(const model_config& model, const lora_config& lora, int layer) {
  std::int64_t n = 0;
  for (lora_target t : lora.target_list()) {
    if (!layer_has(model, layer, t) || target_rows(model, t).first > 0) continue;
    const auto [out, in] = module_shape(model, t);
    n += lora.rank * (in + out);
  }
  return n;
}

std::int64_t lora_parameter_count(const model_config& model, const lora_config& lora) {
  std::int64_t n = 0;
  for (int l = 0; l < model.num_layers; ++l) n += lora_layer_parameter_count(model, lora, l);
  return n;
}

std::size_t lora_offloaded_optimizer_bytes(const model_config& model, const lora_config& lora, int ranks, dtype work) {
  std::size_t shards = 0;  // elements
  for (int l = 0; l < model.num_layers; ++l)
    shards += static_cast<std::size_t>((lora_layer_parameter_count(model, lora, l) + ranks - 1) / ranks);
  return shards * (4 * sizeof(float) + dtype_size(work));
}

double lora_model_flops(const model_config& model, const lora_config& lora, std::int64_t seq_len,
                        std::span<const std::int64_t> documents) {
  const auto S = static_cast<double>(seq_len);
  const double full = model.model_flops(seq_len, documents);
  // The full step's 6 N S less the base's weight gradients (2 N S), plus the adapters' 6 N_a S.
  return full - 2.0 * static_cast<double>(model.matmul_parameter_count()) * S +
         6.0 * static_cast<double>(lora_parameter_count(model, lora)) * S;
}

host_weights initial_adapters(const model_config& model, const lora_config& lora, std::uint64_t seed) {
  host_weights out;
  std::uint64_t stream = 0x10a0000;  // apart from the base's streams (model/weights.cpp)
  for (const parameter_spec& spec : lora_parameter_specs(model, lora)) {
    std::vector<float> values(static_cast<std::size_t>(spec.shape[0] * spec.shape[1]), 0.0f);
    ++stream;
    if (spec.name.find(".lora_A.") != std::string::npos)
      fill_uniform(values, seed, stream, static_cast<float>(1.0 / std::sqrt(static_cast<double>(spec.shape[1]))));
    out.emplace(spec.name, std::move(values));
  }
  return out;
}

namespace {

// The projection of a target in a layer's weights or gradients (layer_params or layer_gradients).
template <class Layer>
auto& target_of(Layer& p, lora_target t) {
  switch (t) {
    case lora_target::q: return p.attention.wq;
    case lora_target::k: return p.attention.wk;
    case lora_target::v: return p.attention.wv;
    case lora_target::o: return p.attention.wo;
    case lora_target::gate: return p.gate;
    case lora_target::up: return p.up;
    case lora_target::down: return p.down;
    case lora_target::linear_q: return p.linear.q;
    case lora_target::linear_k: return p.linear.k;
    case lora_target::linear_v: return p.linear.v;
    case lora_target::linear_z: return p.linear.z;
    case lora_target::linear_b: return p.linear.b;
    case lora_target::linear_a: return p.linear.a;
    case lora_target::linear_out: break;
  }
  return p.linear.out;
}

// Each target's A and its rows of B from `view`, into the layer's weights or their
// gradients; `also` finishes the projection. A gated attention's gate shares q_proj's adapter.
template <class Layer, class Also>
void attach_each(Layer& p, const model_config& model, const lora_config& lora, int layer, const named_view& view,
                 Also&& also) {
  for (lora_target t : lora.target_list()) {
    if (!layer_has(model, layer, t)) continue;
    const mat_view a = view(adapter_name(model, layer, t, 'A')), b = view(adapter_name(model, layer, t, 'B'));
    const auto attach = [&](auto& w, const stored_rows& rows) {
      w.lora_a = a;
      w.lora_b = b.row_block(rows.first, rows.extent());
      also(w);
    };
    attach(target_of(p, t), target_rows(model, t));
    if (t == lora_target::q && model.attention_gate) attach(p.attention.gate, attention_gate_rows(model));
  }
}

}  // namespace

// A fused module's projections share its A (their gradients add into it) and take their
// rows of its B.
void attach_adapters(layer_params& p, const model_config& model, const lora_config& lora, int layer,
                     const named_view& view) {
  attach_each(p, model, lora, layer, view, [&](projection& w) { w.lora_scale = lora.scale(); });
}

void attach_adapter_grads(layer_gradients& g, const model_config& model, const lora_config& lora, int layer,
                          const named_view& view) {
  attach_each(g, model, lora, layer, view, [](projection_grads&) {});
}

}  // namespace upipe
