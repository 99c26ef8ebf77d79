#include "model/adapter_files.hpp"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/files.hpp"
#include "formats/safetensors.hpp"

namespace upipe {

namespace fs = std::filesystem;

bool is_adapter_directory(const std::string& path) {
  // Present in any form: a FIFO or a link loop in its place is then refused by name when read.
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::exists(fs::symlink_status(fs::path(path) / adapter_config_file, ec));
}

namespace {

// A field that, set, asks for something upipe's LoRA does not do.
void refuse_if(bool set, const std::string& file, const std::string& field, const std::string& why) {
  if (set) throw config_error(file + " sets " + field + ", which upipe does not run: " + why);
}

bool non_empty(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  return it != j.end() && !it->is_null() && !(it->is_object() && it->empty()) && !(it->is_array() && it->empty());
}

// PEFT writes target_modules as module names (q_proj) or, having resolved all-linear, as
// module paths (model.layers.3.self_attn.q_proj). Paths are taken as their module's name
// when they name it in every layer; a module adapted in some layers only is refused.
std::vector<std::string> module_names(const std::vector<std::string>& names, const std::string& file, int layers) {
  std::vector<std::string> out;
  std::map<std::string, std::set<int>> layers_of;  // module name -> the layers its paths name
  const std::string layer_prefix = "model.layers.";
  for (std::string name : names) {
    if (name.find('.') == std::string::npos) {
      out.push_back(name);
      continue;
    }
    if (name.rfind("base_model.model.", 0) == 0) name = name.substr(std::string("base_model.model.").size());
    const std::size_t dot = name.find('.', layer_prefix.size());
    if (name.rfind(layer_prefix, 0) != 0 || dot == std::string::npos)
      throw config_error(file + " names the module " + name + ": upipe adapts the layers' projections "
                         "(model.layers.N.self_attn.q_proj, ..., or their names q_proj, ...)");
    const int layer = std::atoi(name.c_str() + layer_prefix.size());
    layers_of[name.substr(name.rfind('.') + 1)].insert(layer);
  }
  for (const auto& [module, seen] : layers_of) {
    for (int l = 0; l < layers; ++l)
      if (!seen.count(l))
        throw config_error(file + " adapts " + module + " in some layers but not in layer " + std::to_string(l) +
                           ": upipe adapts a module in every layer; adapt it everywhere or nowhere");
    out.push_back(module);
  }
  return out;
}

std::vector<std::string> target_names(const nlohmann::json& t, const std::string& file, int layers) {
  if (t.is_string()) {
    const std::string s = t.get<std::string>();
    if (s.find_first_of("*.()[]|\\^$+?") != std::string::npos)
      throw config_error(file + " gives target_modules as the pattern '" + s +
                         "': upipe reads a list of module names (q_proj, ..., down_proj) or all-linear");
    return {s};
  }
  if (!t.is_array()) throw io_error(file + ": target_modules must be a list of module names or a string");
  return module_names(t.get<std::vector<std::string>>(), file, layers);
}

// r as written: a whole number (nlohmann's get<int> would read 4.9 as 4 and 4294967300 as 4).
int rank_of(const nlohmann::json& r, const std::string& file) {
  if (!r.is_number_integer() || r.get<double>() < 1 || r.get<double>() > max_lora_rank)
    throw config_error(file + " gives r = " + r.dump().substr(0, 40) + ": the adapters' rank must be a whole number "
                       "between 1 and " + std::to_string(max_lora_rank) + " (for example 16)");
  return r.get<int>();
}

}  // namespace

std::string adapter_base_model(const std::string& dir) {
  const std::string file = (fs::path(dir) / adapter_config_file).string();
  const std::string text = read_text_file(file, "the adapters' configuration");
  try {
    const auto j = nlohmann::json::parse(text);
    const auto it = j.find("base_model_name_or_path");
    return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
  } catch (const nlohmann::json::exception& e) {
    throw io_error("cannot read " + file + ": " + e.what());
  }
}

adapter_settings read_adapter_config(const std::string& dir, const model_config& model) {
  const std::string file = (fs::path(dir) / adapter_config_file).string();
  std::string text;
  try {
    text = read_text_file(file, "the adapters' configuration");
  } catch (const io_error& e) {
    throw io_error(std::string(e.what()) + " (is " + dir + " a LoRA adapter directory, as PEFT's save_pretrained "
                   "writes it?)");
  }
  adapter_settings s;
  try {
    const auto j = nlohmann::json::parse(text);
    if (j.contains("peft_type") && j.at("peft_type") != "LORA")
      throw config_error(file + " holds a " + j.at("peft_type").dump() + " adapter; upipe trains LoRA adapters only");
    refuse_if(j.value("use_dora", false), file, "use_dora", "DoRA's magnitude vectors are not implemented");
    refuse_if(j.value("use_rslora", false), file, "use_rslora", "rank-stabilized scaling (alpha / sqrt r) is not "
              "implemented; the scale here is alpha / r");
    refuse_if(j.value("fan_in_fan_out", false), file, "fan_in_fan_out", "the adapted weights are (out, in) linears");
    refuse_if(j.contains("bias") && j.at("bias") != "none", file, "bias", "the base's biases stay frozen under "
              "LoRA here; use bias \"none\"");
    for (const char* key : {"rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform",
                            "exclude_modules", "trainable_token_indices", "target_parameters"})
      refuse_if(non_empty(j, key), file, key, "every layer's targets share one r and alpha here, and only the "
                "adapters train");
    s.lora.rank = rank_of(j.at("r"), file);
    if (!j.at("lora_alpha").is_number())
      throw io_error(file + ": lora_alpha = " + j.at("lora_alpha").dump().substr(0, 40) + " is not a number");
    s.lora.alpha = j.at("lora_alpha").get<double>();
    s.dropout = j.value("lora_dropout", 0.0);
    s.lora.targets = parse_lora_targets(target_names(j.at("target_modules"), file, model.num_layers), model,
                                        file + " target_modules");
    if (j.contains("base_model_name_or_path") && j.at("base_model_name_or_path").is_string())
      s.base_model = j.at("base_model_name_or_path").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    throw io_error("cannot read " + file + ": " + e.what());
  }
  validate(s.lora, model, file);
  return s;
}

void write_adapter_config(const std::string& dir, const model_config& model, const lora_config& lora,
                          const std::string& base_model) {
  const std::vector<std::string> targets = lora_module_names(model, lora);
  nlohmann::ordered_json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["base_model_name_or_path"] = base_model;
  j["r"] = lora.rank;
  j["lora_alpha"] = lora.alpha;
  j["lora_dropout"] = 0.0;
  j["target_modules"] = targets;
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["use_rslora"] = false;
  j["use_dora"] = false;
  j["init_lora_weights"] = true;
  j["inference_mode"] = true;
  j["modules_to_save"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["rank_pattern"] = nlohmann::json::object();
  j["alpha_pattern"] = nlohmann::json::object();
  j["revision"] = nullptr;
  const std::string file = (fs::path(dir) / adapter_config_file).string();
  std::ofstream out(file, std::ios::trunc);
  out << j.dump(2) << "\n";
  out.close();
  if (!out) throw io_error("cannot write " + file + ": check the directory and the disk");
}

struct adapter_files::impl {
  safetensors_view file;
  explicit impl(const std::string& path) : file(path) {}
};

adapter_files::adapter_files(const std::string& dir, const model_config& model, const lora_config& lora) {
  const std::string path = (fs::path(dir) / adapter_weights_file).string();
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec)))
    throw io_error("cannot read the adapters: " + path + " is missing (PEFT's save_pretrained writes it; a .bin "
                   "adapter must be converted to safetensors first)");
  impl_ = std::make_unique<impl>(path);
  std::set<std::string> expected;
  for (const parameter_spec& spec : lora_parameter_specs(model, lora)) {
    const std::string name = std::string(peft_name_prefix) + spec.name;
    expected.insert(name);
    const safetensors_info* info = impl_->file.find(name);
    if (info == nullptr)
      throw io_error(path + " lacks " + name + ": the adapter is not one of r=" + std::to_string(lora.rank) + " on " +
                     lora_text(lora) + " for " + model.name);
    if (info->shape != spec.shape)
      throw io_error(path + ": " + name + " has shape " + nlohmann::json(info->shape).dump() + ", expected " +
                     nlohmann::json(spec.shape).dump() + " (r=" + std::to_string(lora.rank) + " on " + model.name + ")");
  }
  for (const auto& [name, info] : impl_->file.tensors())
    if (!expected.count(name))
      throw io_error(path + " holds " + name + ", which " + std::string(adapter_config_file) +
                     "'s targets do not account for: the file and its configuration disagree");
}

adapter_files::~adapter_files() = default;

void adapter_files::read(const std::string& name, std::int64_t offset, std::int64_t count, float* out) const {
  impl_->file.read_finite(std::string(peft_name_prefix) + name, static_cast<std::uint64_t>(offset),
                          static_cast<std::uint64_t>(count), out);
}

host_weights read_adapter_weights(const std::string& dir, const model_config& model, const lora_config& lora) {
  const adapter_files files(dir, model, lora);
  host_weights out;
  for (const parameter_spec& spec : lora_parameter_specs(model, lora)) {
    std::vector<float> values(static_cast<std::size_t>(spec.shape[0] * spec.shape[1]));
    files.read(spec.name, 0, static_cast<std::int64_t>(values.size()), values.data());
    out.emplace(spec.name, std::move(values));
  }
  return out;
}

}  // namespace upipe
