// One rank's forward and backward of a whole decoder model under context parallelism
// (docs/design.md section 2): embedding, L layers of RMSNorm -> attention (a CP strategy) ->
// residual -> tiled RMSNorm + gated MLP -> residual, final RMSNorm and the fused
// chunked linear + cross-entropy. What the family's row says (model/family.hpp) shapes the
// layer: biases, q/k norms, norms after attention and the MLP, the activation, the
// embedding's scale, and each layer's window and RoPE (one attention layer per distinct
// pattern). Between forward and backward only checkpoints are kept; backward recomputes
// each layer (or block of layers) from them.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "cp/attention_layer.hpp"
#include "cp/delta_layer.hpp"
#include "model/checkpoint_store.hpp"
#include "model/config.hpp"
#include "model/lora.hpp"
#include "model/moe_mlp.hpp"
#include "model/parameter_store.hpp"
#include "model/parameters.hpp"

namespace upipe {

// The CP side of a run: strategy, group size C and head chunk U (0: the default).
struct cp_settings {
  strategy_kind strategy = strategy_kind::upipe;
  int cp = 1;
  int head_chunk = 0;
  int ring = 1;  // hybrid: R rings of all-to-all groups of C / R ranks
  int seq_chunks = 0;  // N sequence chunks (fpdt; upipe and ulysses too); 0: the strategy's default
};

// Which MLP tiles and loss chunks a step runs on a backend without data (meta): every one,
// or the first and the last, shorter one only. Every full tile allocates and frees the same
// buffers in the same order, so the others change no peak, and with distinct_shapes a
// probe costs the same whatever the tile (a tile of 1 token at 2^30 tokens would loop 2^30
// times per layer). Backends with data always run every tile.
enum class tile_sweep : std::uint8_t { every_tile, distinct_shapes };

// Whether a mixture-of-experts model's load-balancing loss (router_aux_loss_coef times
// transformers' load_balancing_loss_func) joins the loss: as config.json's
// output_router_logits says (transformers' rule), or on, or off.
enum class router_aux_loss : std::uint8_t { config, on, off };
// "config", "on" or "off" (--router-aux-loss); throws config_error naming the value.
router_aux_loss parse_router_aux_loss(std::string_view text);

struct step_options {
  std::int64_t mlp_tile = 0;    // tokens per MLP/RMSNorm tile; 0: with_default_sizes
  std::int64_t loss_chunk = 0;  // tokens per cross-entropy chunk; 0: with_default_sizes
  checkpoint_policy policy;
  bool overlap_comm = false;  // see attention_config::overlap_comm
  attention_dtype attention_arithmetic = attention_dtype::bf16;  // see attention_config::arithmetic
  // Local tokens beyond which the attention backward norms its input this many rows at a
  // time rather than holding the whole normed shard (layer_backward).
  std::int64_t attention_input_tile = 65536;
  // ZeRO-3: gather the next layer's weights while this layer computes (one more layer's
  // weights held meanwhile).
  bool prefetch_weights = false;
  // LoRA: the adapters the step trains, from a store of their own beside the frozen base
  // (none: every weight is the store's to train).
  lora_config lora{};
  tile_sweep meta_tiles = tile_sweep::distinct_shapes;
  router_aux_loss router_aux = router_aux_loss::config;
  moe_options moe{};  // a sparse layer's GEMMs, capacity and routing log
};

// The MLP tile and the loss chunk where `o` gives none (0). Their GEMMs want a few
// thousand tokens (on the H200, 2K-token tiles cost llama3.2-1b 10% of its MLP time and
// 256 MiB of logits a quarter of llama3-8b's loss time): up to max_mlp_tile tokens and
// max_logits_bytes of f32 logits. Each one's buffers take at most 1/64 of the GPU arena
// (`device_bytes`; a tile has 256 tokens at least), so that on a small GPU they cost no
// sequence length.
inline constexpr std::int64_t max_mlp_tile = 8192;
inline constexpr std::size_t max_logits_bytes = std::size_t{2} << 30;
// Under expert parallelism over `expert_parallel` ranks a tile's share also holds what its
// rank may receive from the EP group (model/moe_exchange.hpp's worst case).
step_options with_default_sizes(step_options o, const model_config& model, std::size_t device_bytes,
                                int expert_parallel = 1);

// This rank's shard of one sequence: token ids and next-token labels (negative = masked).
struct local_batch {
  std::span<const std::int32_t> ids, labels;
  double grad_scale = 1.0;  // 1 / (unmasked labels over all ranks): the loss is their mean
  // Packed documents: the global indices where documents begin, the first 0 (empty: one
  // document). Attention stays inside a document and RoPE positions restart with each.
  std::span<const std::int64_t> documents;
  // Mixture of experts: the sequence's tokens before padding (0: every position), whose
  // routing the load-balancing loss counts, and that loss's share of the objective (1 / the
  // step's sequences: each sequence's loss is computed over its own tokens).
  std::int64_t real_tokens = 0;
  double aux_scale = 1.0;
};

// The attention configuration a model run implies at global length seq_len, for layer
// `layer` (its window and RoPE).
attention_config attention_config_for(const model_config& model, const cp_settings& cp, std::int64_t seq_len,
                                      int layer = 0);
// Can a hybrid's Gated DeltaNet layers run under this CP configuration (a head layout needs
// C to divide their value heads, cp/delta_layer.hpp)? True for a model without them.
bool linear_layers_run(const model_config& model, const cp_settings& cp);

class transformer {
 public:
  // `experts`: the EP group under expert parallelism (the stores then hold this rank's
  // experts alone: parameter_store's expert_sharding), null without.
  transformer(const model_config& model, const cp_settings& cp, std::int64_t seq_len, backend& be,
              const cp_groups& groups, const step_options& options, communicator* experts = nullptr);

