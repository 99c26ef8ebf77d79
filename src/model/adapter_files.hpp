// LoRA adapter directories as PEFT's save_pretrained writes them and
// PeftModel.from_pretrained reads them:
//   adapter_config.json         peft_type LORA, r, lora_alpha, target_modules, ...
//   adapter_model.safetensors   base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight (r, in),
//                               ....lora_B.weight (out, r), for every adapted projection
// Reading checks the configuration against what upipe runs (plain LoRA: no DoRA, rsLoRA,
// bias, per-module ranks, layer subsets or extra trained modules) and every tensor's shape.
#pragma once

#include <memory>
#include <string>

#include "core/dtype.hpp"
#include "model/hf_model.hpp"
#include "model/lora.hpp"

namespace upipe {

inline constexpr const char* adapter_config_file = "adapter_config.json";
inline constexpr const char* adapter_weights_file = "adapter_model.safetensors";

// Does `path` hold an adapter_config.json?
bool is_adapter_directory(const std::string& path);

struct adapter_settings {
  lora_config lora;
  double dropout = 0;      // lora_dropout as written (upipe trains with 0)
  std::string base_model;  // base_model_name_or_path ("" when absent)
};

// DIR/adapter_config.json's base_model_name_or_path ("" when absent): the model a
// command takes when none is named.
std::string adapter_base_model(const std::string& dir);

// Reads DIR/adapter_config.json for `model`. Throws io_error for a missing or malformed file
// and config_error for what upipe does not run, naming the field, the rule and a way out.
adapter_settings read_adapter_config(const std::string& dir, const model_config& model);

// Writes DIR/adapter_config.json (PEFT's LoraConfig fields; target_modules the modules of
// `model` that hold the targets) for a run of `lora` on the base
// `base_model` (a directory or a preset's name).
void write_adapter_config(const std::string& dir, const model_config& model, const lora_config& lora,
                          const std::string& base_model);

// DIR/adapter_model.safetensors mapped, under upipe's names (lora_parameter_specs), every
// tensor checked: present, with its shape and a supported dtype, every value read finite.
// Throws io_error naming the file and the tensor.
class adapter_files final : public weight_source {
 public:
  adapter_files(const std::string& dir, const model_config& model, const lora_config& lora);
  ~adapter_files() override;
  void read(const std::string& name, std::int64_t offset, std::int64_t count, float* out) const override;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

// The adapters of DIR in full, under upipe's names.
host_weights read_adapter_weights(const std::string& dir, const model_config& model, const lora_config& lora);

}  // namespace upipe
