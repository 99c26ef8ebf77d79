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

// The published Hugging Face configs (meta-llama/Llama-3.1-*, meta-llama/Llama-3.2-*,
// Qwen/Qwen3-*) and two small models for tests.
std::vector<model_config> all_presets() {
  using enum model_family;
  return {
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

void validate_rope(const model_config& c) {
  require_positive_real(c, c.rope.theta, "rope_theta", "500000");
  // theta^(-2i/d) must fall from 1 and stay a normal double over every head dimension.
  if (!(c.rope.theta > 1 && c.rope.theta <= 1e12))
    throw config_error("model '" + c.name + "': rope_theta = " + format_number(c.rope.theta) +
                       " must lie in (1, 1e12] (RoPE's wavelengths grow from 2 pi to 2 pi theta); for example 500000");
  const rope_scaling& s = c.rope.scaling;
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

// ---------------------------------------------------------------------------------------
// Reading config.json
// ---------------------------------------------------------------------------------------

// Typed access to the fields of one JSON object; a missing required field or a value of the
// wrong type is a format problem of the file (io_error naming the file and the field).
class field_reader {
 public:
  field_reader(const json& object, const std::string& path, std::string prefix = "")
      : object_(object), path_(path), prefix_(std::move(prefix)) {}

  // The field, or nullptr when it is absent or null.
  const json* find(const char* key) const {
    auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  const json& required(const char* key) const {
    const json* value = find(key);
    if (!value)
      throw io_error("model config '" + path_ + "': missing required field \"" + prefix_ + key +
                     "\"");
    return *value;
  }

  std::int64_t integer(const char* key, const json& value) const {
    if (value.is_number_integer()) {
      if (value.is_number_unsigned() &&
          value.get<std::uint64_t>() > std::uint64_t(std::numeric_limits<std::int64_t>::max()))
        throw config_error("model config '" + path_ + "': field \"" + prefix_ + key +
                           "\" = " + value.dump() + " is out of range");
      return value.get<std::int64_t>();
    }
    // Some exporters write integral sizes as floats (4096.0).
    if (value.is_number_float()) {
      double d = value.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::abs(d) < 9.0e15)
        return static_cast<std::int64_t>(d);
    }
    throw type_error(key, "an integer", value);
  }

  int int32(const char* key, const json& value) const {
    std::int64_t v = integer(key, value);
    if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max())
      throw config_error("model config '" + path_ + "': field \"" + prefix_ + key + "\" = " +
                         std::to_string(v) + " is out of range (at most " +
                         std::to_string(std::numeric_limits<int>::max()) + ")");
    return static_cast<int>(v);
  }

  double number(const char* key, const json& value) const {
    if (!value.is_number()) throw type_error(key, "a number", value);
    return value.get<double>();
  }

  std::string string(const char* key, const json& value) const {
    if (!value.is_string()) throw type_error(key, "a string", value);
    return value.get<std::string>();
  }

  bool boolean(const char* key, const json& value) const {
    if (!value.is_boolean()) throw type_error(key, "true or false", value);
    return value.get<bool>();
  }

  // An object field, or nullptr when absent or null.
  const json* object(const char* key) const {
    const json* value = find(key);
    if (value && !value->is_object()) throw type_error(key, "an object or null", *value);
    return value;
  }

  int required_int(const char* key) const { return int32(key, required(key)); }
  double required_number(const char* key) const { return number(key, required(key)); }
  std::string required_string(const char* key) const { return string(key, required(key)); }

 private:
  io_error type_error(const char* key, const char* expected, const json& value) const {
    return io_error("model config '" + path_ + "': field \"" + prefix_ + key + "\" must be " +
                    expected + ", found " + value.type_name() + " " + value.dump());
  }

  const json& object_;
  const std::string& path_;
  std::string prefix_;
};

json parse_json_file(const std::string& path) {
  std::string text;
  try {
    text = read_text_file(path, "model config");
  } catch (const io_error& e) {
    throw io_error(std::string(e.what()) + " (pass a model directory holding config.json, or the config.json itself)");
  }
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    throw io_error("model config '" + path + "' is not valid JSON: " + e.what());
  }
  if (!root.is_object())
    throw io_error("model config '" + path + "' must hold a JSON object, found " +
                   std::string(root.type_name()));
  return root;
}

model_family parse_family(const field_reader& fields, const std::string& path) {
  std::string type = fields.required_string("model_type");
  if (type == "llama") return model_family::llama;
  if (type == "qwen3") return model_family::qwen3;
  throw config_error("model config '" + path + "': model_type '" + type +
                     "' is not supported: the supported model types are llama and qwen3 "
                     "(Llama 3 / 3.1 / 3.2 and Qwen3 dense models)");
}

// Features of the Hugging Face architectures that upipe's layers do not implement; refused
// rather than silently trained as something else.
void refuse_unsupported_features(const field_reader& fields, const std::string& path) {
  auto refuse_true = [&](const char* key, const char* why) {
    if (const json* v = fields.find(key); v && fields.boolean(key, *v))
      throw config_error("model config '" + path + "': " + key + " = true is not supported (" +
                         why + "); use " + key + " = false");
  };
  refuse_true("attention_bias", "the projections have no bias");
  refuse_true("mlp_bias", "the MLP has no bias");
  refuse_true("use_sliding_window", "attention is always full and causal");
  if (const json* act = fields.find("hidden_act")) {
    std::string name = fields.string("hidden_act", *act);
    if (name != "silu")
      throw config_error("model config '" + path + "': hidden_act '" + name +
                         "' is not supported: the MLP is SwiGLU, use hidden_act \"silu\"");
  }
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

namespace {

// Reads rope_theta and the scaling from the legacy keys (rope_theta, rope_scaling) or from
// the rope_parameters object of newer transformers, the legacy keys taking precedence.
rope_config parse_rope(const field_reader& fields, const std::string& path) {
  const json* scaling = fields.object("rope_scaling");
  const json* parameters = fields.object("rope_parameters");

  rope_config rope;
  rope.theta = 10000.0;  // the transformers default when no config names it
  if (const json* theta = fields.find("rope_theta")) {
    rope.theta = fields.number("rope_theta", *theta);
  } else {
    for (auto [object, name] : {std::pair{parameters, "rope_parameters."},
                                std::pair{scaling, "rope_scaling."}}) {
      if (!object) continue;
      field_reader nested(*object, path, name);
      if (const json* theta = nested.find("rope_theta")) {
        rope.theta = nested.number("rope_theta", *theta);
        break;
      }
    }
  }

  rope.scaling.kind = rope_kind::none;
  const json* source = scaling ? scaling : parameters;
  if (!source) return rope;
  std::string source_name = scaling ? "rope_scaling." : "rope_parameters.";
  field_reader nested(*source, path, source_name);
  std::string type = "default";
  if (const json* t = nested.find("rope_type")) {
    type = nested.string("rope_type", *t);
  } else if (const json* t = nested.find("type")) {
    type = nested.string("type", *t);
  } else if (source->contains("rope_type") || source->contains("type")) {
    // null is no scaling's name: read as "default" it would drop the scaling the other keys describe
    throw config_error("model config '" + path + "': " + source_name + (source->contains("rope_type") ? "rope_type" : "type") +
                       " is null: name the scaling as transformers does (default, linear, llama3 or yarn), for "
                       "example \"rope_type\": \"yarn\"");
  } else if (scaling) {
    nested.required("rope_type");  // a scaling object must say which scaling it is
  }
  rope.scaling.kind = parse_rope_kind(type, "model config '" + path + "': rope_type");
  rope_scaling& s = rope.scaling;
  if (s.kind == rope_kind::none) return rope;
  // 0 where absent: yarn derives the factor, and both take the model's context, as
  // transformers does (read_hf_config fills them in).
  s.factor = 0;
  if (s.kind == rope_kind::yarn) {
    if (const json* f = nested.find("factor")) s.factor = nested.number("factor", *f);
  } else {
    s.factor = nested.required_number("factor");
  }
  if (s.kind == rope_kind::linear) return rope;
  s.original_max_position = 0;
  if (const json* top = fields.find("original_max_position_embeddings"))  // Phi-3's place wins
    s.original_max_position = fields.integer("original_max_position_embeddings", *top);
  else if (const json* v = nested.find("original_max_position_embeddings"))
    s.original_max_position = nested.integer("original_max_position_embeddings", *v);
  if (s.kind == rope_kind::llama3) {
    s.low_freq_factor = nested.required_number("low_freq_factor");
    s.high_freq_factor = nested.required_number("high_freq_factor");
  } else if (s.kind == rope_kind::yarn) {
    const auto optional_number = [&](const char* key, double& target) {
      if (const json* v = nested.find(key)) target = nested.number(key, *v);
    };
    optional_number("beta_fast", s.beta_fast);
    optional_number("beta_slow", s.beta_slow);
    optional_number("mscale", s.mscale);
    optional_number("mscale_all_dim", s.mscale_all_dim);
    optional_number("attention_factor", s.attention_factor);
    if (const json* v = nested.find("truncate")) s.truncate = nested.boolean("truncate", *v);
  }
  return rope;
}

// ---------------------------------------------------------------------------------------
// Writing config.json
// ---------------------------------------------------------------------------------------

// The context the published checkpoints declare when a preset says nothing: Llama 3.1 /
// 3.2 (scaled) 131072, Llama 3 (unscaled) 8192, Qwen3 40960; never below the scaling's
// original context.
std::int64_t default_max_position_embeddings(const model_config& c) {
  std::int64_t context = 0;
  if (c.family == model_family::qwen3)
    context = 40960;
  else
    context = c.rope.scaling.enabled() ? 131072 : 8192;
  if (c.rope.scaling.enabled()) context = std::max(context, c.rope.scaling.original_max_position);
  return context;
}

// The scaling object as transformers reads it (rope_scaling or rope_parameters).
nlohmann::ordered_json rope_json(const rope_config& rope, bool with_theta) {
  const rope_scaling& s = rope.scaling;
  nlohmann::ordered_json j;
  j["rope_type"] = rope_kind_name(s.kind);
  if (with_theta) j["rope_theta"] = rope.theta;
  if (s.kind == rope_kind::none) return j;
  j["factor"] = s.factor;
  if (s.kind == rope_kind::llama3) {
    j["low_freq_factor"] = s.low_freq_factor;
    j["high_freq_factor"] = s.high_freq_factor;
  }
  if (s.kind != rope_kind::linear) j["original_max_position_embeddings"] = s.original_max_position;
  if (s.kind == rope_kind::yarn) {
    j["beta_fast"] = s.beta_fast;
    j["beta_slow"] = s.beta_slow;
    if (s.mscale > 0) j["mscale"] = s.mscale;
    if (s.mscale_all_dim > 0) j["mscale_all_dim"] = s.mscale_all_dim;
    if (s.attention_factor > 0) j["attention_factor"] = s.attention_factor;
    if (!s.truncate) j["truncate"] = false;
  }
  return j;
}

nlohmann::ordered_json to_hf_json(const model_config& c) {
  const bool qwen = c.family == model_family::qwen3;
  nlohmann::ordered_json j;
  j["architectures"] = {qwen ? "Qwen3ForCausalLM" : "LlamaForCausalLM"};
  j["model_type"] = qwen ? "qwen3" : "llama";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope.theta;
  if (c.rope.scaling.enabled())
    j["rope_scaling"] = rope_json(c.rope, false);
  else
    j["rope_scaling"] = nullptr;
  j["max_position_embeddings"] = c.max_position_embeddings > 0 ? c.max_position_embeddings : default_max_position_embeddings(c);
  j["tie_word_embeddings"] = c.tie_embeddings;
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  if (qwen) {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = c.num_layers;
  } else {
    j["mlp_bias"] = false;
    j["pretraining_tp"] = 1;
  }
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  j["torch_dtype"] = "float32";
  return j;
}

bool same_rope(const rope_config& a, const rope_config& b) {
  const rope_scaling &x = a.scaling, &y = b.scaling;
  if (a.theta != b.theta || x.kind != y.kind) return false;
  if (x.kind == rope_kind::none) return true;
  return x.factor == y.factor && x.low_freq_factor == y.low_freq_factor && x.high_freq_factor == y.high_freq_factor &&
         x.original_max_position == y.original_max_position && x.beta_fast == y.beta_fast &&
         x.beta_slow == y.beta_slow && x.mscale == y.mscale && x.mscale_all_dim == y.mscale_all_dim &&
         x.attention_factor == y.attention_factor && x.truncate == y.truncate;
}

// The input's config.json with what training changed: the RoPE settings (in the style the
// input used: rope_parameters, or rope_theta and rope_scaling), max_position_embeddings and
// the stored dtype. Every other field is kept as it was.
nlohmann::ordered_json updated_hf_json(const model_config& c, const std::string& base_path, const std::string& dtype) {
  const std::string text = read_text_file(base_path, "model config");
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::ordered_json::exception& e) {
    throw io_error("model config '" + base_path + "' is not valid JSON: " + e.what());
  }
  const model_config base = read_hf_config(base_path);
  // A scaling whose original context the base left to max_position_embeddings would change
  // with it: then the RoPE object is written out in full.
  const bool context_changes = c.max_position_embeddings > 0 && c.max_position_embeddings != base.max_position_embeddings;
  const bool uses_original = c.rope.scaling.kind == rope_kind::llama3 || c.rope.scaling.kind == rope_kind::yarn;
  if (!same_rope(base.rope, c.rope) || (context_changes && uses_original)) {
    if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
      j["rope_parameters"] = rope_json(c.rope, true);
      j.erase("rope_scaling");
      j.erase("rope_theta");
    } else {
      j["rope_theta"] = c.rope.theta;
      j["rope_scaling"] = c.rope.scaling.enabled() ? rope_json(c.rope, false) : nlohmann::ordered_json(nullptr);
    }
  }
  if (c.max_position_embeddings > 0) j["max_position_embeddings"] = c.max_position_embeddings;
  if (j.contains("dtype") || !j.contains("torch_dtype"))
    j["dtype"] = dtype;
  else
    j["torch_dtype"] = dtype;
  return j;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Public entries
// ---------------------------------------------------------------------------------------

std::int64_t model_config::parameter_count() const {
  const std::int64_t D = hidden_size, F = intermediate_size, V = vocab_size;
  const std::int64_t q = std::int64_t(num_heads) * head_dim;
  const std::int64_t kv = std::int64_t(num_kv_heads) * head_dim;
  const std::int64_t per_layer = D                          // input_layernorm
                                 + q * D + 2 * kv * D       // q, k, v projections
                                 + D * q                    // o projection
                                 + (qk_norm ? 2 * head_dim : 0)  // q_norm, k_norm
                                 + D                        // post_attention_layernorm
                                 + 3 * F * D;               // gate, up, down
  return V * D + num_layers * per_layer + D + (tie_embeddings ? 0 : V * D);
}

std::int64_t model_config::matmul_parameter_count() const {
  const std::int64_t D = hidden_size, F = intermediate_size, V = vocab_size;
  const std::int64_t q = std::int64_t(num_heads) * head_dim;
  const std::int64_t kv = std::int64_t(num_kv_heads) * head_dim;
  return num_layers * (2 * q * D + 2 * kv * D + 3 * F * D) + V * D;
}

double model_config::model_flops(std::int64_t seq_len) const {
  const auto s = static_cast<double>(seq_len);
  return 6.0 * static_cast<double>(matmul_parameter_count()) * s +
         6.0 * num_layers * num_heads * static_cast<double>(head_dim) * s * s;
}

double model_config::model_flops(std::int64_t seq_len, std::span<const std::int64_t> documents) const {
  if (documents.size() <= 1) return model_flops(seq_len);
  double pairs = 0;  // sum of squared document lengths
  for (std::size_t i = 0; i < documents.size(); ++i) {
    const auto length = static_cast<double>((i + 1 < documents.size() ? documents[i + 1] : seq_len) - documents[i]);
    pairs += length * length;
  }
  return 6.0 * static_cast<double>(matmul_parameter_count()) * static_cast<double>(seq_len) +
         6.0 * num_layers * num_heads * static_cast<double>(head_dim) * pairs;
}

std::vector<parameter_spec> parameter_specs(const model_config& config) {
  const std::int64_t D = config.hidden_size, F = config.intermediate_size, V = config.vocab_size;
  const std::int64_t d = config.head_dim;
  const std::int64_t q = config.num_heads * d;
  const std::int64_t kv = config.num_kv_heads * d;

  std::vector<parameter_spec> specs;
  specs.reserve(3 + std::size_t(std::max(config.num_layers, 0)) * 11);
  specs.push_back({"model.embed_tokens.weight", {V, D}});
  for (int i = 0; i < config.num_layers; ++i) {
    const std::string layer = "model.layers." + std::to_string(i) + ".";
    specs.push_back({layer + "input_layernorm.weight", {D}});
    specs.push_back({layer + "self_attn.q_proj.weight", {q, D}});
    specs.push_back({layer + "self_attn.k_proj.weight", {kv, D}});
    specs.push_back({layer + "self_attn.v_proj.weight", {kv, D}});
    specs.push_back({layer + "self_attn.o_proj.weight", {D, q}});
    if (config.qk_norm) {
      specs.push_back({layer + "self_attn.q_norm.weight", {d}});
      specs.push_back({layer + "self_attn.k_norm.weight", {d}});
    }
    specs.push_back({layer + "post_attention_layernorm.weight", {D}});
    specs.push_back({layer + "mlp.gate_proj.weight", {F, D}});
    specs.push_back({layer + "mlp.up_proj.weight", {F, D}});
    specs.push_back({layer + "mlp.down_proj.weight", {D, F}});
  }
  specs.push_back({"model.norm.weight", {D}});
  if (!config.tie_embeddings) specs.push_back({"lm_head.weight", {V, D}});
  return specs;
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const model_config& c : all_presets()) names.push_back(c.name);
  return names;
}

model_config preset(std::string_view name) {
  for (model_config& c : all_presets())
    if (c.name == name) {
      c.max_position_embeddings = default_max_position_embeddings(c);
      return std::move(c);
    }
  throw config_error("unknown model preset '" + std::string(name) + "': the known presets are " +
                     join(preset_names()) +
                     "; for another model pass --config with a Hugging Face config.json");
}

std::string hf_config_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return (std::filesystem::path(path) / "config.json").string();
  return path;
}

