// The model a command runs: a preset or a Hugging Face model directory (--model), or a
// config.json (--config), optionally cut to a slice of its first N layers (--layers, at
// full width and length), and for training its RoPE changed for a longer context.
#pragma once

#include <cmath>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "apps/run_config.hpp"
#include "core/error.hpp"
#include "core/key_values.hpp"
#include "model/adapter_files.hpp"
#include "core/limits.hpp"
#include "model/config.hpp"
#include "model/hf_model.hpp"
#include "train/run_directory.hpp"

namespace upipe::apps {

// The model's first `layers` layers; 0 keeps every layer, else it must lie in [1, all].
inline model_config slice_layers(model_config m, int layers) {
  if (layers < 0 || layers > m.num_layers)
    throw config_error("--layers " + std::to_string(layers) + " must lie between 1 and the model's " +
                       std::to_string(m.num_layers) + " layers (a slice of the first N layers)");
  if (layers == 0) return m;
  m.num_layers = layers;
  // The per-layer lists describe the first N layers too (a sparse layer's, a window's, a
  // hybrid's linear layers).
  const auto n = static_cast<std::size_t>(layers);
  for (std::vector<bool>* list : {&m.windowed_layers, &m.moe.sparse_layers, &m.linear.layers})
    if (list->size() > n) list->resize(n);
  return m;
}

// A preset name, or a path: a model directory (holding config.json) or a config.json.
inline bool looks_like_path(const std::string& s) {
  std::error_code ec;
  return s.find('/') != std::string::npos || std::filesystem::exists(s, ec);
}

// --model NAME|DIR or --config FILE|DIR; a path that is no model directory is an error
// naming what it lacks.
inline model_config load_model(const std::string& given, const std::string& config_path, int layers = 0) {
  if (!config_path.empty()) {
    model_config m = slice_layers(read_hf_config(config_path), layers);
    std::error_code ec;
    const std::filesystem::path dir = std::filesystem::is_directory(config_path, ec)
                                          ? std::filesystem::path(config_path)
                                          : std::filesystem::path(config_path).parent_path();
    check_companion_files(dir.empty() ? "." : dir.string());  // a save copies them
    return m;
  }
  const std::string model = resolve_checkpoint(given);  // a run directory means its latest checkpoint
  if (looks_like_path(model)) {
    std::error_code ec;
    if (std::filesystem::is_directory(model, ec) && is_adapter_directory(model))
      throw config_error("--model " + model + " is a LoRA adapter directory, not a model: pass its base as --model "
                         "(with --adapter or --init-adapter " + model + " where the command takes one), or merge it "
                         "first: upipe export BASE OUT --merge-adapter " + model);
    if (std::filesystem::is_directory(model, ec) && !is_model_directory(model))
      throw io_error("--model " + model + " is a directory without a config.json: pass a directory written by "
                     "save_pretrained (or upipe train --save), or a preset (upipe model-config --list)");
    if (std::filesystem::is_directory(model, ec)) check_companion_files(model);
    return slice_layers(read_hf_config(model), layers);
  }
  return slice_layers(preset(model), layers);
}

// The directory a model came from (its config.json is the base of a saved one, its
// tokenizer files are copied), or empty for a preset.
inline std::string model_directory(const std::string& given, const std::string& config_path) {
  std::error_code ec;
  const std::string model = config_path.empty() ? resolve_checkpoint(given) : given;
  if (!config_path.empty())
    return std::filesystem::is_directory(config_path, ec) ? config_path
                                                          : std::filesystem::path(config_path).parent_path().string();
  return looks_like_path(model) && is_model_directory(model) ? model : std::string();
}

// Where a command's weights come from when no --weights or --init names them: the model
// directory's; a --config directory (or a config.json's) that holds no weight files gives
// none, since a config alone is a model of random weights (as a preset is).
inline std::string default_weights(const std::string& model, const std::string& config_path) {
  const std::string dir = model_directory(model, config_path);
  return !config_path.empty() && !has_weight_files(dir.empty() ? "." : dir) ? std::string() : dir;
}

// --model and --config.
inline void add_model_flags(CLI::App& app, std::string& preset_name, std::string& config_path) {
  app.add_option("--model", preset_name,
                 "preset (upipe model-config --list) or a Hugging Face model directory (config.json and "
                 "safetensors weights, one file or shards)")
      ->capture_default_str();
  app.add_option("--config", config_path, "a Hugging Face config.json (or its directory) instead of --model");
}

// --rope-theta, --rope-scaling and --max-position-embeddings: context extension.
// The RoPE scaling of --rope-scaling ("type=yarn,factor=4,..."), the model's context before it.
inline rope_scaling parse_rope_scaling(const std::string& scaling, const model_config& m);

// Applies them to the model (their ranges were checked where they were read); returns what
// changed of the model's own context, to be said aloud (a scaling replaced, the declared
// context raised).
inline std::vector<std::string> apply_rope(const run_config& c, model_config& m) {
  const std::optional<double>& theta = c.rope_theta;
  const std::string& scaling = c.rope_scaling;
  const std::optional<std::int64_t>& max_position_embeddings = c.max_position_embeddings;
  std::vector<std::string> notes;
  if (theta) {
    if (*theta != m.rope.theta)
      notes.push_back("--rope-theta " + real_text(*theta) + " replaces the model's RoPE base " + real_text(m.rope.theta));
    m.rope.theta = *theta;
  }
  const std::int64_t context = m.max_position_embeddings;
  if (!scaling.empty()) {
    const rope_scaling before = m.rope.scaling;
    m.rope.scaling = parse_rope_scaling(scaling, m);
    if (before.enabled() && !(before == m.rope.scaling))
      notes.push_back(std::string("--rope-scaling replaces the model's ") + rope_kind_name(before.kind) +
                      " scaling (factor " + real_text(before.factor) + ") by " + rope_kind_name(m.rope.scaling.kind) +
                      (m.rope.scaling.enabled() ? " (factor " + real_text(m.rope.scaling.factor) + ")" : std::string()));
  }
  if (max_position_embeddings) {
    m.max_position_embeddings = *max_position_embeddings;
  } else if (!scaling.empty() && m.rope.scaling.enabled()) {
    const std::int64_t original =
        m.rope.scaling.kind == rope_kind::linear ? context : m.rope.scaling.original_max_position;
    m.max_position_embeddings =
        std::max(context, static_cast<std::int64_t>(std::llround(static_cast<double>(original) * m.rope.scaling.factor)));
  }
  if (m.max_position_embeddings != context && context > 0)
    notes.push_back("the context the model declares (max_position_embeddings) goes from " + std::to_string(context) +
                    " to " + std::to_string(m.max_position_embeddings) + " in the saved config.json");
  validate(m);
  return notes;
}

inline rope_scaling parse_rope_scaling(const std::string& scaling, const model_config& m) {
  const key_values items(scaling, "--rope-scaling",
                         {{"type", {"rope_type"}}, {"factor"}, {"original_max_position_embeddings"},
                          {"low_freq_factor"}, {"high_freq_factor"}, {"beta_fast"}, {"beta_slow"}, {"mscale"},
                          {"mscale_all_dim"}, {"attention_factor"}, {"truncate"}},
                         "type=yarn,factor=4");
  const std::optional<std::string> type = items.find("type");
  if (!type)
    throw config_error("--rope-scaling " + scaling + " names no type: begin with type=llama3, linear, yarn or default");
  rope_scaling s;
  s.kind = parse_rope_kind(*type, "--rope-scaling type");
  const auto real = [&](const char* key, double& target, const char* example) {
    if (items.has(key)) target = items.real_number(key, example);
  };
  real("factor", s.factor, "4");
  real("low_freq_factor", s.low_freq_factor, "1");
  real("high_freq_factor", s.high_freq_factor, "4");
  real("beta_fast", s.beta_fast, "32");
  real("beta_slow", s.beta_slow, "1");
  real("mscale", s.mscale, "1");
  real("mscale_all_dim", s.mscale_all_dim, "1");
  real("attention_factor", s.attention_factor, "1");
  // absent: the model's context before the extension
  s.original_max_position = items.has("original_max_position_embeddings")
                                ? items.whole_number("original_max_position_embeddings", 1, limits::context.max, "8192")
                                : m.max_position_embeddings;
  if (const std::optional<std::string> truncate = items.find("truncate")) {
    if (*truncate != "true" && *truncate != "false")
      throw config_error("--rope-scaling truncate=" + *truncate + " must be true or false");
    s.truncate = *truncate == "true";
  }
  return s;
}

}  // namespace upipe::apps
