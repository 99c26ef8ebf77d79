// `upipe model-config`: shows a model configuration (a preset or a Hugging Face
// config.json), its parameter count and shapes, and can write it as a config.json that
// transformers loads.
#include <cstdio>
#include <string>

#include "apps/commands.hpp"
#include "apps/flag_checks.hpp"
#include "apps/model_flags.hpp"
#include "core/error.hpp"
#include "model/config.hpp"

namespace upipe::apps {

namespace {

struct model_flags {
  std::string model = "tiny-llama";
  std::string config_path;
  std::string out_path;
  bool list = false;
};

int run(const model_flags& f) {
  if (f.list) {
    for (const std::string& name : preset_names()) {
      const model_config c = preset(name);
      int windowed = 0;
      for (int l = 0; l < c.num_layers; ++l) windowed += c.layer_window(l) > 0 ? 1 : 0;
      const std::string window = windowed == 0 ? std::string()
                                               : " window=" + std::to_string(c.sliding_window) + " on " +
                                                     std::to_string(windowed) + "/" + std::to_string(c.num_layers);
      std::printf("%-12s %-12s %6.2fB parameters  L=%d D=%d H=%d K=%d d=%d F=%d V=%lld%s%s%s%s\n", name.c_str(),
                  std::string(c.traits().model_type).c_str(), static_cast<double>(c.parameter_count()) / 1e9,
                  c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                  static_cast<long long>(c.vocab_size), c.tie_embeddings ? " tied" : "", c.qk_norm ? " qk-norm" : "",
                  c.biases != 0 ? " bias" : "", window.c_str());
    }
    return 0;
  }
  const model_config c = load_model(f.model, f.config_path);
  std::printf("%s: %lld parameters\n", c.name.c_str(), static_cast<long long>(c.parameter_count()));
  for (const parameter_spec& p : parameter_specs(c)) {
    std::string dims;
    for (auto d : p.shape) dims += (dims.empty() ? "" : " x ") + std::to_string(d);
    std::printf("  %-52s %s\n", p.name.c_str(), dims.c_str());
  }
  if (!f.out_path.empty()) {
    write_hf_config(c, f.out_path);
    std::printf("wrote %s\n", f.out_path.c_str());
  }
  return 0;
}

}  // namespace

command_runner add_model_config(CLI::App& app) {
  auto f = std::make_shared<model_flags>();
  add_model_flags(app, f->model, f->config_path);
  app.add_option("--out", f->out_path, "write the configuration as a Hugging Face config.json here")->check(output_file_flag("--out"));
  app.add_flag("--list", f->list, "list the presets");
  return [f] { return run(*f); };
}

}  // namespace upipe::apps
