// The model a command runs: a preset (--model) or a Hugging Face config.json (--config),
// optionally cut to a slice of its first N layers (--layers, at full width and length).
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "core/error.hpp"
#include "model/config.hpp"

namespace upipe::apps {

// The model's first `layers` layers; 0 keeps every layer, else it must lie in [1, all].
inline model_config slice_layers(model_config m, int layers) {
  if (layers < 0 || layers > m.num_layers)
    throw config_error("--layers " + std::to_string(layers) + " must lie between 1 and the model's " +
                       std::to_string(m.num_layers) + " layers (a slice of the first N layers)");
  if (layers > 0) m.num_layers = layers;
  return m;
}

inline model_config load_model(const std::string& preset_name, const std::string& config_path, int layers = 0) {
  return slice_layers(config_path.empty() ? preset(preset_name) : read_hf_config(config_path), layers);
}

// --model and --config.
inline void add_model_flags(CLI::App& app, std::string& preset_name, std::string& config_path) {
  app.add_option("--model", preset_name, "preset (upipe model-config --list)")->capture_default_str();
  app.add_option("--config", config_path, "a Hugging Face config.json instead of a preset");
}

}  // namespace upipe::apps
