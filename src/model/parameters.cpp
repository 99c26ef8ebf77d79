#include "model/parameters.hpp"

#include <charconv>

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

layer_params make_layer_params(const model_config& config, int index,
                               const std::function<mat_view(const std::string&)>& view) {
  const std::string p = "model.layers." + std::to_string(index) + ".";
  layer_params l;
  l.input_norm = view(p + "input_layernorm.weight");
  l.attention.wq = view(p + "self_attn.q_proj.weight");
  l.attention.wk = view(p + "self_attn.k_proj.weight");
  l.attention.wv = view(p + "self_attn.v_proj.weight");
  l.attention.wo = view(p + "self_attn.o_proj.weight");
  if (config.qk_norm) {
    l.attention.q_norm = view(p + "self_attn.q_norm.weight");
    l.attention.k_norm = view(p + "self_attn.k_norm.weight");
  }
  l.post_norm = view(p + "post_attention_layernorm.weight");
  l.gate = view(p + "mlp.gate_proj.weight");
  l.up = view(p + "mlp.up_proj.weight");
  l.down = view(p + "mlp.down_proj.weight");
  return l;
}

layer_gradients as_gradients(const layer_params& g) {
  const attention_weights& a = g.attention;
  return {g.input_norm,
          {a.wq.weight, a.wk.weight, a.wv.weight, a.wo.weight, a.q_norm, a.k_norm},
          g.post_norm,
          g.gate.weight,
          g.up.weight,
          g.down.weight};
}

}  // namespace upipe
