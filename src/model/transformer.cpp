#include "model/transformer.hpp"

#include <algorithm>
#include <cmath>

#include "backend/ops.hpp"
#include "core/error.hpp"

namespace upipe {

namespace {

// dst (rows of the same shape) = src, converting dtypes.
void copy_matrix(backend& be, const mat_view& dst, const mat_view& src) {
  ops::copy_heads(be, ops::as_heads(dst), ops::as_heads(src));
}


}  // namespace

attention_config attention_config_for(const model_config& model, const cp_settings& cp, std::int64_t seq_len,
                                      int layer) {
  attention_config c;
  c.seq_len = seq_len;
  c.heads = model.num_heads;
  c.kv_heads = model.num_kv_heads;
  c.head_dim = model.head_dim;
  c.model_dim = model.hidden_size;
  c.cp = cp.cp;
  c.head_chunk = cp.head_chunk;
  c.ring = cp.ring;
  c.seq_chunks = cp.seq_chunks;
  c.strategy = cp.strategy;
  c.rope = model.layer_rope(layer);
  c.window = model.layer_window(layer);
  c.qk_norm = model.qk_norm;
  c.norm_eps = static_cast<float>(model.rms_norm_eps);
  c.norm_offset = model.traits().norm_offset;
  if (model.query_pre_attn_scalar > 0) c.score_scale = 1.0 / std::sqrt(model.query_pre_attn_scalar);
  validate(c);
  return c;
}

namespace {
// The Gated DeltaNet layers' configuration: the model's sizes, the attention's CP layout.
delta_config delta_config_for(const model_config& model, const attention_config& attention, const step_options& options) {
  const linear_attention_config& l = model.linear;
  delta_config c{.model_dim = model.hidden_size, .key_heads = l.key_heads, .value_heads = l.value_heads,
                 .key_dim = l.key_dim, .value_dim = l.value_dim, .conv_kernel = l.conv_kernel,
                 .norm_eps = static_cast<float>(model.rms_norm_eps), .seq_len = attention.seq_len, .cp = attention.cp,
                 .strategy = attention.strategy, .head_chunk = attention.head_chunk, .seq_chunks = attention.seq_chunks};
  c.frozen = options.lora.enabled();
  return c;
}

// The layer's step options: the overlapped output exchange, the backward's input tiles, and
// under LoRA the q/k/v projections that train nothing (a frozen weight without an adapter).
// Do two layers attend alike (the same window and RoPE; every other setting is the model's)?
bool same_pattern(const attention_config& a, const attention_config& b) {
  return a.window == b.window && a.rope == b.rope;
}

attention_config with_step_options(attention_config c, const step_options& options) {
  c.overlap_comm = options.overlap_comm;
  c.arithmetic = options.attention_arithmetic;
  c.input_tile = options.attention_input_tile;
  if (options.lora.enabled()) {
    c.frozen_q = !options.lora.adapts(lora_target::q);
    c.frozen_k = !options.lora.adapts(lora_target::k);
    c.frozen_v = !options.lora.adapts(lora_target::v);
  }
  return c;
}
}  // namespace

bool linear_layers_run(const model_config& model, const cp_settings& cp) {
  if (model.linear_layer_count() == 0) return true;
  try {
    attention_config unit;
    unit.strategy = cp.strategy;
    unit.cp = cp.cp;
    const std::int64_t seq_len = unit.layout_unit() * std::max(cp.seq_chunks, 1) * 64;  // any length the layout takes
    validate(delta_config_for(model, attention_config_for(model, cp, seq_len), {}), model.num_heads);
    return true;
  } catch (const config_error&) {
    return false;
  }
}

transformer::transformer(const model_config& model, const cp_settings& cp, std::int64_t seq_len, backend& be,
                         const cp_groups& groups, const step_options& options, communicator* experts)
    : model_(model), be_(be), store_(be, options.policy, model.num_layers), tokens_(seq_len / cp.cp),
      prefetch_weights_(options.prefetch_weights), lora_(options.lora),
      attention_input_tile_(options.attention_input_tile), meta_tiles_(options.meta_tiles),
      cp_comm_(groups.all_to_all),
      moe_(model_, be, options.moe, groups.all_to_all != nullptr ? groups.all_to_all->rank() : 0, experts) {
  aux_on_ = model.sparse_layer_count() > 0 &&
            (options.router_aux == router_aux_loss::on ||
             (options.router_aux == router_aux_loss::config && model.moe.output_router_logits));
  if (attention_input_tile_ <= 0)
    throw config_error("attention_input_tile " + std::to_string(attention_input_tile_) +
                       " must be a positive row count");
  // Layers of one window and RoPE share an attention layer (its strategy and stage plans).
  std::vector<attention_config> configs;
  for (int l = 0; l < model.num_layers; ++l) {
    const attention_config c = with_step_options(attention_config_for(model, cp, seq_len, l), options);
    std::size_t i = 0;
    while (i < configs.size() && !same_pattern(configs[i], c)) ++i;
    if (i == configs.size()) {
      configs.push_back(c);
      attentions_.push_back(std::make_unique<attention_layer>(c, be, groups));
    }
    layer_attention_.push_back(static_cast<int>(i));
  }
  if (model.linear_layer_count() > 0) {
    std::vector<std::vector<position_run>> layout;
    for (int r = 0; r < cp.cp; ++r) layout.push_back(attentions_[0]->strategy().local_positions(r));
    delta_ = std::make_unique<delta_layer>(delta_config_for(model, attentions_[0]->config(), options), model.num_heads,
                                           be, groups, std::move(layout));
  }
  const step_options sized =
      with_default_sizes(options, model, be.device_arena().capacity(), experts == nullptr ? 1 : experts->size());
  mlp_tile_ = std::min(sized.mlp_tile, tokens_);
  loss_chunk_ = std::min(sized.loss_chunk, tokens_);
}

step_options with_default_sizes(step_options o, const model_config& model, std::size_t device_bytes,
                                int expert_parallel) {
  if (o.mlp_tile < 0 || o.loss_chunk < 0)
    throw config_error("--mlp-tile " + std::to_string(o.mlp_tile) + " and --loss-chunk " +
                       std::to_string(o.loss_chunk) + " must be positive token counts, or 0 for the default");
  const std::int64_t share = static_cast<std::int64_t>(device_bytes / 64);
  const std::int64_t D = model.hidden_size, V = model.vocab_size;
  // A sparse layer's tile holds its k dispatched rows a token at once (the grouped GEMMs'
  // operands: in backward the rows, their output and its gradient at D and gate, up, the
  // activation and its gradient at I, bf16; d_x f32 once those went), the router's logits,
  // probabilities and their gradient (f32, E a token) and the routing (k i32 and f32 each).
  const moe_config& moe = model.moe;
  const bool sparse = model.sparse_layer_count() > 0;
  const std::int64_t F = sparse ? std::max({std::int64_t{model.sparse_layer_count() < model.num_layers ? model.intermediate_size : 0},
                                            std::int64_t{moe.expert_width}, std::int64_t{moe.shared_width}})
                                : model.intermediate_size;
  if (o.mlp_tile == 0) {
    // A tile's backward holds gate, up, their activation and its gradient (n x F each),
    // the normed rows and the incoming gradient's working copy (n x D each), in bf16.
    std::int64_t routed =
        sparse ? std::int64_t{moe.top_k} * (6 * D + 6 * moe.expert_width) + 12 * std::int64_t{moe.experts} + 24 * moe.top_k
               : 0;
    // Expert parallelism: a rank receives at most P min(k, L) rows a token of the tile
    // (model/moe_exchange.hpp), each held twice on arrival (received, then ordered), with
    // its experts' activations and gradients as a dispatched row's, and its expert id.
    if (sparse && expert_parallel > 1)
      routed += std::int64_t{expert_parallel} * std::min(moe.top_k, moe.experts / expert_parallel) *
                (10 * D + 6 * moe.expert_width + 12);
    const std::int64_t per_token = 2 * (4 * F + 2 * D) + 4 + routed;
    const std::int64_t granule = 256;
    o.mlp_tile = std::clamp(share / per_token / granule * granule, granule, max_mlp_tile);
  }
  if (o.loss_chunk == 0) {
    const std::int64_t logits = std::min(share, static_cast<std::int64_t>(max_logits_bytes));
    o.loss_chunk = std::max<std::int64_t>(1, logits / (4 * V));
  }
  return o;
}

tensor transformer::upload_ids(std::span<const std::int32_t> values, const char* label) {
  UPIPE_CHECK(static_cast<std::int64_t>(values.size()) == tokens_ || !be_.has_data(),
              "batch shard must hold the rank's local tokens");
  tensor t = be_.allocate(mem_tag::activations, dtype::i32, {tokens_, 1}, label);
  if (be_.has_data()) be_.upload_bytes(t, values.data(), values.size() * sizeof(std::int32_t));
  return t;
}

// Kept layer inputs live on as checkpoints; the rest are freed after their layer, so they
// are allocated under their final tag from the start.
mem_tag transformer::input_tag(int layer) const {
  return store_.keeps_input(layer) && store_.policy().where == checkpoint_location::device
             ? mem_tag::checkpoints_device
             : mem_tag::activations;
}

void transformer::set_documents(std::span<const std::int64_t> documents) {
  for (auto& a : attentions_) a->strategy().set_documents({documents.begin(), documents.end()});
  if (delta_) delta_->set_documents({documents.begin(), documents.end()});
}

namespace {
// The embedding's scale: Gemma's sqrt(D), kept by transformers as an fp32 tensor and cast to
// the weights' dtype, which is the working dtype here.
float embedding_multiplier(const model_config& model, dtype work) {
  if (model.traits().embedding == embedding_scaling::none) return 1.0f;
  const auto scale = static_cast<float>(std::sqrt(static_cast<double>(model.hidden_size)));
  return work == dtype::bf16 ? round_to_bf16(scale) : scale;
}
}  // namespace

tensor transformer::embed(parameter_store& params, const tensor& ids) {
  tensor x = be_.allocate(input_tag(0), be_.work_dtype(), {tokens_, model_.hidden_size}, "layer_input");
  params.acquire(params.embedding_unit());
  ops::embedding_forward(be_, {params.embedding(), ids.matrix(), x.matrix(), embedding_multiplier(model_, be_.work_dtype())});
  params.release(params.embedding_unit());
  return x;
}

double transformer::forward_backward(parameter_store& params, const local_batch& batch, parameter_store* adapters) {
  UPIPE_CHECK(lora_.enabled() == (adapters != nullptr), "a LoRA step needs its adapters' store, and only it does");
  set_documents(batch.documents);
  tensor ids = upload_ids(batch.ids, "token_ids");
  tensor labels = upload_ids(batch.labels, "labels");
  // The step's stages for its phase table (backend::set_stage).
  be_.set_stage("forward");
  start_balance(batch);
  forward_layers(params, adapters, embed(params, ids), &store_);
  finish_balance(batch.aux_scale);
  tensor d = be_.allocate(mem_tag::activations, dtype::f32, {tokens_, model_.hidden_size}, "d_hidden");
  be_.set_stage("loss");
  const double loss = loss_forward_backward(params, final_hidden_, labels, batch.grad_scale, d);
  final_hidden_.reset();
  be_.set_stage("backward");
  backward_layers(params, adapters, ids, d);
  aux_grad_.reset();
  counted_.reset();
  set_current_layer(-1);
  if (params.role() == weight_role::frozen) return loss;  // no gradient for the embedding
  const int embedding = params.embedding_unit();
  if (!params.grads_open(embedding)) params.open_grads(embedding);
  ops::embedding_backward(be_, {d.matrix(), ids.matrix(), params.embedding_grad(),
                                embedding_multiplier(model_, be_.work_dtype()), model_.padding_id});
  params.close_grads(embedding);
  return loss;
}

layer_params transformer::layer_weights(const parameter_store& params, const parameter_store* adapters,
                                        int layer) const {
  layer_params p = params.layer(layer);
  if (adapters != nullptr)
    attach_adapters(p, model_, lora_, layer, [adapters](const std::string& name) { return adapters->weight(name); });
  return p;
}

layer_gradients transformer::layer_grads(const parameter_store& params, const parameter_store* adapters,
                                         int layer) const {
  layer_gradients g = as_gradients(params.layer_grads(layer));
  if (adapters != nullptr)
    attach_adapter_grads(g, model_, lora_, layer, [adapters](const std::string& name) { return adapters->grad(name); });
  return g;
}

void transformer::acquire_layer(parameter_store& params, parameter_store* adapters, int layer) {
  params.acquire(params.layer_unit(layer));
  if (adapters != nullptr) adapters->acquire(adapters->layer_unit(layer));
}

void transformer::release_layer(parameter_store& params, parameter_store* adapters, int layer) {
  if (adapters != nullptr) adapters->release(adapters->layer_unit(layer));
  params.release(params.layer_unit(layer));
}

void transformer::forward_layers(parameter_store& params, parameter_store* adapters, tensor x, checkpoint_store* store) {
  for (int l = 0; l < model_.num_layers; ++l) {
    attention_layer::context ctx;
    const bool keep_input = store != nullptr && store->keeps_input(l);
    const bool keep_attention = store != nullptr && store->keeps_attention(l) && !linear(l);
    const mem_tag out_tag = l + 1 < model_.num_layers && store != nullptr ? input_tag(l + 1) : mem_tag::activations;
    set_current_layer(l);
    // A kept input goes out to the host (when it goes there) while its layer runs.
    if (keep_input) store->start_offload(l, checkpoint_store::item::input, x);
    acquire_layer(params, adapters, l);
    if (l + 1 < model_.num_layers) prefetch_layer(params, l + 1);
    tensor y = layer_forward(l, layer_weights(params, adapters, l), x, out_tag, keep_attention ? &ctx : nullptr);
    release_layer(params, adapters, l);
    if (keep_input) store->save(l, checkpoint_store::item::input, std::move(x));
    if (keep_attention) {
      store->save(l, checkpoint_store::item::attention_out, std::move(ctx.out));
      store->save(l, checkpoint_store::item::attention_lse, std::move(ctx.saved.lse));
    }
    x = std::move(y);
  }
  final_hidden_ = std::move(x);
  set_current_layer(-1);
}

transformer::head_rows transformer::head_forward(parameter_store& params, const mat_view& x) {
  const std::int64_t n = x.rows;
  head_rows out{be_.allocate(mem_tag::activations, be_.work_dtype(), {n, model_.hidden_size}, "final_norm_out"),
                be_.allocate(mem_tag::activations, dtype::f32, {n, 1}, "final_norm_rstd"), tensor()};
  ops::rmsnorm_forward(be_, {x, params.final_norm(), out.normed.matrix(), out.rstd.matrix(),
                             norm_eps(), norm_offset()});
  out.logits = be_.allocate(mem_tag::workspace, dtype::f32, {n, model_.vocab_size}, "logits");
  ops::gemm(be_, {out.normed.matrix(), transpose::none, params.lm_head(), transpose::yes, out.logits.matrix()});
  return out;
}

void transformer::acquire_head(parameter_store& params) {
  params.acquire(params.head_unit());
  if (model_.tie_embeddings) params.acquire(params.embedding_unit());
}

void transformer::release_head(parameter_store& params) {
  if (model_.tie_embeddings) params.release(params.embedding_unit());
  params.release(params.head_unit());
}

transformer::scores transformer::forward_scores(parameter_store& params, const local_batch& batch,
                                                std::span<const std::int64_t> argmax_rows, parameter_store* adapters) {
  UPIPE_CHECK(lora_.enabled() == (adapters != nullptr), "a LoRA model scores with its adapters' store, and only it does");
  set_documents(batch.documents);
  tensor ids = upload_ids(batch.ids, "token_ids");
  tensor labels = upload_ids(batch.labels, "labels");
  forward_layers(params, adapters, embed(params, ids), nullptr);
  const phase_scope phase(be_, "loss");
  acquire_head(params);
  const std::int64_t V = model_.vocab_size;
  // The losses and one row of logits (for the argmax) on the host; none on meta, which has
  // no values (the planner's probes reach 2^30 tokens and vocabularies of 2^31).
  scores out{std::vector<float>(be_.has_data() ? static_cast<std::size_t>(tokens_) : 0, 0.0f),
             std::vector<std::int32_t>(argmax_rows.size(), 0)};
  std::vector<float> row(argmax_rows.empty() || !be_.has_data() ? 0 : static_cast<std::size_t>(V));
  tensor row_loss = be_.allocate(mem_tag::activations, dtype::f32, {tokens_, 1}, "row_loss");
  for (std::int64_t t0 = 0; t0 < tokens_; t0 = next_tile(t0, loss_chunk_)) {
    const std::int64_t n = std::min(loss_chunk_, tokens_ - t0);
    tensor logits = std::move(head_forward(params, final_hidden_.matrix().row_block(t0, n)).logits);
    for (std::size_t i = 0; i < argmax_rows.size(); ++i) {
      const std::int64_t r = argmax_rows[i];
      UPIPE_CHECK(r >= 0 && r < tokens_, "argmax row " + std::to_string(r) + " is not local");
      if (r < t0 || r >= t0 + n) continue;
      tensor one = be_.allocate(mem_tag::workspace, dtype::f32, {1, V}, "argmax_row");
      copy_matrix(be_, one.matrix(), logits.matrix().row_block(r - t0, 1));
      if (!be_.has_data()) continue;
      be_.download_f32(row.data(), one);
      out.argmax[i] = static_cast<std::int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
    }
    ops::cross_entropy(be_, {logits.matrix(), labels.matrix().row_block(t0, n), row_loss.matrix().row_block(t0, n), 0.0f});
  }
  release_head(params);
  final_hidden_.reset();
  if (be_.has_data()) be_.download_f32(out.losses.data(), row_loss);
  return out;
}

tensor transformer::layer_forward(int layer, const layer_params& p, const tensor& x, mem_tag out_tag,
                                  attention_layer::context* keep) {
  const std::int64_t D = model_.hidden_size;
  tensor out = be_.allocate(out_tag, be_.work_dtype(), {tokens_, D}, "layer_output");
  copy_matrix(be_, out.matrix(), x.matrix());
  {
    tensor h = be_.allocate(mem_tag::activations, be_.work_dtype(), {tokens_, D}, "attn_norm_out");
    tensor rstd = be_.allocate(mem_tag::activations, dtype::f32, {tokens_, 1}, "attn_norm_rstd");
    ops::rmsnorm_forward(be_, {x.matrix(), p.input_norm, h.matrix(), rstd.matrix(), norm_eps(), norm_offset()});
    rstd.reset();
    if (linear(layer)) {
      delta_->forward(h.matrix(), p.linear, out.matrix(), projection_mode::accumulate);
    } else {
      attention_layer::context ctx = attention_into_residual(layer, p, h.matrix(), out, nullptr, nullptr, nullptr);
      if (keep != nullptr) *keep = std::move(ctx);
    }
  }
  mlp_forward(layer, p, out);
  return out;
}

attention_layer::context transformer::attention_into_residual(int layer, const layer_params& p, const normed_input& h,
                                                              const tensor& residual,
                                                              const attention_layer::context* kept,
                                                              tensor* projection_out, tensor* rstd) {
  attention_layer& attention = this->attention(layer);
  attention_layer::context ctx;
  if (!post_norms()) {
    if (kept != nullptr)
      attention.project_output(*kept, h, p.attention, residual.matrix(), projection_mode::accumulate);
    else
      ctx = attention.forward(h.whole, p.attention, residual.matrix(), projection_mode::accumulate);
    return ctx;
  }
  // Gemma 3: residual += RMSNorm(attention's projection).
  tensor a = be_.allocate(mem_tag::activations, be_.work_dtype(), residual.dims(), "attn_proj_out");
  if (kept != nullptr)
    attention.project_output(*kept, h, p.attention, a.matrix(), projection_mode::overwrite);
  else
    ctx = attention.forward(h.whole, p.attention, a.matrix(), projection_mode::overwrite);
  tensor normed = be_.allocate(mem_tag::activations, be_.work_dtype(), residual.dims(), "attn_post_norm_out");
  tensor a_rstd = be_.allocate(mem_tag::activations, dtype::f32, {tokens_, 1}, "attn_post_norm_rstd");
  ops::rmsnorm_forward(be_, {a.matrix(), p.attention_post_norm, normed.matrix(), a_rstd.matrix(), norm_eps(), norm_offset()});
  ops::add_heads(be_, ops::as_heads(residual.matrix()), ops::as_heads(normed.matrix()));
  if (projection_out != nullptr) *projection_out = std::move(a);
  if (rstd != nullptr) *rstd = std::move(a_rstd);
  return ctx;
}

std::int64_t transformer::next_tile(std::int64_t t0, std::int64_t tile) const {
  const std::int64_t next = t0 + tile;
  if (be_.has_data() || meta_tiles_ == tile_sweep::every_tile || next >= tokens_) return next;
  return tokens_ % tile == 0 ? tokens_ : std::max(next, (tokens_ - 1) / tile * tile);
}

// The inputs of one MLP tile: its normed rows (and their 1/rms) and both projections.
transformer::mlp_tile_buffers transformer::mlp_tile_inputs(const layer_params& p, const mat_view& xt) {
  const std::int64_t n = xt.rows, D = model_.hidden_size, F = model_.intermediate_size;
  mlp_tile_buffers t;
  t.h = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, D}, "mlp_norm_out");
  t.rstd = be_.allocate(mem_tag::activations, dtype::f32, {n, 1}, "mlp_norm_rstd");
  ops::rmsnorm_forward(be_, {xt, p.mlp_norm, t.h.matrix(), t.rstd.matrix(), norm_eps(), norm_offset()});
  t.gate = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, F}, "mlp_gate");
  t.up = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, F}, "mlp_up");
  linear_forward(be_, t.h.matrix(), p.gate, t.gate.matrix());
  linear_forward(be_, t.h.matrix(), p.up, t.up.matrix());
  return t;
}

