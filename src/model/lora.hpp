// LoRA (low-rank adapters) as PEFT defines them: a targeted projection y = x W^T becomes
// y = x W^T + (alpha / r) (x A^T) B^T with A (r, in) and B (out, r) trained and W frozen.
// The configuration (`--lora r=16,alpha=32,targets=q,k,v,o,gate,up,down`), the adapters'
// parameters under PEFT's names, their initialization, the model FLOPs of a LoRA step, and
// the views that put a store's adapters beside the weights they adapt.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.hpp"
#include "model/parameters.hpp"
#include "model/weights.hpp"

namespace upipe {

// The linear projections of a decoder layer an adapter may target (model/family.hpp), in
// PEFT's module names q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, and the
// hybrids' Gated DeltaNet projections (model/parameters.hpp's linear_projection: in_proj_qkv,
// in_proj_z, in_proj_b, in_proj_a, out_proj, or Qwen3-Next's in_proj_qkvz and in_proj_ba).
// Where the family stores some fused (Phi-3's qkv_proj, gate_up_proj; the linear layers'
// in_proj_qkv), PEFT adapts the fused module with one adapter: its projections are targeted
// together, share its A and take their rows of its B. A gated attention's q_proj adapter
// covers its gate's rows too. A target adapts the layers that have it (a hybrid's attention
// targets its full-attention layers, its linear ones the Gated DeltaNet layers).
enum class lora_target : std::uint8_t {
  q, k, v, o, gate, up, down,                                                         // layer_projection's
  linear_q, linear_k, linear_v, linear_z, linear_b, linear_a, linear_out              // linear_projection's
};
inline constexpr int lora_target_count = layer_projection_count + linear_projection_count;
using lora_target_bits = std::uint16_t;
// The largest rank read (a rank above min(out, in) of every target is refused anyway).
inline constexpr int max_lora_rank = 1 << 20;
// The largest alpha / r: beyond it the adapters' output swamps the frozen weights' and the
// first step diverges, which would otherwise be reported as a learning rate too high.
inline constexpr double max_lora_scale = 1024;

struct lora_config {
  int rank = 0;           // r; 0: no LoRA (every weight trained)
  double alpha = 0;       // lora_alpha: the adapter's output is scaled by alpha / r
  lora_target_bits targets = 0;  // one bit per lora_target

  bool enabled() const { return rank > 0; }
  float scale() const { return static_cast<float>(alpha / rank); }
  bool adapts(lora_target t) const { return (targets >> static_cast<int>(t) & 1) != 0; }
  std::vector<lora_target> target_list() const;
  bool operator==(const lora_config&) const = default;
};

// PEFT's name of the module holding a target in `model` ("q_proj", or Phi-3's "qkv_proj").
std::string lora_module_name(const model_config& model, lora_target t);
// The modules the targets of `lora` adapt, each once, in target order.
std::vector<std::string> lora_module_names(const model_config& model, const lora_config& lora);
// "r=16,alpha=32,targets=q,k,v,o,gate,up,down": the flag's own form.
std::string lora_text(const lora_config& lora);

// Parses --lora: comma-separated key=value items r (required), alpha (default r),
// dropout (0 only) and targets (the names that follow it, short or PEFT's: q or q_proj, ...,
// or all; default all seven), and checks them against the model. Throws config_error
// naming the value, the rule and a valid alternative, before any work is done.
lora_config parse_lora(std::string_view text, const model_config& model);
// The checks parse_lora makes on a configuration from elsewhere (an adapter_config.json).
void validate(const lora_config& lora, const model_config& model, const std::string& what = "--lora");
// Parses the target names of `names` (short or PEFT's, or all / all-linear) for `model`.
lora_target_bits parse_lora_targets(const std::vector<std::string>& names, const model_config& model,
                                    const std::string& what = "--lora targets");

// The adapters' parameters: for each layer and each adapted module in target order,
// lora_A (r, in) then lora_B (out, r) (a fused module's out is its projections' together),
// named as PEFT names them without its "base_model.model." prefix
// ("model.layers.0.self_attn.q_proj.lora_A.weight").
std::vector<parameter_spec> lora_parameter_specs(const model_config& model, const lora_config& lora);
// PEFT's prefix of every tensor name in adapter_model.safetensors.
inline constexpr std::string_view peft_name_prefix = "base_model.model.";
std::int64_t lora_parameter_count(const model_config& model, const lora_config& lora);
// The adapters of one layer (a hybrid's layers of each kind hold different ones).
std::int64_t lora_layer_parameter_count(const model_config& model, const lora_config& lora, int layer);

// The host memory one rank's offloaded optimizer holds for the adapters (as
// offloaded_optimizer_bytes does for a whole model): per layer unit, its shard of the fp32
// masters, moments and gradients, and of the working weights.
std::size_t lora_offloaded_optimizer_bytes(const model_config& model, const lora_config& lora, int ranks, dtype work);

// Model FLOPs of one LoRA step over S tokens (docs/design.md section 7, recompute not
// counted): the base's forward and its input-gradient GEMMs (4 N_matmul S, no weight
// gradient), the causal attention (6 L H d S^2, or the documents' pairs), and the
// adapters' forward, input and weight gradients (6 N_adapter S).
double lora_model_flops(const model_config& model, const lora_config& lora, std::int64_t seq_len,
                        std::span<const std::int64_t> documents = {});

// PEFT's default initialization: A kaiming-uniform with a = sqrt(5), i.e. uniform in
// +-1/sqrt(in), and B = 0, drawn from `seed` (counter-based, core/random.hpp).
host_weights initial_adapters(const model_config& model, const lora_config& lora, std::uint64_t seed);

// Puts layer `layer`'s adapters, looked up by name in `view`, beside the weights they adapt
// (or, for gradients, beside the weights' gradients).
using named_view = std::function<mat_view(const std::string&)>;
void attach_adapters(layer_params& p, const model_config& model, const lora_config& lora, int layer,
                     const named_view& view);
void attach_adapter_grads(layer_gradients& g, const model_config& model, const lora_config& lora, int layer,
                          const named_view& view);

}  // namespace upipe
