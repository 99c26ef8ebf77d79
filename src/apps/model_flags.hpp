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

#include "core/error.hpp"
#include "model/adapter_files.hpp"
#include "core/limits.hpp"
#include "model/config.hpp"
#include "train/run_directory.hpp"

namespace upipe::apps {

// The model's first `layers` layers; 0 keeps every layer, else it must lie in [1, all].
inline model_config slice_layers(model_config m, int layers) {
  if (layers < 0 || layers > m.num_layers)
    throw config_error("--layers " + std::to_string(layers) + " must lie between 1 and the model's " +
                       std::to_string(m.num_layers) + " layers (a slice of the first N layers)");
  if (layers > 0) m.num_layers = layers;
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
  if (!config_path.empty()) return slice_layers(read_hf_config(config_path), layers);
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

// --model and --config.
inline void add_model_flags(CLI::App& app, std::string& preset_name, std::string& config_path) {
  app.add_option("--model", preset_name,
                 "preset (upipe model-config --list) or a Hugging Face model directory (config.json and "
                 "safetensors weights, one file or shards)")
      ->capture_default_str();
  app.add_option("--config", config_path, "a Hugging Face config.json (or its directory) instead of --model");
}

// --rope-theta, --rope-scaling and --max-position-embeddings: context extension.
struct rope_flags {
  std::optional<double> theta;                         // the model's unless given
  std::string scaling;                                 // "type=yarn,factor=4,..." (empty: the model's)
  std::optional<std::int64_t> max_position_embeddings;  // the model's unless given (raised to cover the extension)

  // Applies the flags to the model; returns what changed of the model's own context, to be
  // said aloud (a scaling replaced, the declared context raised).
  std::vector<std::string> apply(model_config& m) const {
    std::vector<std::string> notes;
    if (theta) {
      if (!(*theta > 0) || !std::isfinite(*theta))
        throw config_error("--rope-theta " + real_text(*theta) + " must be a positive number (e.g. 500000)");
      if (*theta != m.rope.theta)
        notes.push_back("--rope-theta " + real_text(*theta) + " replaces the model's RoPE base " + real_text(m.rope.theta));
      m.rope.theta = *theta;
    }
    const std::int64_t context = m.max_position_embeddings;
    if (!scaling.empty()) {
      const rope_scaling before = m.rope.scaling;
      m.rope.scaling = parse_scaling(m);
      if (before.enabled() && !(before == m.rope.scaling))
        notes.push_back(std::string("--rope-scaling replaces the model's ") + rope_kind_name(before.kind) +
                        " scaling (factor " + real_text(before.factor) + ") by " + rope_kind_name(m.rope.scaling.kind) +
                        (m.rope.scaling.enabled() ? " (factor " + real_text(m.rope.scaling.factor) + ")" : std::string()));
    }
    if (max_position_embeddings && *max_position_embeddings < 1)
      throw config_error("--max-position-embeddings " + std::to_string(*max_position_embeddings) +
                         " must be positive (e.g. 131072)");
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

 private:
  rope_scaling parse_scaling(const model_config& m) const {
    rope_scaling s;
    s.original_max_position = 0;  // absent: the model's context before the extension
    bool typed = false;
    std::size_t start = 0;
    while (start <= scaling.size()) {
      const std::size_t comma = std::min(scaling.find(',', start), scaling.size());
      const std::string part = scaling.substr(start, comma - start);
      start = comma + 1;
      if (part.empty()) continue;
      const std::size_t eq = part.find('=');
      if (eq == std::string::npos)
        throw config_error("--rope-scaling part '" + part + "' must be key=value, e.g. type=yarn,factor=4");
      const std::string key = part.substr(0, eq), value = part.substr(eq + 1);
      const auto number = [&]() {
        try {
          std::size_t used = 0;
          const double v = std::stod(value, &used);
          if (used == value.size() && std::isfinite(v)) return v;
        } catch (const std::exception&) {
        }
        throw config_error("--rope-scaling " + key + "=" + value + " is not a number (e.g. " + key + "=4)");
      };
      if (key == "type" || key == "rope_type") {
        s.kind = parse_rope_kind(value, "--rope-scaling type");
        typed = true;
      } else if (key == "factor") {
        s.factor = number();
      } else if (key == "original_max_position_embeddings") {
        s.original_max_position = static_cast<std::int64_t>(number());
      } else if (key == "low_freq_factor") {
        s.low_freq_factor = number();
      } else if (key == "high_freq_factor") {
        s.high_freq_factor = number();
      } else if (key == "beta_fast") {
        s.beta_fast = number();
      } else if (key == "beta_slow") {
        s.beta_slow = number();
      } else if (key == "mscale") {
        s.mscale = number();
      } else if (key == "mscale_all_dim") {
        s.mscale_all_dim = number();
      } else if (key == "attention_factor") {
        s.attention_factor = number();
      } else if (key == "truncate") {
        if (value != "true" && value != "false")
          throw config_error("--rope-scaling truncate=" + value + " must be true or false");
        s.truncate = value == "true";
      } else {
        throw config_error("--rope-scaling key '" + key + "' is not known; the keys are type, factor, "
                           "original_max_position_embeddings, low_freq_factor, high_freq_factor, beta_fast, beta_slow, "
                           "mscale, mscale_all_dim, attention_factor, truncate");
      }
    }
    if (!typed)
      throw config_error("--rope-scaling " + scaling + " names no type: begin with type=llama3, linear, yarn or default");
    if (s.original_max_position == 0) s.original_max_position = m.max_position_embeddings;
    return s;
  }
};

}  // namespace upipe::apps
