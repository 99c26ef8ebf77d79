// The hybrid families' fields of config.json (docs/design.md section 11: Qwen3.5, Qwen3.5-MoE,
// Qwen3-Next), read as Qwen3_5TextConfig, Qwen3_5MoeTextConfig and Qwen3NextConfig read them:
// which layers are Gated DeltaNet layers (layer_types, else every full_attention_interval-th
// layer attends), the linear layers' sizes, partial_rotary_factor (rope_parameters' wins over
// the top level's, 0.25 where neither says) and the attention's output gate. Nothing here is
// fixed to a checkpoint's sizes: every one comes from config.json or the class's default.
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "model/config.hpp"
#include "model/config_fields.hpp"

namespace upipe {
namespace {

using json = nlohmann::json;
using config_fields::bool_or;
using config_fields::find;
using config_fields::int_or;
using config_fields::type_error;

std::vector<bool> read_linear_layers(const model_config& c, const json& root, const std::string& path) {
  const auto layers = static_cast<std::size_t>(std::max(c.num_layers, 0));
  std::vector<bool> linear;
  if (const json* types = find(root, "layer_types")) {
    if (!types->is_array()) throw type_error(path, "layer_types", "a list", *types);
    if (types->size() != layers)
      throw config_error("model config '" + path + "': layer_types lists " + std::to_string(types->size()) +
                         " layers but num_hidden_layers is " + std::to_string(c.num_layers) +
                         ": give one type per layer (linear_attention or full_attention), or leave layer_types out");
    for (const json& t : *types) {
      const std::string name = t.is_string() ? t.get<std::string>() : t.dump();
      if (name != "linear_attention" && name != "full_attention")
        throw config_error("model config '" + path + "': layer_types holds '" + name + "': a " +
                           std::string(c.traits().model_type) +
                           " layer is linear_attention (Gated DeltaNet) or full_attention");
      linear.push_back(name == "linear_attention");
    }
    return linear;
  }
  const int interval = int_or(root, path, "full_attention_interval", 4);  // the config classes' default
  if (interval < 1)
    throw config_error("model config '" + path + "': full_attention_interval = " + std::to_string(interval) +
                       " must be at least 1 (every interval-th layer is full attention); for example 4");
  for (std::size_t l = 0; l < layers; ++l) linear.push_back((static_cast<int>(l) + 1) % interval != 0);
  return linear;
}

// transformers keeps partial_rotary_factor in rope_parameters; a top-level one fills it in
// where rope_parameters has none, and the config classes default it to 0.25.
double read_rotary_factor(const family_row& row, const json& root, const std::string& path) {
  const char* key = "partial_rotary_factor";
  const json* parameters = find(root, "rope_parameters");
  if (parameters != nullptr && parameters->is_object())
    if (const json* v = find(*parameters, key)) {
      if (!v->is_number()) throw type_error(path, "rope_parameters.partial_rotary_factor", "a number", *v);
      return v->get<double>();
    }
  if (const json* v = find(root, key)) {
    if (!v->is_number()) throw type_error(path, key, "a number", *v);
    return v->get<double>();
  }
  return row.default_rotary_factor;
}

}  // namespace

int model_config::linear_layer_count() const {
  return static_cast<int>(std::count(linear.layers.begin(), linear.layers.end(), true));
}

void read_hybrid_fields(model_config& c, const json& root, const std::string& path) {
  const family_row& row = c.traits();
  if (row.mixers != mixer_rule::hybrid) return;
  c.attention_gate = row.attention_gate;
  // The Hub's configs say attn_output_gate = true; transformers builds the gate whatever it
  // says, so a checkpoint without one cannot be what this family is.
  if (!bool_or(root, path, "attn_output_gate", true))
    throw config_error("model config '" + path + "': attn_output_gate = false is not supported: the " +
                       std::string(row.model_type) + " attention's q_proj yields each head's query and its output "
                       "gate (transformers builds it so whatever the field says); use attn_output_gate = true");
  linear_attention_config& l = c.linear;
  l.key_heads = int_or(root, path, "linear_num_key_heads", row.default_linear_key_heads);
  l.value_heads = int_or(root, path, "linear_num_value_heads", row.default_linear_value_heads);
  l.key_dim = int_or(root, path, "linear_key_head_dim", row.default_linear_dim);
  l.value_dim = int_or(root, path, "linear_value_head_dim", row.default_linear_dim);
  l.conv_kernel = int_or(root, path, "linear_conv_kernel_dim", row.default_conv);
  l.layers = read_linear_layers(c, root, path);
  const double factor = read_rotary_factor(row, root, path);
  if (!(factor > 0 && factor <= 1))
    throw config_error("model config '" + path + "': partial_rotary_factor = " + json(factor).dump() +
                       " must lie in (0, 1] (the share of each head's dimensions that RoPE rotates); for example 0.25");
  // transformers' int(head_dim * partial_rotary_factor): the rotated dimensions.
  const int rotary = static_cast<int>(static_cast<double>(c.head_dim) * factor);
  if (rotary < 2 || rotary % 2 != 0)
    throw config_error("model config '" + path + "': partial_rotary_factor = " + json(factor).dump() +
                       " rotates " + std::to_string(rotary) + " of head_dim " + std::to_string(c.head_dim) +
                       "'s dimensions: RoPE rotates pairs, so that must be even and at least 2; for example 0.25 of 256");
  c.rope.rotary_dim = rotary == c.head_dim ? 0 : rotary;
}

void write_hybrid_fields(const model_config& c, nlohmann::ordered_json& j) {
  if (c.traits().mixers != mixer_rule::hybrid) return;
  const linear_attention_config& l = c.linear;
  nlohmann::ordered_json types = nlohmann::ordered_json::array();
  for (int i = 0; i < c.num_layers; ++i) types.push_back(c.linear_layer(i) ? "linear_attention" : "full_attention");
  j["layer_types"] = types;
  j["linear_num_key_heads"] = l.key_heads;
  j["linear_num_value_heads"] = l.value_heads;
  j["linear_key_head_dim"] = l.key_dim;
  j["linear_value_head_dim"] = l.value_dim;
  j["linear_conv_kernel_dim"] = l.conv_kernel;
  // The RoPE in transformers 5's form, with the share it rotates.
  nlohmann::ordered_json rope = j.contains("rope_scaling") && j["rope_scaling"].is_object() ? j["rope_scaling"]
                                                                                          : nlohmann::ordered_json::object();
  if (!rope.contains("rope_type")) rope["rope_type"] = "default";
  rope["rope_theta"] = c.rope.theta;
  rope["partial_rotary_factor"] =
      c.rope.rotary_dim > 0 ? static_cast<double>(c.rope.rotary_dim) / static_cast<double>(c.head_dim) : 1.0;
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j["rope_parameters"] = rope;
}

void validate_hybrid(const model_config& c) {
  const family_row& row = c.traits();
  const std::string model = "model '" + c.name + "': ";
  const linear_attention_config& l = c.linear;
  if (row.mixers != mixer_rule::hybrid) {
    if (l.key_heads != 0 || !l.layers.empty() || c.attention_gate)
      throw config_error(model + "the " + std::string(row.model_type) + " family has no linear attention layers nor "
                         "gated attention; use a hybrid family (qwen3_5_text, qwen3_5_moe_text, qwen3_next)");
    return;
  }
  if (!c.attention_gate)
    throw config_error(model + "the " + std::string(row.model_type) + " family's attention is gated "
                       "(attn_output_gate = true)");
  const auto size_rule = [&](std::int64_t value, std::int64_t hi, const char* what, const char* example) {
    if (value < 1 || value > hi)
      throw config_error(model + what + " = " + std::to_string(value) + " must lie in [1, " + std::to_string(hi) +
                         "]; for example " + example);
  };
  size_rule(l.key_heads, 4096, "linear_num_key_heads", "16");
  size_rule(l.value_heads, 4096, "linear_num_value_heads", "32");
  size_rule(l.key_dim, 4096, "linear_key_head_dim", "128");
  size_rule(l.value_dim, 4096, "linear_value_head_dim", "128");
  size_rule(l.conv_kernel, 64, "linear_conv_kernel_dim", "4");
  if (l.value_heads % l.key_heads != 0)
    throw config_error(model + "linear_num_value_heads = " + std::to_string(l.value_heads) +
                       " must be a multiple of linear_num_key_heads = " + std::to_string(l.key_heads) +
                       " (each key head serves value_heads / key_heads value heads); for example " +
                       std::to_string(2 * l.key_heads));
  if (static_cast<int>(l.layers.size()) != c.num_layers)
    throw config_error(model + "the layer types list " + std::to_string(l.layers.size()) + " layers for " +
                       std::to_string(c.num_layers) + ": give one per layer");
  if (c.rope.rotary_dim < 0 || c.rope.rotary_dim > c.head_dim || c.rope.rotary_dim % 2 != 0)
    throw config_error(model + "the rotary dimensions " + std::to_string(c.rope.rotary_dim) +
                       " must be even and at most head_dim " + std::to_string(c.head_dim));
}

}  // namespace upipe
