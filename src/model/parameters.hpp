// A model's parameters (or their gradients) on one backend, under Hugging Face names,
// with per-layer views for the layer code.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "cp/strategy.hpp"
#include "model/config.hpp"

namespace upipe {

// Views of one decoder layer's parameters (or gradients).
struct layer_params {
  mat_view input_norm;          // (1, D)
  attention_weights attention;  // q/k/v/o projections (+ q_norm, k_norm for Qwen3)
  mat_view post_norm;           // (1, D)
  mat_view gate, up;            // (F, D)
  mat_view down;                // (D, F)
};

class model_parameters {
 public:
  // Allocates every parameter of `config` with `type` under `tag`; zeroed if asked.
  enum class init : std::uint8_t { uninitialized, zeros };
  model_parameters(const model_config& config, backend& be, mem_tag tag, dtype type, init how);

  const std::vector<parameter_spec>& specs() const { return specs_; }
  const tensor& operator[](std::size_t i) const { return tensors_[i]; }
  // Throws internal_error for an unknown name.
  const tensor& find(const std::string& name) const;
  std::size_t size() const { return tensors_.size(); }

  layer_params layer(int index) const;
  mat_view embedding() const;   // (V, D)
  mat_view final_norm() const;  // (1, D)
  mat_view lm_head() const;     // (V, D): the embedding itself when tied

 private:
  mat_view view(const std::string& name) const { return find(name).matrix(); }

  const model_config& config_;
  std::vector<parameter_spec> specs_;
  std::vector<tensor> tensors_;
  std::map<std::string, std::size_t> index_;
};

}  // namespace upipe
