#include "model/family.hpp"

#include "core/error.hpp"

namespace upipe {

namespace {

// Each row against transformers' configuration and modeling classes of the family
// (LlamaConfig, Qwen2Config, Qwen3Config, MistralConfig, Phi3Config, Gemma3TextConfig,
// Qwen3MoeConfig, MixtralConfig, Qwen2MoeConfig, Qwen3_5TextConfig, Qwen3_5MoeTextConfig,
// Qwen3NextConfig).
std::vector<family_row> make_table() {
  using enum model_family;
  return {
      {.family = llama, .model_type = "llama", .architecture = "LlamaForCausalLM", .models = "Llama 3 / 3.1 / 3.2",
       .config_biases = true},
      {.family = qwen2, .model_type = "qwen2", .architecture = "Qwen2ForCausalLM", .models = "Qwen2 / Qwen2.5",
       .biases = qkv_projections, .windows = window_rule::qwen_layers, .default_kv_heads = 32,
       .default_context = 32768},
      {.family = qwen3, .model_type = "qwen3", .architecture = "Qwen3ForCausalLM", .models = "Qwen3 dense",
       .qk_norm = true, .config_biases = true, .windows = window_rule::qwen_layers, .default_kv_heads = 32,
       .default_head_dim = 128, .default_context = 40960},
      {.family = mistral, .model_type = "mistral", .architecture = "MistralForCausalLM", .models = "Mistral",
       .windows = window_rule::every_layer, .default_kv_heads = 8, .default_context = 32768},
      {.family = phi3, .model_type = "phi3", .architecture = "Phi3ForCausalLM", .models = "Phi-3 / Phi-4 mini",
       .windows = window_rule::every_layer, .default_context = 4096, .qkv_fused = "self_attn.qkv_proj",
       .gate_up_fused = "mlp.gate_up_proj"},
      {.family = gemma3, .model_type = "gemma3_text", .architecture = "Gemma3ForCausalLM", .models = "Gemma 3 (text)",
       .qk_norm = true, .config_biases = true, .norms = block_norms::pre_and_post, .norm_offset = 1.0f,
       .embedding = embedding_scaling::sqrt_hidden, .windows = window_rule::pattern_layers,
       .query_pre_attn_scalar = true, .default_kv_heads = 4, .default_head_dim = 256,
       .default_theta = 1000000.0, .default_local_theta = 10000.0, .default_tied = true, .default_context = 131072,
       .activation_key = "hidden_activation", .default_activation = gate_activation::gelu_tanh,
       .mlp_norm = "pre_feedforward_layernorm", .attention_post_norm = "post_attention_layernorm",
       .mlp_post_norm = "post_feedforward_layernorm"},
      // Qwen3MoeConfig: head_dim defaults to D / H (its attention's getattr), 4 KV heads;
      // a sliding window is refused (it would window every layer, a rule no row has).
      {.family = qwen3_moe, .model_type = "qwen3_moe", .architecture = "Qwen3MoeForCausalLM",
       .models = "Qwen3 MoE (30B-A3B, 235B-A22B)", .qk_norm = true, .config_biases = true, .default_kv_heads = 4,
       .default_context = 32768, .moe = moe_rule::sparse_step, .default_experts = 128, .default_top_k = 8,
       .default_expert_width = 768},
      {.family = mixtral, .model_type = "mixtral", .architecture = "MixtralForCausalLM", .models = "Mixtral",
       .windows = window_rule::every_layer, .default_kv_heads = 8, .default_theta = 1000000.0,
       .default_context = 131072, .moe = moe_rule::every_layer, .topk_normalization = topk_norm::always,
       .moe_block = "block_sparse_moe", .expert_names = {"w1", "w3", "w2"}, .experts_key = "num_local_experts",
       .expert_width_key = "intermediate_size", .default_experts = 8, .default_top_k = 2},
      {.family = qwen2_moe, .model_type = "qwen2_moe", .architecture = "Qwen2MoeForCausalLM",
       .models = "Qwen1.5-MoE / Qwen2-MoE", .windows = window_rule::qwen_layers, .default_kv_heads = 16,
       .default_context = 32768, .moe = moe_rule::sparse_step, .shared_expert = true, .qkv_bias_key = "qkv_bias",
       .default_experts = 60, .default_top_k = 4, .default_expert_width = 1408, .default_shared_width = 5632},
      // The hybrids: three Gated DeltaNet layers to one gated full-attention layer (q/k norms,
      // partial RoPE, head_dim 256), zero-centred (1 + w) RMSNorms. Qwen3.5's text model is
      // also read from the Hub's multimodal checkpoints (model_type qwen3_5, its text_config).
      {.family = qwen3_5, .model_type = "qwen3_5_text", .architecture = "Qwen3_5ForCausalLM",
       .models = "Qwen3.5 / Qwen3.6 dense (text)", .qk_norm = true, .config_biases = true, .norm_offset = 1.0f,
       .default_kv_heads = 4, .default_head_dim = 256, .default_context = 32768, .mixers = mixer_rule::hybrid,
       .attention_gate = true, .default_rotary_factor = 0.25, .multimodal_type = "qwen3_5"},
      {.family = qwen3_5_moe, .model_type = "qwen3_5_moe_text", .architecture = "Qwen3_5MoeForCausalLM",
       .models = "Qwen3.5 / Qwen3.6 MoE (text)", .qk_norm = true, .config_biases = true, .norm_offset = 1.0f,
       .default_kv_heads = 2, .default_head_dim = 256, .default_context = 32768, .moe = moe_rule::every_layer,
       .topk_normalization = topk_norm::always, .shared_expert = true, .default_experts = 256, .default_top_k = 8,
       .default_expert_width = 512, .default_shared_width = 512, .dense_width_optional = true,
       .mixers = mixer_rule::hybrid, .attention_gate = true, .default_rotary_factor = 0.25,
       .multimodal_type = "qwen3_5_moe"},
      {.family = qwen3_next, .model_type = "qwen3_next", .architecture = "Qwen3NextForCausalLM",
       .models = "Qwen3-Next", .qk_norm = true, .config_biases = true, .norm_offset = 1.0f, .default_kv_heads = 2,
       .default_head_dim = 256, .default_context = 32768, .moe = moe_rule::sparse_step, .shared_expert = true,
       .default_experts = 512, .default_top_k = 10, .default_expert_width = 512, .default_shared_width = 512,
       .default_norm_topk = true, .mixers = mixer_rule::hybrid, .attention_gate = true,
       .default_rotary_factor = 0.25, .linear_qkvz_fused = "linear_attn.in_proj_qkvz",
       .linear_ba_fused = "linear_attn.in_proj_ba"},
  };
}

}  // namespace

const std::vector<family_row>& family_table() {
  static const std::vector<family_row> table = make_table();
  return table;
}

const family_row& family_traits(model_family family) {
  for (const family_row& row : family_table())
    if (row.family == family) return row;
  throw internal_error("model family " + std::to_string(static_cast<int>(family)) + " has no row in the table");
}

const family_row* find_family(std::string_view model_type) {
  for (const family_row& row : family_table())
    if (row.model_type == model_type) return &row;
  return nullptr;
}

const family_row* find_multimodal_family(std::string_view model_type) {
  for (const family_row& row : family_table())
    if (row.multimodal_type != nullptr && row.multimodal_type == model_type) return &row;
  return nullptr;
}

std::string family_names() {
  const auto& table = family_table();
  std::string out;
  for (std::size_t i = 0; i < table.size(); ++i) {
    if (i > 0) out += i + 1 == table.size() ? " and " : ", ";
    out += table[i].model_type;
  }
  return out;
}

const char* activation_name(gate_activation activation) {
  return activation == gate_activation::silu ? "silu" : "gelu_pytorch_tanh";
}

bool parse_activation(std::string_view name, gate_activation& out) {
  if (name == "silu" || name == "swish") {
    out = gate_activation::silu;
    return true;
  }
  // transformers' gelu_pytorch_tanh and gelu_new are both GELU's tanh approximation.
  if (name == "gelu_pytorch_tanh" || name == "gelu_new") {
    out = gate_activation::gelu_tanh;
    return true;
  }
  return false;
}

}  // namespace upipe
