// Ring attention: zigzag-balanced sequence layout (rank r holds chunks r and 2C-1-r of
// 2C), K/V circulating by send/recv, partial outputs merged in fp32 by log-sum-exp;
// backward circulates fp32 dK/dV with the K/V until they return to their owner.
#pragma once

#include "cp/head_norm.hpp"
#include "cp/strategy.hpp"

namespace upipe {

class ring_attention final : public attention_strategy {
 public:
  ring_attention(const attention_config& config, backend& be, communicator& comm);

  std::vector<position_run> local_positions(int rank) const override;
  attention_saved forward(const mat_view& x, const attention_weights& w, const mat_view& out) override;
  void backward(const attention_saved& saved, const normed_input& x, const attention_weights& w, const mat_view& out,
                const mat_view& d_out, const mat_view& d_x, const attention_grads& grads) override;

 private:
  // A pair of local query chunk and visiting kv chunk that attend, and how.
  struct block_pair {
    int q_half, kv_half;
    attn_mask mask;
    document_mask documents;
  };
  std::vector<block_pair> pairs(int kv_owner) const;
  // q (s, H, d), normed (Qwen3) and roped; the norm's inputs kept in `saved` if asked.
  tensor project_q(const normed_input& x, const attention_weights& w, norm_keep keep, head_norm_saved& saved);
  // (2, s, K, d): k then v, one buffer so a ring step moves both at once.
  tensor project_kv(const normed_input& x, const attention_weights& w, norm_keep keep, head_norm_saved& saved);
  head_view half(const head_view& v, int which) const { return v.token_block(which * chunk_, chunk_); }
  head_view kv_part(const tensor& kv, int which) const;
  void accumulate_input_grads(tensor& grad, const mat_view& weight, const mat_view& d_weight, const normed_input& x,
                              const mat_view& d_x);

  attention_config config_;
  backend& be_;
  communicator& comm_;
  std::int64_t tokens_;  // s = 2 * chunk
  std::int64_t chunk_;   // S / 2C
  int dim_;
  float scale_;
  std::vector<position_run> positions_;       // the layout: global indices
  std::vector<position_run> rope_positions_;  // RoPE's: restarting at each document
  void documents_changed() override { rope_positions_ = document_positions(positions_, documents()); }
};

}  // namespace upipe
