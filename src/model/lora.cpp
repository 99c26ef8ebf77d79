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

constexpr lora_target all_targets[] = {lora_target::q,    lora_target::k,  lora_target::v,   lora_target::o,
                                       lora_target::gate, lora_target::up, lora_target::down};
constexpr std::uint8_t every_target = (1u << lora_target_count) - 1;

const char* short_name(lora_target t) {
  static const char* names[] = {"q", "k", "v", "o", "gate", "up", "down"};
  return names[static_cast<int>(t)];
}

// (out, in) of a target's weight.
std::pair<std::int64_t, std::int64_t> target_shape(const model_config& m, lora_target t) {
  const std::int64_t D = m.hidden_size, F = m.intermediate_size;
  const std::int64_t q = std::int64_t{m.num_heads} * m.head_dim, kv = std::int64_t{m.num_kv_heads} * m.head_dim;
  switch (t) {
    case lora_target::q: return {q, D};
    case lora_target::k:
    case lora_target::v: return {kv, D};
    case lora_target::o: return {D, q};
    case lora_target::gate:
    case lora_target::up: return {F, D};
    case lora_target::down: return {D, F};
  }
  return {0, 0};
}

std::string weight_name(int layer, lora_target t) {
  const bool attention = t == lora_target::q || t == lora_target::k || t == lora_target::v || t == lora_target::o;
  return "model.layers." + std::to_string(layer) + (attention ? ".self_attn." : ".mlp.") + lora_module_name(t);
}

std::string adapter_name(int layer, lora_target t, char which) {
  return weight_name(layer, t) + ".lora_" + which + ".weight";
}

std::string number_text(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

// The projections of any layer of this model, for messages.
const char* valid_targets_text = "q, k, v, o, gate, up, down (or q_proj, ..., down_proj, or all)";

// Modules of other architectures, or of this family that this model lacks: named as such.
bool names_another_architecture(const std::string& name, const model_config& model) {
  static const char* others[] = {"qkv_proj", "gate_up_proj", "c_attn", "c_proj", "c_fc", "query_key_value",
                                 "dense", "dense_h_to_4h", "dense_4h_to_h", "fc1", "fc2", "w1", "w2", "w3",
                                 "wqkv", "Wqkv", "out_proj", "in_proj"};
  if (std::find(std::begin(others), std::end(others), name) != std::end(others)) return true;
  return !model.qk_norm && (name == "q_norm" || name == "k_norm");
}

}  // namespace

const char* lora_module_name(lora_target t) {
  static const char* names[] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  return names[static_cast<int>(t)];
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
    text += (first ? "" : ",") + std::string(short_name(t));
    first = false;
  }
  return text;
}