bool is_model_directory(const std::string& path) {
  std::error_code ec;
  // Present in any form: a FIFO or a link loop in its place is then refused by name when read.
  return std::filesystem::is_directory(path, ec) &&
         std::filesystem::exists(std::filesystem::symlink_status(std::filesystem::path(path) / "config.json", ec));
}

model_config read_hf_config(const std::string& given) {
  const std::string path = hf_config_file(given);
  const json root = parse_json_file(path);
  const field_reader fields(root, path);

  model_config c;
  c.name = path;
  c.family = parse_family(fields, path);
  refuse_unsupported_features(fields, path);
  c.vocab_size = fields.integer("vocab_size", fields.required("vocab_size"));
  c.hidden_size = fields.required_int("hidden_size");
  c.intermediate_size = fields.required_int("intermediate_size");
  c.num_layers = fields.required_int("num_hidden_layers");
  c.num_heads = fields.required_int("num_attention_heads");
  c.rms_norm_eps = fields.required_number("rms_norm_eps");

  // Absent fields take the defaults of transformers' LlamaConfig / Qwen3Config so that the
  // file means the same model here and there: Qwen3Config declares head_dim = 128 and
  // num_key_value_heads = 32, LlamaConfig derives D / H and H. An explicit null derives
  // (D / H, H) in both.
  const bool qwen = c.family == model_family::qwen3;
  if (const json* k = fields.find("num_key_value_heads"))
    c.num_kv_heads = fields.int32("num_key_value_heads", *k);
  else
    c.num_kv_heads = qwen && !root.contains("num_key_value_heads") ? 32 : c.num_heads;
  if (const json* d = fields.find("head_dim"))
    c.head_dim = fields.int32("head_dim", *d);
  else if (qwen && !root.contains("head_dim"))
    c.head_dim = 128;
  else
    c.head_dim = c.num_heads > 0 ? c.hidden_size / c.num_heads : 0;

  c.rope = parse_rope(fields, path);
  if (const json* m = fields.find("max_position_embeddings"))
    c.max_position_embeddings = fields.integer("max_position_embeddings", *m);
  // As transformers reads them: without an original context the model's own is taken, and
  // a yarn factor given as null is the stretch from the original context to the model's.
  rope_scaling& scaling = c.rope.scaling;
  if ((scaling.kind == rope_kind::llama3 || scaling.kind == rope_kind::yarn) && scaling.original_max_position == 0)
    scaling.original_max_position = c.max_position_embeddings;
  if (scaling.kind == rope_kind::yarn && scaling.factor == 0 && scaling.original_max_position > 0)
    scaling.factor =
        static_cast<double>(c.max_position_embeddings) / static_cast<double>(scaling.original_max_position);
  for (const char* key : {"dtype", "torch_dtype"})
    if (const json* d = fields.find(key); d && d->is_string()) c.stored_dtype = d->get<std::string>();
  if (const json* tie = fields.find("tie_word_embeddings"))
    c.tie_embeddings = fields.boolean("tie_word_embeddings", *tie);
  c.qk_norm = qwen;
  validate(c);
  return c;
}

void write_hf_config(const model_config& config, const std::string& path, const std::string& base_path,
                     const std::string& dtype) {
  validate(config);
  nlohmann::ordered_json j;
  if (base_path.empty()) {
    j = to_hf_json(config);
    j["torch_dtype"] = dtype;
  } else {
    j = updated_hf_json(config, hf_config_file(base_path), dtype);
  }
  write_file_atomically(path, j.dump(2) + "\n", "model config");
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
  validate_rope(c);
  const bool qwen = c.family == model_family::qwen3;
  if (c.qk_norm != qwen)
    throw config_error("model '" + c.name + "': qk_norm = " + (c.qk_norm ? "true" : "false") +
                       " does not match the " + (qwen ? "qwen3" : "llama") +
                       " family (Qwen3 normalizes q and k per head, Llama does not); set qk_norm = " +
                       (qwen ? "true" : "false"));
}

}  // namespace upipe
