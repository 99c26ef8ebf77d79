// Model families as rows of one table (docs/design.md section 11): what sets a family
// apart from Llama, the defaults transformers' config class gives where config.json is
// silent, and the names under which its directories store each tensor. Everything else
// of the model reads the row through the resolved model_config (config.hpp), never the
// family's name; a family that needs no new op is a row here, its name mapping and its
// golden fixtures.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ops/op_args.hpp"

namespace upipe {

enum class model_family : std::uint8_t {
  llama, qwen2, qwen3, mistral, phi3, gemma3, qwen3_moe, mixtral, qwen2_moe, qwen3_5, qwen3_5_moe, qwen3_next
};

// What a parameter is. Initialization, weight decay (matrices, embeddings and convolutions
// only), LoRA's targets (a layer's matrices) and the checks of files read it. The hybrids'
// Gated DeltaNet layers add a depthwise convolution, the decay's A_log (the log of its rate
// per value head) and the gated RMSNorm's weight, which scales by w whatever offset the
// family's other norms take.
enum class param_kind : std::uint8_t { matrix, norm, bias, embedding, conv, log_decay, gated_norm };

// Where a block's RMSNorms sit: before attention and before the MLP (Llama), or also after
// each, on the block's output before the residual add (Gemma 3's sandwich).
enum class block_norms : std::uint8_t { pre, pre_and_post };

// Gemma multiplies the looked-up embedding by sqrt(D), rounded to the working dtype as
// transformers rounds it to the model's.
enum class embedding_scaling : std::uint8_t { none, sqrt_hidden };

// Which layers attend through a window of `sliding_window` tokens, from config.json:
// none: every layer is global (Llama);
// every_layer: every layer, unless sliding_window is null (Mistral, Phi-3);
// qwen_layers: the `layer_types` list, or without it the layers from max_window_layers on;
//   only with use_sliding_window (Qwen2, Qwen3);
// pattern_layers: the `layer_types` list, or without it all but every
//   sliding_window_pattern-th layer (Gemma 3).
enum class window_rule : std::uint8_t { none, every_layer, qwen_layers, pattern_layers };

// A mixture-of-experts family's MLP (docs/design.md section 11): which layers are sparse, how
// the router's top-k weights are normalized and whether a shared expert sits beside the
// routed ones. none: a dense family.
enum class moe_rule : std::uint8_t {
  none,
  every_layer,   // every layer's MLP is sparse (Mixtral)
  sparse_step,   // layer l is sparse unless in mlp_only_layers, when (l + 1) % decoder_sparse_step == 0 (Qwen)
};
enum class topk_norm : std::uint8_t { always, config };  // Mixtral renormalizes; Qwen reads norm_topk_prob

// Which token mixer each layer has (docs/design.md section 11): attention in every layer, or
// the hybrids' Gated DeltaNet layers beside full-attention ones (layer_types' linear_attention
// and full_attention, or without it every full_attention_interval-th layer full).
enum class mixer_rule : std::uint8_t { attention, hybrid };

// The linear projections of a decoder layer (also LoRA's targets).
enum class layer_projection : std::uint8_t { q, k, v, o, gate, up, down };
inline constexpr int layer_projection_count = 7;
constexpr std::uint8_t projection_bit(layer_projection p) { return static_cast<std::uint8_t>(1u << static_cast<int>(p)); }
inline constexpr std::uint8_t qkv_projections =
    projection_bit(layer_projection::q) | projection_bit(layer_projection::k) | projection_bit(layer_projection::v);

struct family_row {
  model_family family;
  std::string_view model_type;    // config.json's model_type
  std::string_view architecture;  // what a written config.json's architectures names
  std::string_view models;        // for messages: "Llama 3 / 3.1 / 3.2"

  // The architecture.
  bool qk_norm = false;           // RMSNorm over d on each q and k head, before RoPE
  std::uint8_t biases = 0;        // projections that always have a bias (projection_bit)
  bool config_biases = false;     // attention_bias (q, k, v, o) and mlp_bias are read from config.json
  block_norms norms = block_norms::pre;
  float norm_offset = 0.0f;       // RMSNorm scales by (norm_offset + weight): Gemma's 1
  embedding_scaling embedding = embedding_scaling::none;
  window_rule windows = window_rule::none;
  bool query_pre_attn_scalar = false;  // scores scaled by 1/sqrt(query_pre_attn_scalar), not 1/sqrt(d)

