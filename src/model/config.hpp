// Model configurations of the families in model/family.hpp (Llama, Qwen2, Qwen3, Mistral,
// Phi-3, Gemma 3), as presets or read from a Hugging Face config.json, and the parameters
// they imply under Hugging Face tensor names.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "model/family.hpp"
#include "ops/op_args.hpp"

namespace upipe {

// A mixture-of-experts MLP (model/family.hpp's moe rule; experts == 0: a dense model). A
// sparse layer's MLP is a router (E, D), E experts of width I and, for Qwen2-MoE, a shared
// expert of its own width behind a sigmoid gate (1, D); a dense layer among them keeps
// the model's intermediate_size.
struct moe_config {
  int experts = 0;                // E
  int top_k = 0;                  // k experts per token
  int expert_width = 0;           // I: moe_intermediate_size (Mixtral: intermediate_size)
  int shared_width = 0;           // the shared expert's width (0: none)
  bool normalize_top_k = false;   // the k weights renormalized to sum to 1 (norm_topk_prob)
  std::vector<bool> sparse_layers{};  // layer l's MLP is the sparse block
  bool output_router_logits = false;  // config.json's: the load-balancing loss joins the loss
  double router_aux_loss_coef = 0.001;
};

// A hybrid model's Gated DeltaNet layers (docs/design.md section 11; key_heads == 0: none).
// Each holds Hk key heads of dk and Hv = G Hk value heads of dv (value head h reads key head
// h / G, transformers' repeat_interleave), a causal depthwise convolution of Kc taps over the
// q, k and v channels, and a dk x dv state per value head.
struct linear_attention_config {
  int key_heads = 0;    // Hk: linear_num_key_heads
  int value_heads = 0;  // Hv: linear_num_value_heads
  int key_dim = 0;      // dk: linear_key_head_dim
  int value_dim = 0;    // dv: linear_value_head_dim
  int conv_kernel = 0;  // Kc: linear_conv_kernel_dim
  std::vector<bool> layers{};  // layer l is a Gated DeltaNet layer (layer_types' linear_attention)

  std::int64_t key_width() const { return std::int64_t{key_heads} * key_dim; }        // Hk dk
  std::int64_t value_width() const { return std::int64_t{value_heads} * value_dim; }  // Hv dv
  // The convolution's channels: q, k and v side by side, 2 Hk dk + Hv dv.
  std::int64_t conv_channels() const { return 2 * key_width() + value_width(); }
  bool operator==(const linear_attention_config&) const = default;
};

struct model_config {
  std::string name;  // preset name, or the config file's path
  model_family family = model_family::llama;
  std::int64_t vocab_size = 0;
  int hidden_size = 0;        // D
  int intermediate_size = 0;  // F, the SwiGLU width
  int num_layers = 0;         // L
  int num_heads = 0;          // H
  int num_kv_heads = 0;       // K
  int head_dim = 0;           // d (Qwen3 may have H*d != D)
  double rms_norm_eps = 1e-5;
  rope_config rope;
  bool tie_embeddings = false;  // lm head = embedding matrix
  bool qk_norm = false;         // Qwen3, Gemma 3: RMSNorm over d on each q and k head
  std::int64_t max_position_embeddings = 0;  // the context the model declares (0: unknown)
  std::string stored_dtype{};   // config.json's dtype ("bfloat16"), empty for presets
  // What the family's row (model/family.hpp) and config.json make of the rest.
  std::uint8_t biases = 0;  // projections with a bias (projection_bit): Qwen2's q, k, v
  gate_activation activation = gate_activation::silu;
  std::int64_t sliding_window = 0;    // W of the windowed layers (0: none)
  std::vector<bool> windowed_layers{};  // layer l attends through the window where set (empty: none)
  std::optional<rope_config> local_rope{};  // the windowed layers' RoPE where it differs (Gemma 3's local base)
  double query_pre_attn_scalar = 0;   // > 0: scores scaled by its inverse square root (Gemma 3), else 1/sqrt(d)
  std::int32_t padding_id = -1;       // pad_token_id: its embedding row is not trained by lookups (-1: none)
  moe_config moe{};                   // experts == 0: every MLP dense
  linear_attention_config linear{};   // key_heads == 0: every layer attends
  // The hybrids' full attention: q_proj yields each head's query and its output gate, the
  // attention's output multiplied by sigmoid(gate) before o_proj (Qwen3.5, Qwen3-Next).
  bool attention_gate = false;

  const family_row& traits() const { return family_traits(family); }
  bool has_bias(layer_projection p) const { return (biases & projection_bit(p)) != 0; }
  // Is layer l's MLP the mixture of experts?
  bool sparse_layer(int layer) const {
    return layer >= 0 && layer < static_cast<int>(moe.sparse_layers.size()) && moe.sparse_layers[layer];
  }
  int sparse_layer_count() const;
  // Is layer l a Gated DeltaNet layer (a hybrid's linear_attention)?
  bool linear_layer(int layer) const {
    return layer >= 0 && layer < static_cast<int>(linear.layers.size()) && linear.layers[layer];
  }
  int linear_layer_count() const;
  // Layer l's window (0: global attention) and RoPE.
  std::int64_t layer_window(int layer) const;
  const rope_config& layer_rope(int layer) const;
  // The softmax scale of the attention scores.
  float attention_scale() const;

