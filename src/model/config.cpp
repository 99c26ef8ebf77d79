#include "model/config.hpp"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/limits.hpp"
#include "core/files.hpp"

namespace upipe {
namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------
// Presets
// ---------------------------------------------------------------------------------------

// Llama 3.1 and 3.2 share theta and the llama3 frequency bands; 3.2 stretches by 32.
rope_config llama3_rope(double theta, double factor, std::int64_t original_max_position) {
  rope_config rope;
  rope.theta = theta;
  rope.scaling = {.kind = rope_kind::llama3,
                  .factor = factor,
                  .low_freq_factor = 1.0,
                  .high_freq_factor = 4.0,
                  .original_max_position = original_max_position};
  return rope;
}

rope_config plain_rope(double theta) {
  rope_config rope;
  rope.theta = theta;
  rope.scaling.kind = rope_kind::none;
  return rope;
}

// Gemma 3's text models: five sliding-window layers (local RoPE base 10000) to one global
// layer (base 1e6, linear scaling by 8), q/k norms, GeGLU, a tied and scaled embedding.
model_config gemma3_preset(std::string name, std::int64_t vocab, int hidden, int intermediate, int layers, int heads,
                           int kv_heads, int head_dim, double query_pre_attn_scalar, std::int64_t window) {
  rope_config global = plain_rope(1000000.0);
  global.scaling = {.kind = rope_kind::linear, .factor = 8.0};
  model_config c{.name = std::move(name), .family = model_family::gemma3, .vocab_size = vocab, .hidden_size = hidden,
                 .intermediate_size = intermediate, .num_layers = layers, .num_heads = heads, .num_kv_heads = kv_heads,
                 .head_dim = head_dim, .rms_norm_eps = 1e-6, .rope = global, .tie_embeddings = true, .qk_norm = true};
  c.activation = gate_activation::gelu_tanh;
  c.sliding_window = window;
  for (int l = 0; l < layers; ++l) c.windowed_layers.push_back((l + 1) % 6 != 0);
  c.local_rope = plain_rope(10000.0);
  c.query_pre_attn_scalar = query_pre_attn_scalar;
  c.padding_id = 0;
  return c;
}

// The hybrids (Qwen3.5, Qwen3-Next): three Gated DeltaNet layers to one gated full-attention
// layer of head_dim 256 whose RoPE (base 1e7) rotates a quarter of each head, zero-centred
// norms, a context of 262144 tokens.
model_config hybrid_preset(std::string name, model_family family, std::int64_t vocab, int hidden, int intermediate,
                           int layers, int heads, int kv_heads, linear_attention_config linear) {
  rope_config rope = plain_rope(10000000.0);
  rope.rotary_dim = 64;
  model_config c{.name = std::move(name), .family = family, .vocab_size = vocab, .hidden_size = hidden,
                 .intermediate_size = intermediate, .num_layers = layers, .num_heads = heads, .num_kv_heads = kv_heads,
                 .head_dim = 256, .rms_norm_eps = 1e-6, .rope = rope, .tie_embeddings = false, .qk_norm = true,
                 .max_position_embeddings = 262144};
  for (int l = 0; l < layers; ++l) linear.layers.push_back((l + 1) % 4 != 0);
  c.linear = std::move(linear);
  c.attention_gate = true;
  return c;
}

// The published Hugging Face configs (meta-llama/Llama-3.1-*, meta-llama/Llama-3.2-*,
// Qwen/Qwen3-*, Qwen/Qwen2.5-7B, mistralai/Mistral-7B-v0.1, google/gemma-3-*-it's text
// models) and small models for tests.
std::vector<model_config> all_presets() {
  using enum model_family;
  std::vector<model_config> presets = {
      {.name = "llama3-8b", .family = llama, .vocab_size = 128256, .hidden_size = 4096,
       .intermediate_size = 14336, .num_layers = 32, .num_heads = 32, .num_kv_heads = 8,
       .head_dim = 128, .rms_norm_eps = 1e-5, .rope = llama3_rope(500000.0, 8.0, 8192),
       .tie_embeddings = false, .qk_norm = false},
      {.name = "llama3-70b", .family = llama, .vocab_size = 128256, .hidden_size = 8192,
       .intermediate_size = 28672, .num_layers = 80, .num_heads = 64, .num_kv_heads = 8,
       .head_dim = 128, .rms_norm_eps = 1e-5, .rope = llama3_rope(500000.0, 8.0, 8192),
       .tie_embeddings = false, .qk_norm = false},
      {.name = "llama3.2-1b", .family = llama, .vocab_size = 128256, .hidden_size = 2048,
       .intermediate_size = 8192, .num_layers = 16, .num_heads = 32, .num_kv_heads = 8,
       .head_dim = 64, .rms_norm_eps = 1e-5, .rope = llama3_rope(500000.0, 32.0, 8192),
       .tie_embeddings = true, .qk_norm = false},
      {.name = "llama3.2-3b", .family = llama, .vocab_size = 128256, .hidden_size = 3072,
       .intermediate_size = 8192, .num_layers = 28, .num_heads = 24, .num_kv_heads = 8,
       .head_dim = 128, .rms_norm_eps = 1e-5, .rope = llama3_rope(500000.0, 32.0, 8192),
       .tie_embeddings = true, .qk_norm = false},
      {.name = "qwen3-8b", .family = qwen3, .vocab_size = 151936, .hidden_size = 4096,
       .intermediate_size = 12288, .num_layers = 36, .num_heads = 32, .num_kv_heads = 8,
       .head_dim = 128, .rms_norm_eps = 1e-6, .rope = plain_rope(1000000.0),
       .tie_embeddings = false, .qk_norm = true},
      {.name = "qwen3-32b", .family = qwen3, .vocab_size = 151936, .hidden_size = 5120,
       .intermediate_size = 25600, .num_layers = 64, .num_heads = 64, .num_kv_heads = 8,
       .head_dim = 128, .rms_norm_eps = 1e-6, .rope = plain_rope(1000000.0),
       .tie_embeddings = false, .qk_norm = true},
      // Qwen2.5-7B: biases on q, k and v; its sliding window is off (use_sliding_window false).
      {.name = "qwen2.5-7b", .family = qwen2, .vocab_size = 152064, .hidden_size = 3584,
       .intermediate_size = 18944, .num_layers = 28, .num_heads = 28, .num_kv_heads = 4,
       .head_dim = 128, .rms_norm_eps = 1e-6, .rope = plain_rope(1000000.0),
       .tie_embeddings = false, .qk_norm = false, .max_position_embeddings = 131072, .biases = qkv_projections},
      // Mistral 7B v0.1: a 4096-token sliding window on every layer.
      {.name = "mistral-7b", .family = mistral, .vocab_size = 32000, .hidden_size = 4096,
       .intermediate_size = 14336, .num_layers = 32, .num_heads = 32, .num_kv_heads = 8,
       .head_dim = 128, .rms_norm_eps = 1e-5, .rope = plain_rope(10000.0),
       .tie_embeddings = false, .qk_norm = false, .sliding_window = 4096,
       .windowed_layers = std::vector<bool>(32, true)},
      gemma3_preset("gemma3-4b", 262208, 2560, 10240, 34, 8, 4, 256, 256, 1024),
      gemma3_preset("gemma3-12b", 262208, 3840, 15360, 48, 16, 8, 256, 256, 1024),
      gemma3_preset("gemma3-27b", 262208, 5376, 21504, 62, 32, 16, 128, 168, 1024),
      // Scaled RoPE with a short original context, so that tests reach all three bands.
      {.name = "tiny-llama", .family = llama, .vocab_size = 256, .hidden_size = 64,
       .intermediate_size = 160, .num_layers = 2, .num_heads = 4, .num_kv_heads = 2,
       .head_dim = 16, .rms_norm_eps = 1e-5, .rope = llama3_rope(10000.0, 8.0, 32),
       .tie_embeddings = false, .qk_norm = false},
      // H*d = 128 != D = 64 on purpose, as in Qwen3 where head_dim is set independently.
      {.name = "tiny-qwen3", .family = qwen3, .vocab_size = 256, .hidden_size = 64,
       .intermediate_size = 96, .num_layers = 2, .num_heads = 4, .num_kv_heads = 2,
       .head_dim = 32, .rms_norm_eps = 1e-6, .rope = plain_rope(10000.0),
       .tie_embeddings = true, .qk_norm = true},
  };
  // Three layers, windows of 5 tokens on the first two, a global third.
  model_config tiny_gemma3 = gemma3_preset("tiny-gemma3", 256, 64, 96, 3, 4, 2, 16, 24, 5);
  tiny_gemma3.windowed_layers = {true, true, false};
  tiny_gemma3.max_position_embeddings = 128;
  presets.push_back(std::move(tiny_gemma3));
  // Qwen3-30B-A3B: 48 sparse layers of 128 experts (width 768), 8 per token.
  presets.push_back({.name = "qwen3-30b-a3b", .family = qwen3_moe, .vocab_size = 151936, .hidden_size = 2048,
                     .intermediate_size = 6144, .num_layers = 48, .num_heads = 32, .num_kv_heads = 4, .head_dim = 128,
                     .rms_norm_eps = 1e-6, .rope = plain_rope(1000000.0), .tie_embeddings = false, .qk_norm = true,
                     .max_position_embeddings = 40960,
                     .moe = {.experts = 128, .top_k = 8, .expert_width = 768, .normalize_top_k = true,
                             .sparse_layers = std::vector<bool>(48, true)}});
  // Qwen/Qwen3.5-27B's text model (a multimodal checkpoint: model_type qwen3_5, its text_config):
  // 64 layers (48 Gated DeltaNet: 16 key heads, 48 value heads of 128), 24 heads over 4 kv heads.
  presets.push_back(hybrid_preset("qwen3.5-27b", qwen3_5, 248320, 5120, 17408, 64, 24, 4, {16, 48, 128, 128, 4}));
  // Qwen/Qwen3.5-35B-A3B's: 40 sparse layers of 256 experts (width 512), 8 per token, a shared expert.
  model_config q35_moe = hybrid_preset("qwen3.5-35b-a3b", qwen3_5_moe, 248320, 2048, 512, 40, 16, 2, {16, 32, 128, 128, 4});
  q35_moe.moe = {.experts = 256, .top_k = 8, .expert_width = 512, .shared_width = 512, .normalize_top_k = true,
                 .sparse_layers = std::vector<bool>(40, true)};
  presets.push_back(std::move(q35_moe));
  // Qwen/Qwen3-Next-80B-A3B-Instruct: 48 sparse layers of 512 experts (width 512), 10 per token, a shared expert.
  model_config next = hybrid_preset("qwen3-next-80b-a3b", qwen3_next, 151936, 2048, 5120, 48, 16, 2, {16, 32, 128, 128, 4});
  next.moe = {.experts = 512, .top_k = 10, .expert_width = 512, .shared_width = 512, .normalize_top_k = true,
              .sparse_layers = std::vector<bool>(48, true)};
  presets.push_back(std::move(next));
  // A tiny one for tests: a dense layer below two sparse ones, 8 experts, 2 per token.
  presets.push_back({.name = "tiny-qwen3-moe", .family = qwen3_moe, .vocab_size = 256, .hidden_size = 64,
                     .intermediate_size = 96, .num_layers = 3, .num_heads = 4, .num_kv_heads = 2, .head_dim = 16,
                     .rms_norm_eps = 1e-6, .rope = plain_rope(10000.0), .tie_embeddings = false, .qk_norm = true,
                     .moe = {.experts = 8, .top_k = 2, .expert_width = 32, .normalize_top_k = true,
                             .sparse_layers = {false, true, true}}});
  return presets;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (std::size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i];
  return out;
}

// Shortest decimal that reads back as the same double (1e-05, 500000, 0.5).
std::string format_number(double value) {
  return json(value).dump();
}

// ---------------------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------------------

void require_positive_size(const model_config& c, std::int64_t value, const char* what,
                           std::int64_t example) {
  if (value <= 0)
    throw config_error("model '" + c.name + "': " + what + " = " + std::to_string(value) +
                       " is invalid: it must be a positive integer (for example " +
                       std::to_string(example) + ")");
}

void require_positive_real(const model_config& c, double value, const char* what,
                           const char* example) {
  if (!(value > 0.0) || !std::isfinite(value))
    throw config_error("model '" + c.name + "': " + what + " = " + format_number(value) +
                       " is invalid: it must be a positive finite number (for example " + example +
                       ")");
}

// The largest divisor of `heads` that is at most `kv_heads`, as a suggestion for K.
int suggest_kv_heads(int heads, int kv_heads) {
  for (int k = std::min(kv_heads, heads); k > 1; --k)
    if (heads % k == 0) return k;
  return 1;
}

// `which`: "rope_theta", or "the windowed layers' rope_theta" for a second RoPE.
void validate_rope(const model_config& c, const rope_config& rope, const std::string& which) {
  require_positive_real(c, rope.theta, which.c_str(), "500000");
  // theta^(-2i/d) must fall from 1 and stay a normal double over every head dimension.
  if (!(rope.theta > 1 && rope.theta <= 1e12))
    throw config_error("model '" + c.name + "': " + which + " = " + format_number(rope.theta) +
                       " must lie in (1, 1e12] (RoPE's wavelengths grow from 2 pi to 2 pi theta); for example 500000");
  const rope_scaling& s = rope.scaling;
  if (!s.enabled()) return;
  require_positive_real(c, s.factor, "rope_scaling factor", "8");
  if (!(s.factor <= 65536))
    throw config_error("model '" + c.name + "': rope_scaling factor = " + format_number(s.factor) +
                       " must be at most 65536 (a context stretched 65536 times); for example 8");
  if (s.kind == rope_kind::linear) return;
  require_positive_size(c, s.original_max_position, "rope_scaling original_max_position_embeddings", 8192);
  require_within(s.original_max_position, 1, limits::context,
                 "model '" + c.name + "': rope_scaling original_max_position_embeddings", "8192");
  if (s.kind == rope_kind::yarn) {
    require_positive_real(c, s.beta_fast, "rope_scaling beta_fast", "32");
    require_positive_real(c, s.beta_slow, "rope_scaling beta_slow", "1");
    // These multiply every rotated q and k (0 or less: absent, derived from the factor).
    for (const auto& [value, name] : {std::pair{s.mscale, "mscale"}, std::pair{s.mscale_all_dim, "mscale_all_dim"},
                                      std::pair{s.attention_factor, "attention_factor"}})
      if (!(value <= 1000))
        throw config_error("model '" + c.name + "': rope_scaling " + name + " = " + format_number(value) +
                           " must be at most 1000 (it scales every rotated query and key); for example 1");
    return;
  }
  require_positive_real(c, s.low_freq_factor, "rope_scaling low_freq_factor", "1");
  require_positive_real(c, s.high_freq_factor, "rope_scaling high_freq_factor", "4");
  if (!(s.low_freq_factor < s.high_freq_factor))
    throw config_error("model '" + c.name + "': rope_scaling low_freq_factor = " +
                       format_number(s.low_freq_factor) + " must be below high_freq_factor = " +
                       format_number(s.high_freq_factor) +
                       " (the llama3 bands need low < high); for example low 1, high 4");
}

// What the family fixes, and the windows and scales config.json gave.
void validate_family_traits(const model_config& c) {
  const family_row& row = c.traits();
  const std::string model = "model '" + c.name + "': ";
  if (c.qk_norm != row.qk_norm)
    throw config_error(model + "qk_norm = " + (c.qk_norm ? "true" : "false") + " does not match the " +
                       std::string(row.model_type) + " family (" + std::string(row.models) +
                       (row.qk_norm ? " normalizes" : " does not normalize") + " q and k per head); set qk_norm = " +
                       (row.qk_norm ? "true" : "false"));
  const std::uint8_t optional = row.qkv_bias_key != nullptr ? qkv_projections : 0;  // Qwen2-MoE's qkv_bias
  if ((c.biases & row.biases) != row.biases || (!row.config_biases && (c.biases & ~optional) != row.biases))
    throw config_error(model + "the projections' biases do not match the " + std::string(row.model_type) +
                       " family's: " + std::string(row.models) +
                       (row.biases != 0 ? " has biases on q, k and v" : " has none") + (row.config_biases ? " unless attention_bias or mlp_bias says so" : ""));
  require_within(c.sliding_window, 0, limits::context, model + "sliding_window", "4096");
  if (!c.windowed_layers.empty() && static_cast<int>(c.windowed_layers.size()) != c.num_layers)
    throw config_error(model + "layer_types lists " + std::to_string(c.windowed_layers.size()) +
                       " layers but num_hidden_layers is " + std::to_string(c.num_layers) + ": give one per layer");
  if (!(c.query_pre_attn_scalar >= 0 && c.query_pre_attn_scalar <= 1e9))
    throw config_error(model + "query_pre_attn_scalar = " + format_number(c.query_pre_attn_scalar) +
                       " must be a positive number (the scores are scaled by its inverse square root); for example " +
                       std::to_string(c.head_dim));
  if (c.padding_id < -1 || c.padding_id >= c.vocab_size)
    throw config_error(model + "pad_token_id = " + std::to_string(c.padding_id) + " must be a token of the vocabulary [0, " +
                       std::to_string(c.vocab_size) + ") or null");
}

}  // namespace

