// Reading and writing config.json: the fields every family shares, the family's own (its
// row in model/family.hpp says which it reads), and the RoPE in the legacy and the newer
// (rope_parameters, per layer type) styles.
#include "model/config.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/files.hpp"

namespace upipe {
namespace {

using json = nlohmann::json;

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

const family_row& parse_family(const field_reader& fields, const std::string& path) {
  const std::string type = fields.required_string("model_type");
  if (const family_row* row = find_family(type)) return *row;
  std::string hint;
  if (type == "gemma3")
    hint = " (a multimodal Gemma 3 directory: train its text model, a Gemma3ForCausalLM directory of model_type "
           "gemma3_text)";
  throw config_error("model config '" + path + "': model_type '" + type +
                     "' is not supported: the supported model types are " + family_names() + hint);
}

// Features of the Hugging Face architectures that upipe's layers do not implement; refused
// rather than silently trained as something else.
void refuse_unsupported_features(const field_reader& fields, const std::string& path, const family_row& row) {
  auto refuse_true = [&](const char* key, const char* why) {
    if (const json* v = fields.find(key); v && fields.boolean(key, *v))
      throw config_error("model config '" + path + "': " + key + " = true is not supported (" +
                         why + "); use " + key + " = false");
  };
  if (!row.config_biases) {
    refuse_true("attention_bias", "this family's attention has no bias switch upipe reads");
    refuse_true("mlp_bias", "this family's MLP has no bias");
  }
  refuse_true("use_bidirectional_attention", "attention is causal");
  // Soft-capping (Gemma 2's tanh on the scores and the logits) is outside the model upipe
  // computes, for every family: a value would change the loss, so it is refused, never
  // ignored. Gemma 3's published checkpoints set both to null.
  for (const char* key : {"attn_logit_softcapping", "final_logit_softcapping"})
    if (const json* v = fields.find(key))
      throw config_error("model config '" + path + "': " + key + " = " + v->dump() +
                         ": upipe's attention and loss take no soft-capping, and a model trained with it would "
                         "compute another loss; use a model whose config sets " + key + " = null (Gemma 3's do)");
  if (const json* v = fields.find("partial_rotary_factor");
      v && row.mixers != mixer_rule::hybrid && fields.number("partial_rotary_factor", *v) != 1.0)
    throw config_error("model config '" + path + "': partial_rotary_factor = " + v->dump() +
                       " is not supported (RoPE rotates every dimension of a head); use 1.0");
}

gate_activation parse_activation_field(const field_reader& fields, const std::string& path, const family_row& row) {
  gate_activation activation = row.default_activation;
  // Gemma's configs carry hidden_activation (the one its modeling reads) and may carry a
  // stale hidden_act beside it.
  const char* key = row.activation_key;
  const json* value = fields.find(key);
  if (value == nullptr && std::string_view(key) != "hidden_act") return activation;
  if (value == nullptr) value = fields.find("hidden_act");
  if (value == nullptr) return activation;
  const std::string name = fields.string(key, *value);
  if (!parse_activation(name, activation))
    throw config_error("model config '" + path + "': " + key + " '" + name +
                       "' is not supported: the MLP is gated by silu (SwiGLU) or gelu_pytorch_tanh (GeGLU); use "
                       "\"" + activation_name(row.default_activation) + "\"");
  return activation;
}

// Where one RoPE's settings come from: the legacy keys (rope_theta, rope_scaling) and the
// rope_parameters object of newer transformers, or, for a model with one RoPE per layer type
// (Gemma 3), that type's entry of rope_parameters.
struct rope_sources {
  const json* theta = nullptr;    // a legacy theta (rope_theta, or rope_local_base_freq)
  const char* theta_name = "rope_theta";
  const json* scaling = nullptr;  // rope_scaling
  const json* parameters = nullptr;
  std::string parameters_name = "rope_parameters.";
  bool parameters_theta_first = false;  // a per-type entry's rope_theta wins over the legacy one
  double default_theta = 10000.0;       // transformers' default where nothing names it
};

// The theta and the scaling; the legacy keys take precedence, except a per-type entry's theta.
rope_config parse_rope(const field_reader& fields, const rope_sources& from, const std::string& path) {
  const json* scaling = from.scaling;
  const json* parameters = from.parameters;
  rope_config rope;
  rope.theta = from.default_theta;
  const json* nested_theta = nullptr;
  std::string nested_name;
  for (auto [object, name] : {std::pair{parameters, from.parameters_name}, std::pair{scaling, std::string("rope_scaling.")}}) {
    if (object == nullptr || nested_theta != nullptr) continue;
    if (const auto it = object->find("rope_theta"); it != object->end() && !it->is_null()) {
      nested_theta = &*it;
      nested_name = name;
    }
  }
  if (from.theta != nullptr && !(from.parameters_theta_first && nested_theta != nullptr))
    rope.theta = fields.number(from.theta_name, *from.theta);
  else if (nested_theta != nullptr)
    rope.theta = field_reader(json::object(), path, nested_name).number("rope_theta", *nested_theta);

  rope.scaling.kind = rope_kind::none;
  const json* source = scaling ? scaling : parameters;
  if (!source) return rope;
  std::string source_name = scaling ? "rope_scaling." : from.parameters_name;
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

// The layers' types and windows as transformers 5 writes them.
void window_json(const model_config& c, nlohmann::ordered_json& j) {
  const family_row& row = c.traits();
  if (row.windows == window_rule::none) return;
  j["sliding_window"] = c.sliding_window > 0 ? nlohmann::ordered_json(c.sliding_window) : nlohmann::ordered_json(nullptr);
  if (row.windows == window_rule::every_layer) return;
  if (row.windows == window_rule::qwen_layers) {
    j["use_sliding_window"] = c.sliding_window > 0;
    j["max_window_layers"] = c.num_layers;
  }
  nlohmann::ordered_json types = nlohmann::ordered_json::array();
  for (int l = 0; l < c.num_layers; ++l) types.push_back(c.layer_window(l) > 0 ? "sliding_attention" : "full_attention");
  j["layer_types"] = types;
}

nlohmann::ordered_json to_hf_json(const model_config& c) {
  const family_row& row = c.traits();
  nlohmann::ordered_json j;
  j["architectures"] = {std::string(row.architecture)};
  j["model_type"] = std::string(row.model_type);
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  if (!row.dense_width_optional) j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j[row.activation_key] = activation_name(c.activation);
  j["rms_norm_eps"] = c.rms_norm_eps;
  if (c.local_rope) {
    j["rope_parameters"] = {{"full_attention", rope_json(c.rope, true)}, {"sliding_attention", rope_json(*c.local_rope, true)}};
  } else {
    j["rope_theta"] = c.rope.theta;
    j["rope_scaling"] = c.rope.scaling.enabled() ? rope_json(c.rope, false) : nlohmann::ordered_json(nullptr);
  }
  j["max_position_embeddings"] = c.max_position_embeddings > 0 ? c.max_position_embeddings : default_max_position_embeddings(c);
  j["tie_word_embeddings"] = c.tie_embeddings;
  if (row.config_biases) {
    j["attention_bias"] = c.has_bias(layer_projection::o);
    j["mlp_bias"] = c.has_bias(layer_projection::down);
  }
  j["attention_dropout"] = 0.0;
  window_json(c, j);
  if (row.query_pre_attn_scalar) {
    j["query_pre_attn_scalar"] = c.query_pre_attn_scalar;
    j["final_logit_softcapping"] = nullptr;
    j["attn_logit_softcapping"] = nullptr;
  }
  write_moe_fields(c, j);
  write_hybrid_fields(c, j);
  j["pad_token_id"] = c.padding_id >= 0 ? nlohmann::ordered_json(c.padding_id) : nlohmann::ordered_json(nullptr);
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
  // A multimodal base: what upipe trained and writes is its text model, a config of its own.
  if (const auto type = j.find("model_type"); type != j.end() && type->is_string())
    if (const family_row* row = find_multimodal_family(type->get<std::string>()); row != nullptr) {
      nlohmann::ordered_json text = j["text_config"];
      text["architectures"] = {std::string(row->architecture)};
      text["model_type"] = std::string(row->model_type);
      text["tie_word_embeddings"] = c.tie_embeddings;
      j = std::move(text);
    }
  // A scaling whose original context the base left to max_position_embeddings would change
  // with it: then the RoPE object is written out in full.
  const bool context_changes = c.max_position_embeddings > 0 && c.max_position_embeddings != base.max_position_embeddings;
  const bool uses_original = c.rope.scaling.kind == rope_kind::llama3 || c.rope.scaling.kind == rope_kind::yarn;
  if (!same_rope(base.rope, c.rope) || (context_changes && uses_original)) {
    if (j.contains("rope_parameters") && j["rope_parameters"].is_object() && j["rope_parameters"].contains("full_attention")) {
      j["rope_parameters"]["full_attention"] = rope_json(c.rope, true);  // the windowed layers' RoPE is unchanged
      j.erase("rope_scaling");
      j.erase("rope_theta");
    } else if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
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

namespace {

// A window that the family's rule applies to a layer must be a positive number of tokens:
// 0 or less would read as "no window" (every layer full attention) where the config asks
// for sliding layers. null is transformers' "no window".
void check_window_size(const model_config& c, const std::string& path, bool given, bool applies) {
  if (!given || !applies || c.sliding_window > 0) return;
  throw config_error("model config '" + path + "': sliding_window = " + std::to_string(c.sliding_window) +
                     " must be a positive number of tokens (the window of the sliding_attention layers); give e.g. "
                     "4096, or null for full attention on every layer");
}

// The family's rule for which layers attend through the window (family_row::windows): the
// layer_types list where config.json gives one (one entry per layer, as transformers'
// validate_layer_type requires), else Qwen's use_sliding_window with max_window_layers or
// Gemma's sliding_window_pattern.
void read_windows(model_config& c, const field_reader& fields, const std::string& path, const family_row& row) {
  if (row.windows == window_rule::none) return;
  const json* window = fields.find("sliding_window");
  bool given = window != nullptr;
  if (given) c.sliding_window = fields.integer("sliding_window", *window);
  if (row.windows == window_rule::every_layer) {
    check_window_size(c, path, given, c.num_layers > 0);
    if (c.sliding_window > 0) c.windowed_layers.assign(static_cast<std::size_t>(std::max(c.num_layers, 0)), true);
    return;
  }
  const bool qwen = row.windows == window_rule::qwen_layers;
  if (qwen) {
    bool use = false;
    if (const json* v = fields.find("use_sliding_window")) use = fields.boolean("use_sliding_window", *v);
    if (!use) {  // Qwen2Config drops the window unless use_sliding_window
      c.sliding_window = 0;
      given = false;
    }
  }
  if (const json* types = fields.find("layer_types")) {
    if (!types->is_array()) throw io_error("model config '" + path + "': field \"layer_types\" must be a list");
    if (static_cast<std::int64_t>(types->size()) != c.num_layers)
      throw config_error("model config '" + path + "': layer_types lists " + std::to_string(types->size()) +
                         " layers but num_hidden_layers is " + std::to_string(c.num_layers) +
                         ": give one type per layer (full_attention or sliding_attention), or leave layer_types out");
    for (const json& t : *types) {
      const std::string name = t.is_string() ? t.get<std::string>() : t.dump();
      if (name != "full_attention" && name != "sliding_attention")
        throw config_error("model config '" + path + "': layer_types holds '" + name +
                           "': upipe runs full_attention and sliding_attention layers");
      c.windowed_layers.push_back(name == "sliding_attention");
    }
  } else if (qwen) {
    int from = 28;  // Qwen2Config's max_window_layers
    if (const json* m = fields.find("max_window_layers")) from = fields.int32("max_window_layers", *m);
    for (int l = 0; l < c.num_layers; ++l) c.windowed_layers.push_back(given && l >= from);
  } else {
    int pattern = 6;  // Gemma3TextConfig's sliding_window_pattern
    if (const json* m = fields.find("sliding_window_pattern")) pattern = fields.int32("sliding_window_pattern", *m);
    if (pattern <= 0)
      throw config_error("model config '" + path + "': sliding_window_pattern = " + std::to_string(pattern) +
                         " must be positive (every pattern-th layer is global); for example 6");
    for (int l = 0; l < c.num_layers; ++l) c.windowed_layers.push_back((l + 1) % pattern != 0);
  }
  const bool windowed = std::find(c.windowed_layers.begin(), c.windowed_layers.end(), true) != c.windowed_layers.end();
  check_window_size(c, path, given, windowed);
  if (c.sliding_window <= 0) c.windowed_layers.clear();
}

// The RoPE of the global layers and, where the family has a second one (Gemma 3's local
// base), of the windowed layers: from rope_parameters' per-type entries, or the legacy
// rope_theta, rope_scaling (the global layers') and rope_local_base_freq.
void read_ropes(model_config& c, const field_reader& fields, const std::string& path, const family_row& row) {
  const json* parameters = fields.object("rope_parameters");
  const bool per_type = parameters != nullptr && (parameters->contains("full_attention") ||
                                                  parameters->contains("sliding_attention"));
  const auto entry = [&](const char* type) -> const json* {
    if (!per_type) return nullptr;
    const auto it = parameters->find(type);
    if (it == parameters->end() || it->is_null()) return nullptr;
    if (!it->is_object()) throw io_error("model config '" + path + "': rope_parameters." + type + " must be an object");
    return &*it;
  };
  rope_sources global{.theta = fields.find("rope_theta"), .scaling = fields.object("rope_scaling"),
                      .parameters = per_type ? entry("full_attention") : parameters,
                      .parameters_name = per_type ? "rope_parameters.full_attention." : "rope_parameters.",
                      .parameters_theta_first = per_type, .default_theta = row.default_theta};
  c.rope = parse_rope(fields, global, path);
  if (row.default_local_theta <= 0) return;
  rope_sources local{.theta = fields.find("rope_local_base_freq"), .theta_name = "rope_local_base_freq",
                     .parameters = entry("sliding_attention"),
                     .parameters_name = "rope_parameters.sliding_attention.", .parameters_theta_first = true,
                     .default_theta = row.default_local_theta};
  c.local_rope = parse_rope(fields, local, path);
}

// The Hub's multimodal checkpoints of a hybrid family (model_type qwen3_5 or qwen3_5_moe with a
// text_config): upipe trains their text model, and says once that the vision tower stays out.
const json* multimodal_text_config(const json& root, const std::string& path) {
  const auto type = root.find("model_type");
  if (type == root.end() || !type->is_string()) return nullptr;
  const family_row* row = find_multimodal_family(type->get<std::string>());
  if (row == nullptr) return nullptr;
  const auto text = root.find("text_config");
  if (text == root.end() || !text->is_object())
    throw io_error("model config '" + path + "': model_type '" + type->get<std::string>() +
                   "' holds its text model in a \"text_config\" object, which this file lacks: pass the checkpoint's "
                   "config.json as the Hub serves it, or a " + std::string(row->architecture) + " directory (model_type " +
                   std::string(row->model_type) + ")");
  static std::atomic<bool> noted{false};
  if (!noted.exchange(true))
    std::fprintf(stderr,
                 "note: %s is a multimodal %s checkpoint: upipe trains its text model (text_config, the weights "
                 "under model.language_model.*) and leaves the vision tower (model.visual.*) and the MTP head out; "
                 "a checkpoint it saves is the text model (%s)\n",
                 path.c_str(), type->get<std::string>().c_str(), std::string(row->architecture).c_str());
  return &*text;
}

// As transformers reads them: without an original context the model's own is taken, and
// a yarn factor given as null is the stretch from the original context to the model's.
void complete_scaling(rope_config& rope, std::int64_t context) {
  rope_scaling& scaling = rope.scaling;
  if ((scaling.kind == rope_kind::llama3 || scaling.kind == rope_kind::yarn) && scaling.original_max_position == 0)
    scaling.original_max_position = context;
  if (scaling.kind == rope_kind::yarn && scaling.factor == 0 && scaling.original_max_position > 0)
    scaling.factor = static_cast<double>(context) / static_cast<double>(scaling.original_max_position);
}

// What the family's row makes config.json say beyond the shapes: biases, the activation,
// the windows and RoPEs, the attention's scale and the padding token.
void read_family_fields(model_config& c, const field_reader& fields, const std::string& path, const family_row& row) {
  c.qk_norm = row.qk_norm;
  c.biases = row.biases;
  if (row.config_biases) {
    const auto flag = [&](const char* key) {
      const json* v = fields.find(key);
      return v != nullptr && fields.boolean(key, *v);
    };
    if (flag("attention_bias")) c.biases |= qkv_projections | projection_bit(layer_projection::o);
    if (flag("mlp_bias"))
      c.biases |= projection_bit(layer_projection::gate) | projection_bit(layer_projection::up) |
                  projection_bit(layer_projection::down);
  }
  c.activation = parse_activation_field(fields, path, row);
  read_windows(c, fields, path, row);
  read_ropes(c, fields, path, row);
  if (row.query_pre_attn_scalar) {
    c.query_pre_attn_scalar = 256;  // Gemma3TextConfig's default
    if (const json* q = fields.find("query_pre_attn_scalar")) c.query_pre_attn_scalar = fields.number("query_pre_attn_scalar", *q);
    if (!(c.query_pre_attn_scalar > 0))
      throw config_error("model config '" + path + "': query_pre_attn_scalar = " + fields.find("query_pre_attn_scalar")->dump() +
                         " must be positive (the scores are scaled by its inverse square root); for example 256");
  }
  if (const json* pad = fields.find("pad_token_id")) {
    const std::int64_t id = fields.integer("pad_token_id", *pad);
    // An id past the vocabulary names no embedding row (a tokenizer-only pad): none to freeze.
    if (id >= 0 && id < c.vocab_size) c.padding_id = static_cast<std::int32_t>(id);
  }
}

}  // namespace

model_config read_hf_config(const std::string& given) {
  const std::string path = hf_config_file(given);
  const json file = parse_json_file(path);
  const json* text = multimodal_text_config(file, path);
  const json& root = text != nullptr ? *text : file;
  const field_reader fields(root, path, text != nullptr ? "text_config." : "");

  model_config c;
  c.name = path;
  const family_row& row = parse_family(fields, path);
  c.family = row.family;
  refuse_unsupported_features(fields, path, row);
  c.vocab_size = fields.integer("vocab_size", fields.required("vocab_size"));
  c.hidden_size = fields.required_int("hidden_size");
  // A family whose every layer is sparse has no dense width (Qwen3_5MoeTextConfig): its
  // experts' width stands in (read_moe_fields).
  c.intermediate_size = row.dense_width_optional && fields.find("intermediate_size") == nullptr
                            ? 0
                            : fields.required_int("intermediate_size");
  c.num_layers = fields.required_int("num_hidden_layers");
  c.num_heads = fields.required_int("num_attention_heads");
  c.rms_norm_eps = fields.required_number("rms_norm_eps");

  // Absent fields take the defaults of the family's transformers config class so that the
  // file means the same model here and there (Qwen3Config declares head_dim = 128 and
  // num_key_value_heads = 32, LlamaConfig derives D / H and H); an explicit null derives
  // (D / H, H) in every family.
  if (const json* k = fields.find("num_key_value_heads"))
    c.num_kv_heads = fields.int32("num_key_value_heads", *k);
  else
    c.num_kv_heads = row.default_kv_heads > 0 && !root.contains("num_key_value_heads") ? row.default_kv_heads : c.num_heads;
  if (const json* d = fields.find("head_dim"))
    c.head_dim = fields.int32("head_dim", *d);
  else if (row.default_head_dim > 0 && !root.contains("head_dim"))
    c.head_dim = row.default_head_dim;
  else
    c.head_dim = c.num_heads > 0 ? c.hidden_size / c.num_heads : 0;

  if (const json* m = fields.find("max_position_embeddings"))
    c.max_position_embeddings = fields.integer("max_position_embeddings", *m);
  read_family_fields(c, fields, path, row);
  read_moe_fields(c, root, path);
  if (c.intermediate_size == 0) c.intermediate_size = c.moe.expert_width;
  read_hybrid_fields(c, root, path);
  complete_scaling(c.rope, c.max_position_embeddings);
  if (c.local_rope) complete_scaling(*c.local_rope, c.max_position_embeddings);
  // A multimodal checkpoint's dtype and tied embedding are its top level's (transformers ties
  // by the composite config's tie_word_embeddings, false unless it says so).
  const field_reader top(file, path);
  for (const field_reader* source : {&fields, &top})
    for (const char* key : {"dtype", "torch_dtype"})
      if (const json* d = source->find(key); d && d->is_string() && c.stored_dtype.empty())
        c.stored_dtype = d->get<std::string>();
  c.tie_embeddings = row.default_tied;
  if (const json* tie = (text != nullptr ? top : fields).find("tie_word_embeddings"))
    c.tie_embeddings = (text != nullptr ? top : fields).boolean("tie_word_embeddings", *tie);
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

}  // namespace upipe
