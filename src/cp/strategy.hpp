// Attention strategies under context parallelism. A strategy owns the QKV projection,
// RoPE and the attention itself; the layer (attention_layer.hpp) adds the output
// projection. Forward keeps only what backward needs (attention_saved).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "cp/attention_config.hpp"
#include "cp/projection.hpp"
#include "cp/stage_plan.hpp"

namespace upipe {

// Weights in the backend's working dtype, Hugging Face layout (y = x W^T); each
// projection with its LoRA adapter, if it has one.
struct attention_weights {
  projection wq;  // (H*d, D)
  projection wk;  // (K*d, D)
  projection wv;  // (K*d, D)
  projection wo;  // (D, H*d)
  mat_view q_norm, k_norm;  // (1, d) each, only with config.qk_norm
  // The hybrids' output gate (H*d, D): rows of q_proj beside each head's query rows; the
  // attention's output is multiplied by sigmoid(x W_gate^T) before wo (attention_layer).
  projection gate;
  bool gated() const { return gate.weight.rows > 0; }
};

// Weight gradients, f32, accumulated (+=) by backward; a frozen weight's are empty (no
// rows) and not computed.
struct attention_grads {
  projection_grads wq, wk, wv, wo;
  mat_view q_norm, k_norm;  // only with config.qk_norm
  projection_grads gate;    // with a gated attention
};

// The communicators a strategy runs over. One group today; a 2-D mesh (all-to-all
// inside a node, ring across nodes) passes two different groups.
struct cp_groups {
  communicator* all_to_all = nullptr;
  communicator* ring = nullptr;
};

// The attention's input rows x (s, D): whole, or x = RMSNorm(residual) made one token
// tile at a time, so that a backward at long S holds no normed copy of the sequence (the
// QKV projections and their weight gradients read x a tile at a time). Row by row the
// tiles equal the whole: RMSNorm is per row.
struct normed_input {
  mat_view whole;  // x itself, unless tiled
  bool tiled = false;
  mat_view residual, norm_weight;  // tiled: x = rmsnorm(residual) * (weight_offset + norm_weight)
  float eps = 0.0f, weight_offset = 0.0f;
  std::int64_t tile = 0;  // rows per tile

  normed_input(const mat_view& x) : whole(x) {}  // NOLINT(google-explicit-constructor): a whole input
  static normed_input of_tiles(const mat_view& residual, const mat_view& norm_weight, float eps, std::int64_t tile,
                               float weight_offset = 0.0f);
  std::int64_t row_count() const { return tiled ? residual.rows : whole.rows; }
  // Rows [first, first + count) of the input (a sequence chunk), whole or tiled as this one.
  normed_input rows(std::int64_t first, std::int64_t count) const;
};

// fn(first row, rows of x) over x: once with x itself when whole, else for each tile, normed
// into a buffer that lives for the call; a tiled pass also writes each row's 1/rms into
// `rstd` (s x 1, f32) when given.
using input_tile_fn = std::function<void(std::int64_t first, const mat_view& rows)>;
void for_each_input_tile(backend& be, const normed_input& x, const input_tile_fn& fn, const mat_view& rstd = {});

struct attention_saved {
  tensor lse;  // f32 log-sum-exp of the heads this rank attended, layout per strategy
};

class attention_strategy {
 public:
  virtual ~attention_strategy() = default;

  // The packed documents of the sequences that follow: global indices where documents
  // begin, sorted, the first 0 (empty: one document). A token then attends only within its
  // document and its RoPE position counts from the document's start.
  void set_documents(std::vector<std::int64_t> starts) {
    documents_ = std::move(starts);
    if (documents_.size() <= 1) documents_.clear();
    documents_changed();
  }
  const std::vector<std::int64_t>& documents() const { return documents_; }

  // Global positions of each local token of `rank` (the sequence layout).
  virtual std::vector<position_run> local_positions(int rank) const = 0;

  // What this rank's passes allocate, release and send (they are held to it as they run).
  virtual const stage_plan& plan() const = 0;

  // x (s, D) -> out (s, H*d), heads in their true order.
  virtual attention_saved forward(const mat_view& x, const attention_weights& w, const mat_view& out) = 0;

  // d_out (s, H*d) -> d_x (s, D) f32 and weight gradients, both accumulated. `out` is
  // the forward's output (recomputed or kept by the caller).
  virtual void backward(const attention_saved& saved, const normed_input& x, const attention_weights& w,
                        const mat_view& out, const mat_view& d_out, const mat_view& d_x,
                        const attention_grads& grads) = 0;

 protected:
  // The attention's mask over rows that start at global indices q_first and k_first.
  document_mask document_rows(std::int64_t q_first, std::int64_t k_first) const {
    return {documents_, q_first, k_first};
  }
  virtual void documents_changed() {}

 private:
  std::vector<std::int64_t> documents_;
};

// RoPE's runs for a layout's runs (positions = global indices) under packed documents:
// each run split where a document starts, its positions counted from that document's
// start.
std::vector<position_run> document_positions(const std::vector<position_run>& layout,
                                             std::span<const std::int64_t> starts);

// Validates the configuration (see validate()) and builds the strategy it names.
std::unique_ptr<attention_strategy> make_strategy(attention_config config, backend& be, const cp_groups& groups);

// Sequence layouts: which global positions rank r holds.
std::vector<position_run> contiguous_positions(std::int64_t seq_len, int cp, int rank);
std::vector<position_run> zigzag_positions(std::int64_t seq_len, int cp, int rank);

// A rank's shard of a global (S, width) host matrix: the rows `positions` names, in local
// order (width 1 for token ids and labels).
template <class T>
std::vector<T> shard_rows(const std::vector<T>& global, std::int64_t width, const std::vector<position_run>& positions,
                          std::int64_t local_tokens) {
  std::vector<T> out(static_cast<std::size_t>(local_tokens * width));
  for (const position_run& run : positions)
    std::copy_n(global.begin() + run.position_begin * width, run.count * width, out.begin() + run.token_begin * width);
  return out;
}

}  // namespace upipe