const char* rope_kind_name(rope_kind kind) {
  switch (kind) {
    case rope_kind::llama3: return "llama3";
    case rope_kind::linear: return "linear";
    case rope_kind::yarn: return "yarn";
    case rope_kind::none: break;
  }
  return "default";
}


// ---------------------------------------------------------------------------------------
// Public entries
// ---------------------------------------------------------------------------------------

std::int64_t model_config::layer_window(int layer) const {
  return layer >= 0 && layer < static_cast<int>(windowed_layers.size()) && windowed_layers[layer] ? sliding_window : 0;
}

const rope_config& model_config::layer_rope(int layer) const {
  return local_rope && layer_window(layer) > 0 ? *local_rope : rope;
}

float model_config::attention_scale() const {
  const double base = query_pre_attn_scalar > 0 ? query_pre_attn_scalar : static_cast<double>(head_dim);
  return static_cast<float>(1.0 / std::sqrt(base));
}

std::int64_t model_config::parameter_count() const {
  std::int64_t n = 0;
  for (const parameter_spec& p : parameter_specs(*this)) {
    std::int64_t size = 1;
    for (std::int64_t d : p.shape) size *= d;
    n += size;
  }
  return n;
}

// Every matrix of a layer and the lm head (whether tied or not).
std::int64_t model_config::matmul_parameter_count() const {
  std::int64_t n = 0;
  for (const parameter_spec& p : parameter_specs(*this))
    if (p.kind == param_kind::matrix) n += p.shape[0] * p.shape[1];
  // A token passes k of a sparse layer's E experts: the others' weights do no work for it.
  const std::int64_t idle_experts = moe.experts - moe.top_k;
  n -= std::int64_t{sparse_layer_count()} * idle_experts * 3 * moe.expert_width * hidden_size;
  return n + (tie_embeddings ? vocab_size * hidden_size : 0);
}

