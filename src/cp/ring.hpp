// Ring attention: zigzag-balanced sequence layout (rank r holds chunks r and 2C-1-r of
// 2C), K/V exchanged by send/recv, partial outputs merged in fp32 by log-sum-exp. Step s
// brings the K/V of the rank s places back straight from it (every pair of ranks is one
// hop on NVLink and on the network), so that a step no query reaches under a sliding
// window is skipped, message and all; backward sends each visiting block's fp32 dK/dV
// back to its owner in the same step, where they add up in fp32.
#pragma once

#include "cp/head_norm.hpp"
#include "cp/strategy.hpp"

namespace upipe {

// The ring's attention core for one set of heads, shared by ring attention (the whole
// group is the ring, all heads) and hybrid (a ring across all-to-all groups, the heads of
// one call of a stage). A ring rank holds zigzag halves `rank` and 2R - 1 - rank of the
// sequence, `chunk` tokens each (2 * chunk rows, in that order).
struct ring_shape {
  int size = 1, rank = 0;   // R, and this rank's place in the ring
  std::int64_t chunk = 0;   // S / 2R
  float scale = 1.0f;
  const std::vector<std::int64_t>* documents = nullptr;  // packed documents' starts (global), or none
  std::int64_t window = 0;  // the sliding window W (0: none)
  attention_dtype arithmetic = attention_dtype::bf16;
};

// Does a query half of ring rank `q_rank` reach a key half of `kv_owner`: a pair not in the
// future and within the window? (Packed documents skip more attention calls, but they
// change with every sequence and the messages and buffers are planned once.)
bool ring_reaches(const ring_shape& shape, int q_rank, int kv_owner);

// Step s (1..R-1) of the ring on this rank: its K/V go to rank `to` (s places on) when that
// rank's queries reach them, and those of rank `from` (s places back) arrive when this
// rank's reach them.
struct ring_step {
  int to = 0, from = 0;
  bool send = false, receive = false;
};
ring_step ring_step_at(const ring_shape& shape, int s);

// q (2 chunk, n_q, d); kv (2, 2 chunk, n_kv, d), k then v, this rank's (consumed: it is
// released when the core returns); out (2 chunk, n_q, d) written from the fp32 merge, lse (2 chunk,
// n_q, 1) f32 written.
void ring_core_forward(backend& be, communicator& ring, const ring_shape& shape, const head_view& q, tensor kv,
                       const head_view& out, const head_view& lse);

// The gradients: dq (2 chunk, n_q, d) f32 and dkv (2, 2 chunk, n_kv, d) f32 of this
// rank's K/V, every rank's share summed here. kv is consumed as in forward.
struct ring_core_grads {
  tensor dq, dkv;
};
ring_core_grads ring_core_backward(backend& be, communicator& ring, const ring_shape& shape, const head_view& q,
                                   tensor kv, const head_view& o, const head_view& d_o, const head_view& lse);

class ring_attention final : public attention_strategy {
 public:
  ring_attention(const attention_config& config, backend& be, communicator& comm);

  std::vector<position_run> local_positions(int rank) const override;
  const stage_plan& plan() const override { return plan_; }
  attention_saved forward(const mat_view& x, const attention_weights& w, const mat_view& out) override;
  void backward(const attention_saved& saved, const normed_input& x, const attention_weights& w, const mat_view& out,
                const mat_view& d_out, const mat_view& d_x, const attention_grads& grads) override;

 private:
  ring_shape shape() const { return {config_.cp, comm_.rank(), chunk_, scale_, &documents(), config_.window, config_.arithmetic}; }
  // q (s, H, d), normed (Qwen3) and roped; the norm's inputs kept in `saved` if asked.
  tensor project_q(const normed_input& x, const attention_weights& w, norm_keep keep, head_norm_saved& saved);
  // (2, s, K, d): k then v, one buffer so a ring step moves both at once.
  tensor project_kv(const normed_input& x, const attention_weights& w, norm_keep keep, head_norm_saved& saved);
  void accumulate_input_grads(tensor& grad, const projection& weight, const projection_grads& d_weight,
                              const normed_input& x, const mat_view& d_x);

  attention_config config_;
  backend& be_;
  communicator& comm_;
  stage_plan plan_;
  std::int64_t tokens_;  // s = 2 * chunk
  std::int64_t chunk_;   // S / 2C
  int dim_;
  float scale_;
  std::vector<position_run> positions_;       // the layout: global indices
  std::vector<position_run> rope_positions_;  // RoPE's: restarting at each document
  void documents_changed() override { rope_positions_ = document_positions(positions_, documents()); }
};

}  // namespace upipe