void transformer::mlp_output(const layer_params& p, const mat_view& act, const mat_view& y) {
  if (!post_norms()) {
    linear_forward(be_, act, p.down, y, 1.0f);
    return;
  }
  // Gemma 3: y += RMSNorm(down(act)), normed in place.
  tensor m = be_.allocate(mem_tag::activations, be_.work_dtype(), {y.rows, y.cols}, "mlp_down_out");
  tensor rstd = be_.allocate(mem_tag::activations, dtype::f32, {y.rows, 1}, "mlp_post_norm_rstd");
  linear_forward(be_, act, p.down, m.matrix());
  ops::rmsnorm_forward(be_, {m.matrix(), p.mlp_post_norm, m.matrix(), rstd.matrix(), norm_eps(), norm_offset()});
  ops::add_heads(be_, ops::as_heads(y), ops::as_heads(m.matrix()));
}

// x += down(act(gate(norm(x))) * up(norm(x))), one tile of tokens at a time, so the MLP's
// working set is a tile whatever the sequence length.
void transformer::mlp_forward(int layer, const layer_params& p, const tensor& x) {
  if (p.moe.sparse()) return moe_forward(layer, p, x);
  const phase_scope phase(be_, "mlp");
  for (std::int64_t t0 = 0; t0 < tokens_; t0 = next_tile(t0, mlp_tile_)) {
    const mat_view xt = x.matrix().row_block(t0, std::min(mlp_tile_, tokens_ - t0));
    mlp_tile_buffers t = mlp_tile_inputs(p, xt);
    t.h.reset();
    t.rstd.reset();
    tensor act = be_.allocate(mem_tag::activations, be_.work_dtype(), t.gate.dims(), "mlp_act");
    ops::swiglu_forward(be_, {t.gate.matrix(), t.up.matrix(), act.matrix(), model_.activation});
    t = {};
    mlp_output(p, act.matrix(), xt);
  }
}