namespace {

// The attention's pairs of a document of n tokens in a layer of window w, as the square
// the causal count 6 L H d S^2 takes (n^2 for a global layer): a window keeps w keys a
// query past the first w, so n^2 - (n - w)^2 = 2 n w - w^2 when n > w.
double attended_square(double n, std::int64_t window) {
  const auto w = static_cast<double>(window);
  return window <= 0 || n <= w ? n * n : 2.0 * n * w - w * w;
}

}  // namespace

double model_config::model_flops(std::int64_t seq_len) const {
  const std::int64_t start = 0;
  return model_flops(seq_len, std::span<const std::int64_t>(&start, 1));
}

double model_config::model_flops(std::int64_t seq_len, std::span<const std::int64_t> documents) const {
  double squares = 0;  // over the attention layers and documents
  for (int l = 0; l < num_layers; ++l) {
    if (linear_layer(l)) continue;  // a Gated DeltaNet layer's cost is linear in S (below)
    if (documents.empty()) squares += attended_square(static_cast<double>(seq_len), layer_window(l));
    for (std::size_t i = 0; i < documents.size(); ++i) {
      const auto length = static_cast<double>((i + 1 < documents.size() ? documents[i + 1] : seq_len) - documents[i]);
      squares += attended_square(length, layer_window(l));
    }
  }
  // A Gated DeltaNet layer's recurrence: three dk x dv products a token and value head (the
  // state's read S^T k, its update and the output S^T q), 2 FLOPs each, forward and twice in
  // backward; whatever the documents, as the state resets but does its work all the same.
  const double recurrence = 18.0 * linear.value_heads * static_cast<double>(linear.key_dim) * linear.value_dim;
  return 6.0 * static_cast<double>(matmul_parameter_count()) * static_cast<double>(seq_len) +
         6.0 * num_heads * static_cast<double>(head_dim) * squares +
         recurrence * linear_layer_count() * static_cast<double>(seq_len);
}