  // transformers' defaults where config.json is silent.
  int default_kv_heads = 0;          // absent num_key_value_heads (0: H)
  int default_head_dim = 0;          // absent head_dim (0: D / H)
  double default_theta = 10000.0;
  double default_local_theta = 0.0;  // RoPE base of windowed layers (0: the global one)
  bool default_tied = false;
  std::int64_t default_context = 0;  // a preset's max_position_embeddings (0: by the RoPE)
  const char* activation_key = "hidden_act";
  gate_activation default_activation = gate_activation::silu;

  // The name mapping: tensors under model.layers.N. (nullptr: the role is absent, or held
  // in the fused tensor).
  const char* qkv_fused = nullptr;      // q, k and v stacked by rows (Phi-3's self_attn.qkv_proj)
  const char* gate_up_fused = nullptr;  // gate and up stacked by rows (Phi-3's mlp.gate_up_proj)
  const char* mlp_norm = "post_attention_layernorm";  // the RMSNorm before the MLP
  const char* attention_post_norm = nullptr;          // after attention (Gemma 3)
  const char* mlp_post_norm = nullptr;                // after the MLP (Gemma 3)

  // Mixture of experts (moe != none). The block holds the router `gate` and the experts
  // `experts.N.<gate>/<up>/<down>` as save_pretrained writes them; newer transformers' fused
  // `experts.gate_up_proj` (E, 2I, D) and `experts.down_proj` (E, D, I) are read too.
  moe_rule moe = moe_rule::none;
  topk_norm topk_normalization = topk_norm::config;
  const char* moe_block = "mlp";                     // "block_sparse_moe" (Mixtral)
  const char* expert_names[3] = {"gate_proj", "up_proj", "down_proj"};  // Mixtral: w1, w3, w2
  const char* experts_key = "num_experts";          // or num_local_experts (Mixtral); the other is read too
  const char* expert_width_key = "moe_intermediate_size";  // Mixtral: intermediate_size
  bool shared_expert = false;                        // Qwen2-MoE's shared_expert behind sigmoid(shared_expert_gate)
  const char* qkv_bias_key = nullptr;                // Qwen2-MoE's qkv_bias: q, k and v biases when true (default)
  int default_experts = 0, default_top_k = 0, default_expert_width = 0, default_shared_width = 0;
  bool default_norm_topk = false;                    // norm_topk_prob where config.json is silent (Qwen3-Next: true)
  bool dense_width_optional = false;                 // no intermediate_size: every layer sparse (Qwen3.5-MoE)

  // Hybrid linear attention (mixers == hybrid): Gated DeltaNet layers (`linear_attn.*`) beside
  // gated full-attention ones whose q_proj yields each head's query and its output gate.
  mixer_rule mixers = mixer_rule::attention;
  bool attention_gate = false;             // q_proj (2 H d, D): per head d query rows, then d gate rows
  double default_rotary_factor = 1.0;      // partial_rotary_factor where config.json is silent
  const char* linear_qkvz_fused = nullptr;  // Qwen3-Next's in_proj_qkvz / in_proj_ba, grouped by key head
  const char* linear_ba_fused = nullptr;
  int default_linear_key_heads = 16, default_linear_value_heads = 32, default_linear_dim = 128, default_conv = 4;
  // The multimodal model_type whose text_config holds this family's text model (the Hub's
  // Qwen3.5 checkpoints: "qwen3_5" with its weights under model.language_model.*).
  const char* multimodal_type = nullptr;
};

// Every family, one row each.
const std::vector<family_row>& family_table();
const family_row& family_traits(model_family family);
// The row of a config.json model_type, or nullptr.
const family_row* find_family(std::string_view model_type);
// The row whose text model a multimodal model_type holds (its text_config), or nullptr.
const family_row* find_multimodal_family(std::string_view model_type);
// "llama, qwen2, ..., mixtral and qwen2_moe".
std::string family_names();

// transformers' name of an activation ("silu", "gelu_pytorch_tanh") and back; nullptr /
// false where upipe has no such activation.
const char* activation_name(gate_activation activation);
bool parse_activation(std::string_view name, gate_activation& out);

}  // namespace upipe