// d (f32) holds d(layer output) and becomes d(x2), the gradient at the MLP's input
// residual; x2 is the recomputed input of the MLP block.
void transformer::mlp_backward(int layer, const layer_params& p, const layer_gradients& g, const tensor& x2,
                               const tensor& d) {
  if (p.moe.sparse()) return moe_backward(layer, p, g, x2, d);
  const phase_scope phase(be_, "mlp");
  const std::int64_t D = model_.hidden_size, F = model_.intermediate_size;
  for (std::int64_t t0 = 0; t0 < tokens_; t0 = next_tile(t0, mlp_tile_)) {
    const std::int64_t n = std::min(mlp_tile_, tokens_ - t0);
    const mat_view xt = x2.matrix().row_block(t0, n), dt = d.matrix().row_block(t0, n);
    mlp_tile_buffers t = mlp_tile_inputs(p, xt);
    tensor &h = t.h, &rstd = t.rstd, &gate = t.gate, &up = t.up;
    tensor d_act = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, F}, "mlp_d_act");
    {
      tensor act = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, F}, "mlp_act");
      ops::swiglu_forward(be_, {gate.matrix(), up.matrix(), act.matrix(), model_.activation});
      tensor d_out;
      if (post_norms()) {
        // Through the norm after the MLP: its input, down(act), is recomputed here.
        tensor m = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, D}, "mlp_down_out");
        tensor m_rstd = be_.allocate(mem_tag::activations, dtype::f32, {n, 1}, "mlp_post_norm_rstd");
        linear_forward(be_, act.matrix(), p.down, m.matrix());
        tensor normed = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, D}, "mlp_post_norm_out");
        ops::rmsnorm_forward(be_, {m.matrix(), p.mlp_post_norm, normed.matrix(), m_rstd.matrix(), norm_eps(),
                                   norm_offset()});
        normed.reset();
        d_out = be_.allocate(mem_tag::activations, be_.work_dtype(), {n, D}, "mlp_d_out");
        ops::rmsnorm_backward(be_, {m.matrix(), p.mlp_post_norm, m_rstd.matrix(), dt, d_out.matrix(), g.mlp_post_norm,
                                    norm_offset()});
      } else {
        d_out = working_copy(be_, dt, "mlp_d_out");
      }
      linear_backward(be_, act.matrix(), d_out.matrix(), p.down, g.down, d_act.matrix(), 0.0f);
    }
    // In place: gate and up become their gradients.
    ops::swiglu_backward(be_, {gate.matrix(), up.matrix(), d_act.matrix(), gate.matrix(), up.matrix(), model_.activation});
    d_act.reset();
    // d_h (f32) is held beside h here: less than the tile's peak above whenever D < 2F.
    tensor d_h = be_.allocate(mem_tag::activations, dtype::f32, {n, D}, "mlp_d_norm_out");
    linear_backward(be_, h.matrix(), gate.matrix(), p.gate, g.gate, d_h.matrix(), 0.0f);
    linear_backward(be_, h.matrix(), up.matrix(), p.up, g.up, d_h.matrix(), 1.0f);
    h.reset();
    ops::rmsnorm_backward(be_, {xt, p.mlp_norm, rstd.matrix(), d_h.matrix(), d_h.matrix(), g.mlp_norm, norm_offset()});
    ops::add_heads(be_, ops::as_heads(dt), ops::as_heads(d_h.matrix()));
  }
}