std::uint8_t parse_lora_targets(const std::vector<std::string>& names, const model_config& model,
                                const std::string& what) {
  std::uint8_t bits = 0;
  for (const std::string& name : names) {
    if (name == "all" || name == "all-linear") {
      bits = every_target;
      continue;
    }
    const auto it = std::find_if(std::begin(all_targets), std::end(all_targets), [&](lora_target t) {
      return name == short_name(t) || name == lora_module_name(t);
    });
    if (it != std::end(all_targets)) {
      bits |= static_cast<std::uint8_t>(1u << static_cast<int>(*it));
      continue;
    }
    const std::string family = model.family == model_family::qwen3 ? "qwen3" : "llama";
    if (names_another_architecture(name, model))
      throw config_error(what + " names '" + name + "', a module " + model.name + " (" + family +
                         ") does not have: its adaptable projections are " + valid_targets_text);
    if (name == "embed_tokens" || name == "lm_head" || name == "q_norm" || name == "k_norm" || name == "norm" ||
        name == "input_layernorm" || name == "post_attention_layernorm")
      throw config_error(what + " names '" + name + "', which is not a linear projection of a layer: LoRA here "
                         "adapts " + valid_targets_text);
    throw config_error(what + " names an unknown target '" + name + "': the targets are " + valid_targets_text);
  }
  if (bits == 0) throw config_error(what + " is empty: name at least one of " + std::string(valid_targets_text));
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
    throw config_error(what + " needs targets among " + std::string(valid_targets_text));
  for (lora_target t : lora.target_list()) {
    const auto [out, in] = target_shape(model, t);
    const std::int64_t widest = std::min(out, in);
    if (lora.rank > widest)
      throw config_error(what + " r=" + std::to_string(lora.rank) + " exceeds " + lora_module_name(t) + "'s " +
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
    throw config_error("--lora targets= names no projection: name some of " + std::string(valid_targets_text) +
                       ", or leave targets out for all seven");
  std::vector<std::string> names;
  for (std::size_t start = 0; targets && start <= targets->size();) {
    const std::size_t comma = std::min(targets->find(',', start), targets->size());
    names.push_back(targets->substr(start, comma - start));
    start = comma + 1;
  }
  lora.targets = names.empty() ? every_target : parse_lora_targets(names, model);
  validate(lora, model);
  return lora;
}

std::vector<parameter_spec> lora_parameter_specs(const model_config& model, const lora_config& lora) {
  std::vector<parameter_spec> specs;
  for (int l = 0; l < model.num_layers; ++l)
    for (lora_target t : lora.target_list()) {
      const auto [out, in] = target_shape(model, t);
      specs.push_back({adapter_name(l, t, 'A'), {lora.rank, in}});
      specs.push_back({adapter_name(l, t, 'B'), {out, lora.rank}});
    }
  return specs;
}

std::int64_t lora_parameter_count(const model_config& model, const lora_config& lora) {
  std::int64_t n = 0;
  for (lora_target t : lora.target_list()) {
    const auto [out, in] = target_shape(model, t);
    n += lora.rank * (in + out);
  }
  return n * model.num_layers;
}

std::size_t lora_offloaded_optimizer_bytes(const model_config& model, const lora_config& lora, int ranks, dtype work) {
  const std::int64_t per_layer = lora_parameter_count(model, lora) / std::max(model.num_layers, 1);
  const auto shard = static_cast<std::size_t>((per_layer + ranks - 1) / ranks);
  return static_cast<std::size_t>(model.num_layers) * shard * (4 * sizeof(float) + dtype_size(work));
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

projection& target_of(layer_params& p, lora_target t) {
  switch (t) {
    case lora_target::q: return p.attention.wq;
    case lora_target::k: return p.attention.wk;
    case lora_target::v: return p.attention.wv;
    case lora_target::o: return p.attention.wo;
    case lora_target::gate: return p.gate;
    case lora_target::up: return p.up;
    case lora_target::down: break;
  }
  return p.down;
}

projection_grads& target_of(layer_gradients& g, lora_target t) {
  switch (t) {
    case lora_target::q: return g.attention.wq;
    case lora_target::k: return g.attention.wk;
    case lora_target::v: return g.attention.wv;
    case lora_target::o: return g.attention.wo;
    case lora_target::gate: return g.gate;
    case lora_target::up: return g.up;
    case lora_target::down: break;
  }
  return g.down;
}

}  // namespace

void attach_adapters(layer_params& p, const lora_config& lora, int layer, const named_view& view) {
  for (lora_target t : lora.target_list()) {
    projection& w = target_of(p, t);
    w.lora_a = view(adapter_name(layer, t, 'A'));
    w.lora_b = view(adapter_name(layer, t, 'B'));
    w.lora_scale = lora.scale();
  }
}

void attach_adapter_grads(layer_gradients& g, const lora_config& lora, int layer, const named_view& view) {
  for (lora_target t : lora.target_list()) {
    projection_grads& w = target_of(g, t);
    w.lora_a = view(adapter_name(layer, t, 'A'));
    w.lora_b = view(adapter_name(layer, t, 'B'));
  }
}

}  // namespace upipe
