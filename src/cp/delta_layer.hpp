// The hybrids' Gated DeltaNet layer under context parallelism (docs/design.md section 13):
//
//   mixed = x [W_q; W_k; W_v]^T, z = x W_z^T, b = x W_b^T, a = x W_a^T      (local rows)
//   c = silu(causal depthwise conv(mixed)); q, k, v = c's channel blocks
//   g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
//   o = gated delta rule(l2norm(q) dk^-1/2, l2norm(k), v, g, beta)   (a dk x dv state per value head)
//   y (+)= (rmsnorm(o) w * silu(z)) W_out^T                            (per token and value head)
//
// Two ways to run it over a CP group, by the strategy's layout:
// - head layouts (ulysses, upipe without sequence chunks): an all-to-all brings whole
//   sequences of u = U / C value heads (and their key heads) to each rank, stage by stage, U
//   value heads a stage; the recurrence runs locally over the whole sequence, and a second
//   all-to-all brings the output back;
// - sequence layouts (ring and hybrid: zigzag halves; fpdt and upipe with chunks: strided
//   chunks): each rank runs its segments of the sequence with no all-to-all. The convolution
//   reads the Kc - 1 rows before each segment (its halo, from whichever rank holds them), and
//   the state entering each segment comes from every segment's summary (its transition and
//   local state, fp32, all-gathered and scanned in sequence order); the backward carries the
//   state's gradient the other way (each segment's summary of its d_initial, scanned back).
// Packed documents reset the state and the convolution at every start, in both ways.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "cp/attention_config.hpp"
#include "cp/attention_layer.hpp"
#include "cp/delta_weights.hpp"
#include "cp/strategy.hpp"
#include "ops/gated_delta/workspace.hpp"

namespace upipe {

struct delta_config {
  // The layer.
  int model_dim = 0;       // D
  int key_heads = 0;       // Hk
  int value_heads = 0;     // Hv, a multiple of Hk
  int key_dim = 0;         // dk
  int value_dim = 0;       // dv
  int conv_kernel = 0;     // Kc
  float norm_eps = 1e-6f;  // the gated RMSNorm's
  // The CP side, as the full-attention layers' (attention_config): S, C, the strategy, U and N.
  std::int64_t seq_len = 0;
  int cp = 1;
  strategy_kind strategy = strategy_kind::upipe;
  int head_chunk = 0;  // the attention's U; the value heads a stage take the same share
  int seq_chunks = 0;
  // LoRA: projections that train nothing (their backward norms no input tiles for them).
  bool frozen = false;

  std::int64_t local_tokens() const { return seq_len / cp; }
  std::int64_t key_width() const { return std::int64_t{key_heads} * key_dim; }
  std::int64_t value_width() const { return std::int64_t{value_heads} * value_dim; }
  std::int64_t channels() const { return 2 * key_width() + value_width(); }  // the convolution's
  // Whole sequences of a group of heads after an all-to-all (ulysses, upipe without chunks),
  // else the rank's own segments.
  bool head_layout() const;
  // The value heads of one head-layout stage over the group: the attention's share of heads,
  // U Hv / H, or the nearest valid stage (a multiple of C dividing Hv whose u = x / C value
  // heads a rank hold whole key-head groups or lie in one), the largest below first; 0: none.
  int stage_heads(int attention_heads) const;
};

// Throws config_error naming the value and a valid alternative where a layout cannot run the
// layer: a head layout needs C to divide Hv, and a stage whose u value heads a rank hold whole
// key-head groups (G divides u) or lie in one (u divides G).
void validate(const delta_config& config, int attention_heads);

// A segment of a rank's rows: local rows [token_begin, + count) hold global positions
// [position_begin, + count).
using delta_segment = position_run;

class delta_layer {
 public:
  // `layout`: every rank's local positions (the strategy's), so that each rank knows which
  // rank holds the rows before its segments and where each segment falls in the sequence.
  delta_layer(const delta_config& config, int attention_heads, backend& be, const cp_groups& groups,
              std::vector<std::vector<position_run>> layout);

  void set_documents(std::vector<std::int64_t> starts) {
    documents_ = std::move(starts);
    if (documents_.size() <= 1) documents_.clear();
  }

  // What the backward reads of the forward that ran just before it (the layer reruns its
  // forward from its checkpoint first, as the attention does).
  struct context {
    tensor z, out;  // (s, Hv dv) each: the norm's gate and the recurrence's output
    // Sequence layouts: the projections (s, C) and b | a (s, 2 Hv), the halos, the convolved
    // channels (s, C), g | beta (s, 2 Hv) f32, the state entering every segment and every
    // segment's transition, in sequence order ((R Hv, dk, dv) and (R Hv, dk, dk) f32).
    tensor mixed, ab, halos, conv, gates, states, transitions;
  };

  // y (s, D) (+)= the layer's output.
  context forward(const mat_view& x, const delta_weights& w, const mat_view& y, projection_mode mode);
  // d_x (s, D, f32) and the weight gradients accumulated; d_y is freed once read.
  void backward(context& ctx, const normed_input& x, const delta_weights& w, tensor&& d_y, const mat_view& d_x,
                const delta_grads& grads);

  const delta_config& config() const { return config_; }
  // The local segments, merged where the layout's runs continue each other.
  const std::vector<delta_segment>& segments() const { return segments_[rank_]; }

 private:
  // The sequence layouts (cp/delta_sequence.cpp).
  void sequence_forward(context& ctx, const mat_view& x, const delta_weights& w);
  void sequence_backward(context& ctx, const normed_input& x, const delta_weights& w, const mat_view& d_out,
                         const mat_view& d_x, const delta_grads& grads);
  tensor gather_halos(const mat_view& mixed);
  void scatter_halo_grads(const tensor& d_halos, const mat_view& d_mixed);
  void mask_halos(const mat_view& halos);
  // The head layouts (cp/delta_heads.cpp).
  void heads_forward(context& ctx, const mat_view& x, const delta_weights& w);
  void heads_backward(const normed_input& x, const delta_weights& w, const mat_view& d_out, const mat_view& d_x,
                      const delta_grads& grads);
  // The gated RMSNorm and the output projection (cp/delta_layer.cpp).
  tensor norm_forward(const mat_view& out, const mat_view& z, const delta_weights& w);
  sequence_documents documents_at(std::int64_t first) const { return {documents_, first}; }
  tensor workspace(std::int64_t rows, int key_heads, int value_heads, gated_delta_pass pass) const;

  delta_config config_;
  backend& be_;
  communicator* comm_;
  int rank_;
  std::vector<std::vector<delta_segment>> segments_;  // every rank's
  std::vector<std::int64_t> order_;  // segment (rank-major index) -> its place in the sequence
  std::vector<std::int64_t> documents_;
  int stage_heads_ = 0;  // head layouts: U value heads a stage
};

}  // namespace upipe