void transformer::layer_backward(int layer, const layer_params& p, const layer_gradients& g, const tensor& x,
                                 const tensor& d, int checkpoint_ahead) {
  const std::int64_t D = model_.hidden_size;
  const float eps = norm_eps();
  // A long shard's attention backward reads its normed input a tile at a time: the whole
  // would be one more (s, D) tensor at the layer's peak. The whole is made only for a
  // rerun of the attention forward, or for a short shard.
  const bool kept = store_.has(layer, checkpoint_store::item::attention_out);
  const bool tiled = tokens_ > attention_input_tile_;
  const normed_input tiles = normed_input::of_tiles(x.matrix(), p.input_norm, eps, attention_input_tile_, norm_offset());
  tensor rstd = be_.allocate(mem_tag::activations, dtype::f32, {tokens_, 1}, "attn_norm_rstd");
  tensor h;
  if (kept && tiled) {
    for_each_input_tile(be_, tiles, [](std::int64_t, const mat_view&) {}, rstd.matrix());  // its 1/rms alone
  } else {
    h = be_.allocate(mem_tag::activations, be_.work_dtype(), {tokens_, D}, "attn_norm_out");
    ops::rmsnorm_forward(be_, {x.matrix(), p.input_norm, h.matrix(), rstd.matrix(), eps, norm_offset()});
  }
  tensor x2 = be_.allocate(mem_tag::activations, be_.work_dtype(), {tokens_, D}, "attn_residual");
  copy_matrix(be_, x2.matrix(), x.matrix());
  attention_layer::context ctx;
  delta_layer::context delta_ctx;
  tensor projected, projected_rstd;  // with a norm after attention: its input, for its backward
  if (linear(layer)) {
    delta_ctx = delta_->forward(h.matrix(), p.linear, x2.matrix(), projection_mode::accumulate);
  } else if (kept) {
    // The checkpoint kept the attention output: only the output projection reruns.
    ctx.out = store_.take(layer, checkpoint_store::item::attention_out, mem_tag::activations);
    ctx.saved.lse = store_.take(layer, checkpoint_store::item::attention_lse, mem_tag::activations);
    attention_into_residual(layer, p, tiled ? tiles : normed_input(h.matrix()), x2, &ctx, &projected, &projected_rstd);
  } else {
    ctx = attention_into_residual(layer, p, h.matrix(), x2, nullptr, &projected, &projected_rstd);
  }
  const normed_input attention_input = tiled ? tiles : normed_input(h.matrix());
  if (tiled) h.reset();
  mlp_backward(layer, p, g, x2, d);
  x2.reset();
  tensor d_y;
  if (post_norms()) {
    d_y = be_.allocate(mem_tag::activations, be_.work_dtype(), {tokens_, D}, "attn_d_y");
    ops::rmsnorm_backward(be_, {projected.matrix(), p.attention_post_norm, projected_rstd.matrix(), d.matrix(),
                                d_y.matrix(), g.attention_post_norm, norm_offset()});
    projected.reset();
    projected_rstd.reset();
  } else {
    d_y = working_copy(be_, d.matrix(), "attn_d_y");
  }
  tensor d_h = be_.allocate_zeroed(mem_tag::activations, dtype::f32, {tokens_, D}, "attn_d_norm_out");
  if (linear(layer))
    delta_->backward(delta_ctx, attention_input, p.linear, std::move(d_y), d_h.matrix(), g.linear);
  else
    attention(layer).backward(ctx, attention_input, p.attention, std::move(d_y), d_h.matrix(), g.attention);
  ctx = {};
  delta_ctx = {};
  // Past the layer's peak (the attention backward), so the early copy costs no memory at it.
  if (checkpoint_ahead > 0) store_.prefetch(checkpoint_ahead, checkpoint_store::item::input, mem_tag::activations);
  ops::rmsnorm_backward(be_, {x.matrix(), p.input_norm, rstd.matrix(), d_h.matrix(), d_h.matrix(), g.input_norm,
                              norm_offset()});
  ops::add_heads(be_, ops::as_heads(d.matrix()), ops::as_heads(d_h.matrix()));
}

