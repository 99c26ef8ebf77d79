// The mixture-of-experts fields of config.json (docs/design.md section 11), read as the
// family's transformers config class reads them (Qwen3MoeConfig, MixtralConfig,
// Qwen2MoeConfig) and checked; what a written config.json says of them.
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
using config_fields::int_field;
using config_fields::int_or;
using config_fields::number_or;
using config_fields::type_error;

// Which layers are sparse: every one (Mixtral), or Qwen's rule: not in mlp_only_layers, E > 0
// and (l + 1) % decoder_sparse_step == 0. Entries of mlp_only_layers past the layers name
// none, as in transformers.
std::vector<bool> read_sparse_layers(const model_config& c, const json& root, const std::string& path) {
  const auto layers = static_cast<std::size_t>(std::max(c.num_layers, 0));
  if (c.moe.experts == 0) return std::vector<bool>(layers, false);
  if (c.traits().moe == moe_rule::every_layer) return std::vector<bool>(layers, true);
  const int step = int_or(root, path, "decoder_sparse_step", 1);
  if (step < 1)
    throw config_error("model config '" + path + "': decoder_sparse_step = " + std::to_string(step) +
                       " must be at least 1 (every step-th layer is sparse); for example 1");
  std::vector<bool> sparse(layers, false);
  for (std::size_t l = 0; l < layers; ++l) sparse[l] = (static_cast<int>(l) + 1) % step == 0;
  if (const json* only = find(root, "mlp_only_layers")) {
    if (!only->is_array()) throw type_error(path, "mlp_only_layers", "a list of layer numbers", *only);
    for (const json& entry : *only) {
      const int l = int_field(entry, path, "mlp_only_layers");
      if (l >= 0 && static_cast<std::size_t>(l) < layers) sparse[static_cast<std::size_t>(l)] = false;
    }
  }
  return sparse;
}

// Windows the rows do not describe: Qwen3-MoE windows every layer, Qwen2-MoE without
// layer_types alternates below max_window_layers. Refused rather than run as another model.
void refuse_moe_windows(const family_row& row, const json& root, const std::string& path) {
  if (!bool_or(root, path, "use_sliding_window", false)) return;
  if (row.windows == window_rule::none || find(root, "layer_types") == nullptr)
    throw config_error("model config '" + path + "': use_sliding_window = true is not supported for " +
                       std::string(row.model_type) + (row.windows == window_rule::none ? "" : " without layer_types") +
                       " (upipe has no row for the layers it would window); use use_sliding_window = false" +
                       (row.windows == window_rule::none ? "" : ", or list the layers' types in layer_types"));
}

}  // namespace

int model_config::sparse_layer_count() const {
  int n = 0;
  for (bool sparse : moe.sparse_layers) n += sparse ? 1 : 0;
  return n;
}

void read_moe_fields(model_config& c, const json& root, const std::string& path) {
  const family_row& row = c.traits();
  if (row.moe == moe_rule::none) return;
  refuse_moe_windows(row, root, path);
  if (row.qkv_bias_key != nullptr && bool_or(root, path, row.qkv_bias_key, true)) c.biases |= qkv_projections;
  moe_config& m = c.moe;
  // Qwen3MoeConfig maps num_local_experts to num_experts (and writes the former): either is read.
  const char* other_key = std::string_view(row.experts_key) == "num_experts" ? "num_local_experts" : "num_experts";
  m.experts = int_or(root, path, row.experts_key, int_or(root, path, other_key, row.default_experts));
  m.top_k = int_or(root, path, "num_experts_per_tok", row.default_top_k);
  m.expert_width = int_or(root, path, row.expert_width_key, row.default_expert_width);
  m.shared_width = row.shared_expert ? int_or(root, path, "shared_expert_intermediate_size", row.default_shared_width) : 0;
  m.normalize_top_k =
      row.topk_normalization == topk_norm::always || bool_or(root, path, "norm_topk_prob", row.default_norm_topk);
  m.output_router_logits = bool_or(root, path, "output_router_logits", false);
  m.router_aux_loss_coef = number_or(root, path, "router_aux_loss_coef", 0.001);
  if (const double jitter = number_or(root, path, "router_jitter_noise", 0.0); jitter != 0.0)
    throw config_error("model config '" + path + "': router_jitter_noise = " + find(root, "router_jitter_noise")->dump() +
                       " is not supported (random noise on the router's input in training would change the loss "
                       "from step to step); use 0.0");
  if (m.experts < 0)
    throw config_error("model config '" + path + "': " + row.experts_key + " = " + std::to_string(m.experts) +
                       " must be at least 0 (0: every layer dense); for example " + std::to_string(row.default_experts));
  m.sparse_layers = read_sparse_layers(c, root, path);
}

