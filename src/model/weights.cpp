#include "model/weights.hpp"

#include <cmath>
#include <filesystem>
#include <random>
#include <set>

#include "backend/backend.hpp"
#include "core/shape.hpp"
#include "core/error.hpp"
#include "core/random.hpp"
#include "formats/safetensors.hpp"
#include "model/hf_model.hpp"

namespace upipe {

host_weights read_weights(const model_config& config, const std::string& path) {
  return read_all_weights(hf_model_files(path, config), config);
}

void write_weights(const model_config& config, const host_weights& weights, const std::string& path, dtype type) {
  std::vector<safetensors_tensor> tensors;
  for (const parameter_spec& spec : parameter_specs(config)) {
    auto it = weights.find(spec.name);
    UPIPE_CHECK(it != weights.end(), "no values for " + spec.name);
    UPIPE_CHECK(static_cast<std::int64_t>(it->second.size()) == element_count(spec.shape), "wrong size for " + spec.name);
    tensors.push_back({spec.name, spec.shape, it->second, type});
  }
  write_safetensors(path, tensors, {{"format", "pt"}});
}

host_weights random_weights(const model_config& config, unsigned long long seed) {
  require_host_memory(static_cast<std::size_t>(config.parameter_count()) * sizeof(float),
                      "random weights of " + std::to_string(config.parameter_count()) + " parameters (" + config.name +
                          ")");
  // A norm's effective scale is offset + weight (Gemma stores weight - 1).
  const float norm_center = 1.0f - config.traits().norm_offset;
  host_weights weights;
  std::uint64_t stream = 0;  // one per tensor
  for (const parameter_spec& spec : parameter_specs(config)) {
    std::vector<float> v(static_cast<std::size_t>(element_count(spec.shape)));
    switch (spec.kind) {
      case param_kind::matrix:
      case param_kind::embedding:
        fill_normal(v, seed, ++stream, 0.02f);
        break;
      case param_kind::norm:
        fill_normal(v, seed, ++stream, 0.1f);
        for (float& e : v) e += norm_center;
        break;
      case param_kind::bias:
        fill_normal(v, seed, ++stream, 0.1f);
        break;
      case param_kind::conv:  // a depthwise tap sees Kc inputs
        fill_normal(v, seed, ++stream, static_cast<float>(1.0 / std::sqrt(static_cast<double>(spec.shape.back()))));
        break;
      case param_kind::log_decay:  // rates near 0.1, as transformers' log U(0.01, 16) would decay within tokens
        fill_normal(v, seed, ++stream, 0.5f);
        for (float& e : v) e += static_cast<float>(std::log(0.1));
        break;
      case param_kind::gated_norm:
        fill_normal(v, seed, ++stream, 0.1f);
        for (float& e : v) e += 1.0f;
        break;
    }
    weights.emplace(spec.name, std::move(v));
  }
  return weights;
}

std::vector<std::int32_t> random_tokens(std::int64_t count, std::int64_t vocab, unsigned long long seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int64_t> pick(0, vocab - 1);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(count));
  for (auto& t : tokens) t = static_cast<std::int32_t>(pick(rng));
  return tokens;
}

}  // namespace upipe