// With the parameters in host memory every layer comes to the device ahead of its use.
void transformer::prefetch_layer(parameter_store& params, int layer) {
  if (prefetch_weights_ || params.params_offloaded()) params.prefetch(params.layer_unit(layer));
}

// Backward, newest layer first. A layer whose input was not kept belongs to a block
// whose first input was: the block's inputs are recomputed from it, then consumed.
// Each layer's gradients are complete when its backward ends, and are closed (reduced).
void transformer::backward_layers(parameter_store& params, parameter_store* adapters, const tensor& ids,
                                  const tensor& d) {
  std::vector<tensor> inputs;  // recomputed inputs of the current block, oldest first
  for (int l = model_.num_layers - 1; l >= 0; --l) {
    if (inputs.empty()) {
      const int start = store_.block_start(l);
      // Layer 0's input was not kept (checkpoint_store::keeps_input): the ids' embedding.
      inputs.push_back(start == 0 ? embed(params, ids)
                                  : store_.take(start, checkpoint_store::item::input, mem_tag::activations));
      for (int j = start; j < l; ++j) {
        set_current_layer(j);
        acquire_layer(params, adapters, j);
        prefetch_layer(params, j + 1);  // the next to be acquired: j + 1 <= l
        inputs.push_back(
            layer_forward(j, layer_weights(params, adapters, j), inputs.back(), mem_tag::activations, nullptr));
        release_layer(params, adapters, j);
      }
    }
    set_current_layer(l);
    const int unit = params.layer_unit(l);
    acquire_layer(params, adapters, l);
    // Next acquired: layer l - 1 if its input is already recomputed, else the first
    // layer of the previous block (its recompute, or its backward for a block of one).
    if (l > 0) prefetch_layer(params, l > store_.block_start(l) ? l - 1 : store_.block_start(l - 1));
    params.open_grads(unit);
    if (adapters != nullptr) adapters->open_grads(adapters->layer_unit(l));
    // The last layer of a block to go back prefetches the next block's checkpoint.
    const int next_start = l > 0 && l == store_.block_start(l) ? store_.block_start(l - 1) : 0;
    layer_backward(l, layer_weights(params, adapters, l), layer_grads(params, adapters, l), inputs.back(), d,
                   next_start);
    if (adapters != nullptr) adapters->close_grads(adapters->layer_unit(l));
    params.close_grads(unit);
    release_layer(params, adapters, l);
    inputs.pop_back();
  }
}