  std::int64_t local_tokens() const { return tokens_; }
  // Global positions of rank r's local tokens (the strategy's sequence layout).
  std::vector<position_run> local_positions(int rank) const { return attentions_[0]->strategy().local_positions(rank); }
  std::int64_t mlp_tile() const { return mlp_tile_; }
  // Does the load-balancing loss join the loss (step_options::router_aux and the config)?
  bool aux_loss_on() const { return aux_on_; }
  // The last forward_backward's load-balancing loss over the whole sequence (the same on
  // every rank of the CP group), before router_aux_loss_coef and aux_scale; 0 when off.
  double aux_loss() const { return aux_loss_; }
  std::int64_t loss_chunk() const { return loss_chunk_; }

  // Forward and backward; weight gradients go to the store (accumulated when
  // replicated, reduce-scattered unit by unit otherwise). Returns this rank's sum of
  // per-token losses (fp64) over its unmasked labels. With LoRA (step_options::lora),
  // `adapters` holds the adapters and takes their gradients; `params` is then frozen.
  double forward_backward(parameter_store& params, const local_batch& batch, parameter_store* adapters = nullptr);

  // Forward only, with no checkpoint and no gradient (evaluation): each local token's
  // cross-entropy against its label (fp32, 0 where masked), and the argmax token of the
  // logits at the local rows `argmax_rows` (only those rows' logits leave the device).
  struct scores {
    std::vector<float> losses;          // local_tokens()
    std::vector<std::int32_t> argmax;   // argmax_rows.size()
  };
  scores forward_scores(parameter_store& params, const local_batch& batch, std::span<const std::int64_t> argmax_rows = {},
                        parameter_store* adapters = nullptr);

