#include "model/weights.hpp"

#include <cmath>
#include <filesystem>
#include <set>

#include "core/error.hpp"
#include "core/random.hpp"
#include "train/safetensors.hpp"

namespace upipe {

namespace {

std::string shape_str(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::int64_t numel(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// A tensor of a layer the configuration does not have means the file is for another model.
void check_layer_count(const model_config& config, const std::string& name, const std::string& path) {
  const std::string prefix = "model.layers.";
  if (name.rfind(prefix, 0) != 0) return;
  const int layer = std::atoi(name.c_str() + prefix.size());
  if (layer >= config.num_layers)
    throw io_error(path + " holds " + name + " but the model configuration " + config.name + " has " +
                   std::to_string(config.num_layers) + " layers: pass the configuration these weights were saved "
                   "with (--config DIR/config.json or the matching --model preset)");
}

}  // namespace

host_weights read_weights(const model_config& config, const std::string& path) {
  std::string file = path;
  if (std::filesystem::is_directory(path)) file = (std::filesystem::path(path) / "model.safetensors").string();
  safetensors_file st = read_safetensors(file);
  host_weights weights;
  for (const parameter_spec& spec : parameter_specs(config)) {
    auto it = st.tensors.find(spec.name);
    if (it == st.tensors.end())
      throw io_error(file + " has no tensor " + spec.name + " (shape " + shape_str(spec.shape) + "), which " +
                     config.name + " needs: is this checkpoint for another model?");
    if (it->second.shape != spec.shape)
      throw io_error(file + ": tensor " + spec.name + " has shape " + shape_str(it->second.shape) + " but " +
                     config.name + " needs " + shape_str(spec.shape) + ": pass the matching configuration");
    weights.emplace(spec.name, std::move(it->second.values));
  }
  for (const auto& [name, entry] : st.tensors) check_layer_count(config, name, file);
  return weights;
}

void write_weights(const model_config& config, const host_weights& weights, const std::string& path, dtype type) {
  std::vector<safetensors_tensor> tensors;
  for (const parameter_spec& spec : parameter_specs(config)) {
    auto it = weights.find(spec.name);
    UPIPE_CHECK(it != weights.end(), "no values for " + spec.name);
    UPIPE_CHECK(static_cast<std::int64_t>(it->second.size()) == numel(spec.shape), "wrong size for " + spec.name);
    tensors.push_back({spec.name, spec.shape, it->second, type});
  }
  write_safetensors(path, tensors, {{"format", "pt"}});
}

host_weights random_weights(const model_config& config, unsigned long long seed) {
  host_weights weights;
  std::uint64_t stream = 0;  // one per tensor
  for (const parameter_spec& spec : parameter_specs(config)) {
    std::vector<float> v(static_cast<std::size_t>(numel(spec.shape)));
    const bool norm = spec.shape.size() == 1;
    fill_normal(v, seed, ++stream, norm ? 0.1f : 0.02f);
    if (norm)
      for (float& e : v) e += 1.0f;
    weights.emplace(spec.name, std::move(v));
  }
  return weights;
}

}  // namespace upipe