// Final RMSNorm and the fused linear + cross-entropy, a chunk of tokens at a time: f32
// logits exist for one chunk only; d_x (f32) and the lm head's gradient accumulate.
double transformer::loss_forward_backward(parameter_store& params, const tensor& x, const tensor& labels,
                                          double grad_scale, const tensor& d_x) {
  const phase_scope phase(be_, "loss");
  const std::int64_t D = model_.hidden_size;
  const int head = params.head_unit(), embedding = params.embedding_unit();
  params.acquire(head);
  params.open_grads(head);
  if (model_.tie_embeddings) {  // the lm head is the embedding: its gradient stays open until the embedding's backward
    params.acquire(embedding);
    params.open_grads(embedding);
  }
  tensor row_loss = be_.allocate(mem_tag::activations, dtype::f32, {tokens_, 1}, "row_loss");
  for (std::int64_t t0 = 0; t0 < tokens_; t0 = next_tile(t0, loss_chunk_)) {
    const std::int64_t n = std::min(loss_chunk_, tokens_ - t0);
    const mat_view xt = x.matrix().row_block(t0, n);
    head_rows rows = head_forward(params, xt);
    ops::cross_entropy(be_, {rows.logits.matrix(), labels.matrix().row_block(t0, n),
                             row_loss.matrix().row_block(t0, n), static_cast<float>(grad_scale)});
    tensor d_logits = working_copy(be_, rows.logits.matrix(), "d_logits");
    rows.logits.reset();
    tensor d_h = be_.allocate(mem_tag::activations, dtype::f32, {n, D}, "d_final_norm_out");
    ops::gemm(be_, {d_logits.matrix(), transpose::none, params.lm_head(), transpose::none, d_h.matrix()});
    if (const mat_view d_head = params.lm_head_grad(); d_head.rows > 0)  // none when frozen
      ops::gemm(be_, {d_logits.matrix(), transpose::yes, rows.normed.matrix(), transpose::none, d_head, 1.0f, 1.0f});
    ops::rmsnorm_backward(be_, {xt, params.final_norm(), rows.rstd.matrix(), d_h.matrix(),
                                d_x.matrix().row_block(t0, n), params.final_norm_grad(), norm_offset()});
  }
  if (model_.tie_embeddings) params.release(embedding);
  params.close_grads(head);
  params.release(head);
  if (!be_.has_data()) return 0.0;
  std::vector<float> losses(static_cast<std::size_t>(tokens_));
  be_.download_f32(losses.data(), row_loss);
  double sum = 0.0;
  for (float v : losses) sum += v;
  return sum;
}

}  // namespace upipe
