// The family's name mapping (model/family.hpp): every parameter under the name its
// directories give it, and views of one decoder layer's parameters (or gradients) by role.
// A fused tensor (Phi-3's qkv_proj, gate_up_proj) is held as it is stored, and each of its
// projections is a block of its rows, so that loading and saving copy it unchanged.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cp/delta_weights.hpp"
#include "cp/strategy.hpp"
#include "model/config.hpp"

namespace upipe {

// A sparse layer's MLP (model_config::moe): the router, every expert's projections and
// Qwen2-MoE's shared expert with its gate; a dense layer's are empty.
struct moe_weights {
  mat_view router;                          // (E, D)
  // Per expert that this rank holds, experts first_expert, first_expert + 1, ... (every
  // expert but under expert parallelism): (I, D), (I, D), (D, I).
  std::vector<projection> gate, up, down;
  int first_expert = 0;
  projection shared_gate, shared_up, shared_down;  // (S, D), (S, D), (D, S); no rows without a shared expert
  mat_view shared_expert_gate;              // (1, D)
  bool sparse() const { return router.rows > 0; }
  bool has_shared() const { return shared_gate.weight.rows > 0; }
};
struct moe_grads {
  mat_view router;
  std::vector<projection_grads> gate, up, down;  // the experts of moe_weights' range
  projection_grads shared_gate, shared_up, shared_down;
  mat_view shared_expert_gate;
};

struct layer_params {
  mat_view input_norm;            // (1, D): before attention
  attention_weights attention;    // q/k/v/o projections (+ their biases, q_norm, k_norm)
  delta_weights linear;           // a hybrid's Gated DeltaNet layer (attention then has no rows)
  mat_view attention_post_norm;   // (1, D): on attention's output (Gemma 3), else no rows
  mat_view mlp_norm;              // (1, D): before the MLP (Llama's post_attention_layernorm)
  mat_view mlp_post_norm;         // (1, D): on the MLP's output (Gemma 3), else no rows
  projection gate, up;            // (F, D)
  projection down;                // (D, F)
  moe_weights moe;                // a sparse layer's MLP (gate, up and down then have no rows)
};

// A layer's gradients, f32, accumulated; a frozen weight's are empty (no rows).
struct layer_gradients {
  mat_view input_norm;
  attention_grads attention;
  delta_grads linear;
  mat_view attention_post_norm, mlp_norm, mlp_post_norm;
  projection_grads gate, up, down;
  moe_grads moe;
};

// The layer of a tensor named "model.layers.N. ...": N when it is written as a layer's name
// is (decimal digits, no leading zero, within 64 bits), -1 when it is not ("01", "-1",
// 99999999999999999999: no layer's, never read as another one), nothing for a tensor
// outside the layers.
std::optional<std::int64_t> layer_of(std::string_view name);

// Which of a sparse layer's experts a rank holds: [first, first + count); every one when
// count < 0.
struct expert_range {
  int first = 0, count = -1;
};

// Layer `index`'s views, each looked up by its name in `view` (which gives a 1-D tensor as
// one row); the blocks of a fused tensor are its rows; a sparse layer's experts those of
// `experts`.
layer_params make_layer_params(const model_config& config, int index,
                               const std::function<mat_view(const std::string&)>& view, expert_range experts = {});

// The gradients of a layer whose views make_layer_params looked up in a store's gradients.
layer_gradients as_gradients(const layer_params& g);

// (out, in) of a projection's weight.
std::pair<std::int64_t, std::int64_t> projection_shape(const model_config& config, layer_projection p);

// "model.layers.3." and the name of a layer projection's weight as the family stores it
// (the fused tensor's for Phi-3's q, k, v, gate and up), with the first of its rows.
std::string layer_prefix(int layer);
struct stored_rows {
  std::string module;  // "self_attn.qkv_proj": the module as PEFT names it too
  std::int64_t first = 0, count = 0;  // the first stored row, the projection's (logical) rows
  row_blocks blocks{};                // interleaved with other projections' rows (the gated q_proj)
  // The stored rows a view of the projection spans from `first`.
  std::int64_t extent() const;
};
stored_rows projection_rows(const model_config& config, layer_projection p);
// The hybrids' output gate: its rows of q_proj (each head's d rows after its query's).
stored_rows attention_gate_rows(const model_config& config);
// The stored rows of the module holding `p` (all of its projections', a gated q_proj's gate
// rows included).
std::int64_t module_rows(const model_config& config, layer_projection p);

// A Gated DeltaNet layer's projections (model.layers.N.linear_attn.*) and where each lies:
// Qwen3.5's in_proj_qkv (q, k, v side by side), in_proj_z, in_proj_b, in_proj_a; Qwen3-Next's
// in_proj_qkvz and in_proj_ba, whose rows are grouped by key head (each group's q, k, v, z
// rows, and b, a rows); out_proj.
enum class linear_projection : std::uint8_t { q, k, v, z, b, a, out };
inline constexpr int linear_projection_count = 7;
stored_rows linear_rows(const model_config& config, linear_projection p);
// (out, in) of a linear layer projection (logical rows) and of the module holding it.
std::pair<std::int64_t, std::int64_t> linear_shape(const model_config& config, linear_projection p);
std::int64_t linear_module_rows(const model_config& config, linear_projection p);

// A sparse layer's tensors under the family's names: "mlp.gate.weight" (the router),
// "mlp.experts.3.gate_proj.weight" (Mixtral: "block_sparse_moe.experts.3.w1.weight"), the
// shared expert's; `role` 0, 1, 2 for gate, up, down.
std::string router_name(const model_config& config, int layer);
std::string expert_name(const model_config& config, int layer, int expert, int role);
// The fused layout of newer transformers: "mlp.experts.gate_up_proj" (E, 2I, D) and
// "mlp.experts.down_proj" (E, D, I); where expert `expert`'s tensor of `role` begins in it.
struct fused_expert_place {
  std::string name;
  std::int64_t offset = 0;  // elements
};
fused_expert_place fused_expert(const model_config& config, int layer, int expert, int role);

// The sparse layer and expert of a routed expert's tensor (expert_name's), nothing for any
// other parameter (the router and the shared expert included).
struct expert_place {
  int layer = 0, expert = 0;
};
std::optional<expert_place> expert_of(const model_config& config, std::string_view name);

}  // namespace upipe
