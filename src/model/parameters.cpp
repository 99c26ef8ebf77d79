#include "model/parameters.hpp"

#include "core/error.hpp"

namespace upipe {

model_parameters::model_parameters(const model_config& config, backend& be, mem_tag tag, dtype type, init how)
    : config_(config), specs_(parameter_specs(config)) {
  tensors_.reserve(specs_.size());
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    const auto& dims = specs_[i].shape;
    // 1-D norm weights are held as (1, n) so that every parameter is a matrix.
    const shape s = dims.size() == 1 ? shape{1, dims[0]} : shape{dims[0], dims[1]};
    const char* label = tag == mem_tag::grads ? "grad" : "param";
    tensors_.push_back(how == init::zeros ? be.allocate_zeroed(tag, type, s, label) : be.allocate(tag, type, s, label));
    index_.emplace(specs_[i].name, i);
  }
}

const tensor& model_parameters::find(const std::string& name) const {
  auto it = index_.find(name);
  UPIPE_CHECK(it != index_.end(), "no parameter named " + name);
  return tensors_[it->second];
}

layer_params model_parameters::layer(int i) const {
  const std::string p = "model.layers." + std::to_string(i) + ".";
  layer_params l;
  l.input_norm = view(p + "input_layernorm.weight");
  l.attention.wq = view(p + "self_attn.q_proj.weight");
  l.attention.wk = view(p + "self_attn.k_proj.weight");
  l.attention.wv = view(p + "self_attn.v_proj.weight");
  l.attention.wo = view(p + "self_attn.o_proj.weight");
  if (config_.qk_norm) {
    l.attention.q_norm = view(p + "self_attn.q_norm.weight");
    l.attention.k_norm = view(p + "self_attn.k_norm.weight");
  }
  l.post_norm = view(p + "post_attention_layernorm.weight");
  l.gate = view(p + "mlp.gate_proj.weight");
  l.up = view(p + "mlp.up_proj.weight");
  l.down = view(p + "mlp.down_proj.weight");
  return l;
}

mat_view model_parameters::embedding() const { return view("model.embed_tokens.weight"); }
mat_view model_parameters::final_norm() const { return view("model.norm.weight"); }
mat_view model_parameters::lm_head() const {
  return config_.tie_embeddings ? embedding() : view("lm_head.weight");
}

}  // namespace upipe