std::int64_t default_max_position_embeddings(const model_config& c) {
  std::int64_t context = c.traits().default_context;
  if (context == 0) context = c.rope.scaling.enabled() ? 131072 : 8192;
  if (c.rope.scaling.enabled()) context = std::max(context, c.rope.scaling.original_max_position);
  return context;
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const model_config& c : all_presets()) names.push_back(c.name);
  return names;
}

model_config preset(std::string_view name) {
  for (model_config& c : all_presets())
    if (c.name == name) {
      if (c.max_position_embeddings == 0) c.max_position_embeddings = default_max_position_embeddings(c);
      return std::move(c);
    }
  throw config_error("unknown model preset '" + std::string(name) + "': the known presets are " +
                     join(preset_names()) +
                     "; for another model pass --config with a Hugging Face config.json");
}

rope_kind parse_rope_kind(std::string_view name, const std::string& what) {
  if (name == "default" || name == "none") return rope_kind::none;
  if (name == "llama3") return rope_kind::llama3;
  if (name == "linear") return rope_kind::linear;
  if (name == "yarn") return rope_kind::yarn;
  throw config_error(what + " '" + std::string(name) +
                     "' is not supported: the supported rope types are default, llama3, linear and yarn");
}

void validate(const model_config& c) {
  require_positive_size(c, c.vocab_size, "vocab_size V", 128256);
  require_positive_size(c, c.hidden_size, "hidden_size D", 4096);
  require_positive_size(c, c.intermediate_size, "intermediate_size F", 14336);
  require_positive_size(c, c.num_layers, "num_hidden_layers L", 32);
  require_positive_size(c, c.num_heads, "num_attention_heads H", 32);
  require_positive_size(c, c.num_kv_heads, "num_key_value_heads K", 8);
  require_positive_size(c, c.head_dim, "head_dim d", 128);
  const std::string model = "model '" + c.name + "': ";
  require_within(c.vocab_size, 1, limits::vocab_size, model + "vocab_size V", "128256");
  require_within(c.hidden_size, 1, limits::hidden_size, model + "hidden_size D", "4096");
  require_within(c.intermediate_size, 1, limits::intermediate_size, model + "intermediate_size F", "14336");
  require_within(c.num_layers, 1, limits::layers, model + "num_hidden_layers L", "32");
  require_within(c.num_heads, 1, limits::heads, model + "num_attention_heads H", "32");
  require_within(c.head_dim, 1, limits::head_dim, model + "head_dim d", "128");
  require_within(c.max_position_embeddings, 0, limits::context, model + "max_position_embeddings", "131072");
  validate_moe(c);
  validate_hybrid(c);
  // Each dimension is bounded, so this cannot overflow; the total is bounded too.
  require_within(c.parameter_count(), 1, limits::parameters, model + "the parameter count", "8030261248 (llama3-8b)");
  if (c.num_heads % c.num_kv_heads != 0)
    throw config_error("model '" + c.name + "': num_key_value_heads K = " +
                       std::to_string(c.num_kv_heads) + " must divide num_attention_heads H = " +
                       std::to_string(c.num_heads) + " (grouped-query attention); for example K = " +
                       std::to_string(suggest_kv_heads(c.num_heads, c.num_kv_heads)));
  if (c.head_dim % 2 != 0)
    throw config_error("model '" + c.name + "': head_dim d = " + std::to_string(c.head_dim) +
                       " must be even (RoPE rotates pairs of dimensions); for example d = " +
                       std::to_string(c.head_dim + 1));
  require_positive_real(c, c.rms_norm_eps, "rms_norm_eps", "1e-05");
  if (!(c.rms_norm_eps <= 1))
    throw config_error(model + "rms_norm_eps = " + format_number(c.rms_norm_eps) +
                       " must be at most 1 (a variance floor above the activations' own would flatten every "
                       "layer); for example 1e-05");
  validate_rope(c, c.rope, "rope_theta");
  if (c.local_rope) validate_rope(c, *c.local_rope, "the windowed layers' rope_theta");
  validate_family_traits(c);
}

}  // namespace upipe