  std::int64_t parameter_count() const;
  // Weights used in a matmul (every projection and the lm head; not the embedding
  // lookup or the norms): docs/design.md section 7's N_matmul.
  std::int64_t matmul_parameter_count() const;
  // Model FLOPs of one forward+backward over S tokens, recompute not counted:
  // 6 N_matmul S + 6 L H d S^2 (causal attention), over the attention layers; a hybrid's
  // Gated DeltaNet layers add 18 Hv dk dv S each (their recurrence).
  double model_flops(std::int64_t seq_len) const;
  // The same over packed documents (`documents`: where each begins): attention counts only
  // the pairs inside a document, 6 L H d sum_i L_i^2.
  double model_flops(std::int64_t seq_len, std::span<const std::int64_t> documents) const;
};

// One parameter: its Hugging Face name, shape (row-major, y = x W^T for linears) and kind.
struct parameter_spec {
  std::string name;  // e.g. "model.layers.3.self_attn.q_proj.weight"
  std::vector<std::int64_t> shape;
  param_kind kind = param_kind::matrix;
};

// Every parameter of the model in a fixed order, as the family's directories name them
// (model/parameters.cpp): the embedding, then per layer its norms, projections (and
// biases, q/k norms) in the family's order, then the final norm, then lm_head unless tied.
std::vector<parameter_spec> parameter_specs(const model_config& config);

// Names of the presets: llama3-8b, llama3-70b, llama3.2-1b, llama3.2-3b, qwen3-8b,
// qwen3-32b, qwen2.5-7b, mistral-7b, gemma3-4b, gemma3-12b, gemma3-27b, qwen3-30b-a3b, the hybrids
// qwen3.5-27b, qwen3.5-35b-a3b and qwen3-next-80b-a3b, and the tiny
// models of the tests: tiny-llama, tiny-qwen3, tiny-qwen2, tiny-mistral, tiny-phi3,
// tiny-gemma3, tiny-qwen3-moe.
std::vector<std::string> preset_names();
// Throws config_error naming the unknown preset and listing the known ones.
model_config preset(std::string_view name);
// The context a preset declares when it names none: the family's (Qwen3 40960, Gemma 3
// 131072, ...), else Llama 3.1 / 3.2's 131072 when the RoPE is scaled and 8192 when not;
// never below the scaling's original context.
std::int64_t default_max_position_embeddings(const model_config& c);
// Reads a Hugging Face config.json (a model_type of family_table()), given as the file or
// the model directory holding it; absent fields take the defaults of the family's
// transformers config class. Throws io_error for an unreadable or malformed file (missing
// field, wrong JSON type) and config_error for an unsupported configuration (another
// model_type or rope_type, an activation or feature upipe does not run).
model_config read_hf_config(const std::string& path);
// DIR/config.json for a directory, else the path itself.
std::string hf_config_file(const std::string& path);
// Is this a directory holding a config.json (a Hugging Face model directory)?
bool is_model_directory(const std::string& path);
// Writes a config.json that Hugging Face transformers loads (and read_hf_config reads).
// With a base (the input model's config.json or directory), every field of the base is
// kept and only the RoPE settings, max_position_embeddings and the dtype are written.
void write_hf_config(const model_config& config, const std::string& path, const std::string& base_path = "",
                     const std::string& dtype = "float32");
// "default", "llama3", "linear", "yarn"; throws config_error naming `what` and the valid ones.
rope_kind parse_rope_kind(std::string_view name, const std::string& what);
// transformers' name of a RoPE type: "default", "llama3", "linear" or "yarn".
const char* rope_kind_name(rope_kind kind);
// The mixture-of-experts fields of config.json as the family's transformers config class
// reads them (model/moe_config.cpp), and what a written config.json says of them.
void read_moe_fields(model_config& c, const nlohmann::json& root, const std::string& path);
void write_moe_fields(const model_config& c, nlohmann::ordered_json& j);
// The experts' checks (sizes, k <= E, the layers' list); part of validate.
void validate_moe(const model_config& c);
// A hybrid's fields of config.json as Qwen3_5TextConfig / Qwen3NextConfig read them
// (model/hybrid_config.cpp: layer_types, the linear_* sizes, partial_rotary_factor), what a
// written config.json says of them, and their checks (part of validate).
void read_hybrid_fields(model_config& c, const nlohmann::json& root, const std::string& path);
void write_hybrid_fields(const model_config& c, nlohmann::ordered_json& j);
void validate_hybrid(const model_config& c);
// Checks the configuration's own consistency (positive sizes, H divisible by K, even d, the
// family's fixed traits, the windows); throws config_error naming the value, the rule and a
// valid alternative.
void validate(const model_config& config);

}  // namespace upipe
