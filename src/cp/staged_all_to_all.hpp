// Ulysses and UPipe behind the strategy interface (one implementation; U = H is Ulysses),
// and hybrid: the same inside each all-to-all group of a 2-D mesh, with each stage's
// attention a ring across the groups (ring_core_*).
#pragma once

#include <span>
#include <vector>

#include "comm/subgroup.hpp"
#include "cp/head_schedule.hpp"
#include "cp/ring.hpp"
#include "cp/strategy.hpp"

namespace upipe {

class staged_all_to_all final : public attention_strategy {
 public:
  staged_all_to_all(const attention_config& config, backend& be, communicator& comm);
  // Hybrid: the mesh's groups (split_mesh of the CP group), owned; `world_rank` is this
  // rank in the CP group.
  staged_all_to_all(const attention_config& config, backend& be, mesh_groups mesh, int world_rank);
  ~staged_all_to_all() override;

  std::vector<position_run> local_positions(int rank) const override;
  attention_saved forward(const mat_view& x, const attention_weights& w, const mat_view& out) override;
  void backward(const attention_saved& saved, const normed_input& x, const attention_weights& w, const mat_view& out,
                const mat_view& d_out, const mat_view& d_x, const attention_grads& grads) override;

  const head_schedule& schedule() const { return schedule_; }

 private:
  enum class pass { forward, backward };
  struct resident_block;
  // One fused attention call: stage slots [q_slot, q_slot + n_q) read kv slots
  // [kv_slot, kv_slot + n_kv) of resident block `block`, n_q / n_kv query heads per kv.
  struct sdpa_call {
    int q_slot = 0, n_q = 0;
    std::size_t block = 0;
    int kv_slot = 0, n_kv = 0;
  };
  using head_lists = std::vector<std::span<const int>>;

  head_lists stage_lists(int stage) const;
  head_lists arriving_lists(int stage) const;
  std::vector<sdpa_call> plan_calls(int stage, const std::vector<resident_block>& resident) const;

  tensor project_to_send(const normed_input& x, const projection& weight, const head_lists& lists, const char* label);
  tensor exchange(tensor& send, const char* label);
  head_view sequence_heads(const tensor& t) const;
  void rope(const head_view& x, rope_direction direction);
  tensor pack_heads(const mat_view& src, int stage, const char* label);
  void unpack_heads(const tensor& recv, int stage, const mat_view& dst);
  resident_block receive_kv(const normed_input& x, const attention_weights& w, int stage, pass which);
  void release_finished(std::vector<resident_block>& resident, int stage);

  void backward_stage(int stage, std::vector<resident_block>& resident, const attention_saved& saved,
                      const normed_input& x, const attention_weights& w, const mat_view& out,
                      const mat_view& d_out, const mat_view& d_x, const attention_grads& grads);
  void send_back_kv(resident_block& block, const normed_input& x, const attention_weights& w, const mat_view& d_x,
                    const attention_grads& grads);
  void accumulate_input_grads(const tensor& recv, const head_lists& lists, const projection& weight,
                              const projection_grads& d_weight, const normed_input& x, const mat_view& d_x);
  // Hybrid: a call's kv heads of a resident block as one (2, S / R, n_kv, d) buffer to
  // travel the ring.
  tensor ring_kv(const resident_block& b, const sdpa_call& c);
  ring_shape ring_geometry() const;

  attention_config config_;
  backend& be_;
  mesh_groups mesh_;     // hybrid's groups (empty otherwise)
  communicator& comm_;   // the all-to-all group: the CP group, or hybrid's A ranks
  communicator* ring_;   // hybrid's ring across groups, else nullptr
  int world_rank_;       // this rank in the CP group
  int group_;            // A, the all-to-all group's ranks
  head_schedule schedule_;
  std::int64_t tokens_;    // s
  std::int64_t gathered_;  // S / R: the tokens of the group (the whole sequence but in hybrid)
  int dim_;
  float scale_;
  std::vector<position_run> gathered_positions_;  // the layout: global indices
  std::vector<position_run> rope_positions_;      // RoPE's: restarting at each document
  void documents_changed() override { rope_positions_ = document_positions(gathered_positions_, documents()); }
};

}  // namespace upipe