void write_moe_fields(const model_config& c, nlohmann::ordered_json& j) {
  const family_row& row = c.traits();
  if (row.moe == moe_rule::none) return;
  const moe_config& m = c.moe;
  j[row.experts_key] = m.experts;
  j["num_experts_per_tok"] = m.top_k;
  if (std::string_view(row.expert_width_key) != "intermediate_size") j[row.expert_width_key] = m.expert_width;
  if (row.shared_expert) j["shared_expert_intermediate_size"] = m.shared_width;
  if (row.qkv_bias_key != nullptr) j[row.qkv_bias_key] = c.has_bias(layer_projection::q);
  if (row.topk_normalization == topk_norm::config) j["norm_topk_prob"] = m.normalize_top_k;
  j["output_router_logits"] = m.output_router_logits;
  j["router_aux_loss_coef"] = m.router_aux_loss_coef;
  if (row.moe == moe_rule::sparse_step) {
    // Step 1 and the dense layers listed: the same layers whatever step was read.
    j["decoder_sparse_step"] = 1;
    nlohmann::ordered_json dense = nlohmann::ordered_json::array();
    for (int l = 0; l < c.num_layers; ++l)
      if (!c.sparse_layer(l)) dense.push_back(l);
    j["mlp_only_layers"] = dense;
  }
}

void validate_moe(const model_config& c) {
  const family_row& row = c.traits();
  const moe_config& m = c.moe;
  const std::string model = "model '" + c.name + "': ";
  if (row.moe == moe_rule::none) {
    if (m.experts != 0)
      throw config_error(model + "the " + std::string(row.model_type) + " family has no experts (" +
                         std::to_string(m.experts) + " given); use a mixture-of-experts family (qwen3_moe, mixtral, "
                         "qwen2_moe)");
    return;
  }
  if (m.experts == 0) return;  // every layer dense, as transformers builds it
  const auto size_rule = [&](std::int64_t value, std::int64_t lo, std::int64_t hi, const char* what, const char* example) {
    if (value < lo || value > hi)
      throw config_error(model + what + " = " + std::to_string(value) + " must lie in [" + std::to_string(lo) + ", " +
                         std::to_string(hi) + "]; for example " + example);
  };
  size_rule(m.experts, 1, 4096, row.experts_key, "128");
  size_rule(m.top_k, 1, m.experts, "num_experts_per_tok", "8");
  size_rule(m.expert_width, 1, 1 << 20, row.expert_width_key, "768");
  size_rule(m.shared_width, 0, 1 << 20, "shared_expert_intermediate_size", "5632");
  if (!(std::isfinite(m.router_aux_loss_coef) && m.router_aux_loss_coef >= 0))
    throw config_error(model + "router_aux_loss_coef = " + std::to_string(m.router_aux_loss_coef) +
                       " must be a finite number at least 0; for example 0.001");
  if (static_cast<int>(m.sparse_layers.size()) != c.num_layers)
    throw config_error(model + "the sparse layers' list holds " + std::to_string(m.sparse_layers.size()) +
                       " entries for " + std::to_string(c.num_layers) + " layers: give one per layer");
}

}  // namespace upipe