 private:
  struct mlp_tile_buffers {
    tensor h, rstd, gate, up;  // (n, D), (n, 1) f32, (n, F), (n, F)
  };
  mlp_tile_buffers mlp_tile_inputs(const layer_params& p, const mat_view& xt);
  // The start of the tile after the one at t0 (tiles of `tile` rows over the shard), as
  // step_options::meta_tiles says.
  std::int64_t next_tile(std::int64_t t0, std::int64_t tile) const;
  tensor upload_ids(std::span<const std::int32_t> values, const char* label);
  attention_layer& attention(int layer) { return *attentions_[static_cast<std::size_t>(layer_attention_[layer])]; }
  bool linear(int layer) const { return model_.linear_layer(layer); }
  void set_documents(std::span<const std::int64_t> documents);
  float norm_eps() const { return static_cast<float>(model_.rms_norm_eps); }
  float norm_offset() const { return model_.traits().norm_offset; }
  bool post_norms() const { return model_.traits().norms == block_norms::pre_and_post; }
  tensor layer_forward(int layer, const layer_params& p, const tensor& x, mem_tag out_tag,
                       attention_layer::context* keep);
  // The layer's attention (its output projection included) added to `residual`, through the
  // norm after attention where the family has one; with `keep_projection` the projection
  // before that norm is returned (and its 1/rms in *rstd) for the backward.
  attention_layer::context attention_into_residual(int layer, const layer_params& p, const normed_input& h,
                                                   const tensor& residual, const attention_layer::context* kept,
                                                   tensor* projection_out, tensor* rstd);
  void mlp_forward(int layer, const layer_params& p, const tensor& x);
  // A sparse layer's MLP, a tile at a time as the dense one's.
  void moe_forward(int layer, const layer_params& p, const tensor& x);
  void moe_backward(int layer, const layer_params& p, const layer_gradients& g, const tensor& x, const tensor& d);
  // The load-balancing loss: which local rows count (before forward), and after the forward
  // the routing's statistics summed over the CP group, the loss and its gradient.
  void start_balance(const local_batch& batch);
  void finish_balance(double aux_scale);
  // y (+)= a tile's down projection, through the norm after the MLP where the family has one.
  void mlp_output(const layer_params& p, const mat_view& act, const mat_view& y);
  void mlp_backward(int layer, const layer_params& p, const layer_gradients& g, const tensor& x, const tensor& d);
  // checkpoint_ahead > 0: prefetch that layer's input checkpoint once past the peak.
  void layer_backward(int layer, const layer_params& p, const layer_gradients& g, const tensor& x, const tensor& d,
                      int checkpoint_ahead = 0);
  // A layer's weights (and gradients), with its adapters beside them under LoRA.
  layer_params layer_weights(const parameter_store& params, const parameter_store* adapters, int layer) const;
  layer_gradients layer_grads(const parameter_store& params, const parameter_store* adapters, int layer) const;
  void acquire_layer(parameter_store& params, parameter_store* adapters, int layer);
  void release_layer(parameter_store& params, parameter_store* adapters, int layer);
  double loss_forward_backward(parameter_store& params, const tensor& x, const tensor& labels, double grad_scale,
                               const tensor& d_x);
  tensor embed(parameter_store& params, const tensor& ids);
  // The final RMSNorm and the lm head on rows of the final hidden state: the normed rows
  // (work dtype; the head's gradient reads them), their rstd (the norm's backward) and the
  // f32 logits (n, V). The caller holds the head acquired (with the embedding when tied).
  struct head_rows {
    tensor normed, rstd, logits;
  };
  head_rows head_forward(parameter_store& params, const mat_view& x);
  void acquire_head(parameter_store& params);  // the lm head, and the embedding when tied
  void release_head(parameter_store& params);
  void forward_layers(parameter_store& params, parameter_store* adapters, tensor x, checkpoint_store* store);
  void backward_layers(parameter_store& params, parameter_store* adapters, const tensor& ids, const tensor& d);
  void prefetch_layer(parameter_store& params, int layer);
  mem_tag input_tag(int layer) const;

  model_config model_;
  backend& be_;
  // One attention layer per distinct (window, RoPE) of the model's layers; layer l runs
  // attentions_[layer_attention_[l]].
  std::vector<std::unique_ptr<attention_layer>> attentions_;
  std::vector<int> layer_attention_;
  // The hybrids' Gated DeltaNet layers (one for all of them: they are alike), or none.
  std::unique_ptr<delta_layer> delta_;
  checkpoint_store store_;
  std::int64_t tokens_;  // s
  bool prefetch_weights_ = false;
  lora_config lora_;
  std::int64_t mlp_tile_, loss_chunk_;
  std::int64_t attention_input_tile_;
  tile_sweep meta_tiles_;
  tensor final_hidden_;  // (s, D): the last layer's output, input of the loss
  // Mixture of experts.
  communicator* cp_comm_;  // the whole CP group (the load-balancing statistics' sum)
  moe_mlp moe_;
  bool aux_on_ = false;
  bool collect_balance_ = false;       // the forward pass of forward_backward (not a recompute)
  std::vector<std::uint8_t> counted_rows_;  // local rows the load-balancing loss counts
  tensor counted_;                          // the same on the device: (s, 1) u8
  tensor balance_;                          // the step's sums (moe_balance_args::sums), read once a step
  double balance_rows_ = 0;                 // counted rows, over the sparse layers
  double aux_loss_ = 0;
  tensor aux_grad_;  // (1, E) f32: the loss's gradient on a counted row's router probabilities
};

}  // namespace upipe
