// Ulysses and UPipe behind the strategy interface (one implementation; U = H is Ulysses),
// and hybrid: the same inside each all-to-all group of a 2-D mesh, with each stage's
// attention a ring across the groups (ring_core_*). With sequence chunks (fpdt, and upipe
// or ulysses with seq_chunks > 1) each stage runs chunk by chunk, earlier chunks' K/V in
// host memory (staged_chunks.cpp). The stages, their calls and their buffers come from the
// stage plan (stage_plan.hpp), which the passes are checked against as they run.
#pragma once

#include <span>
#include <vector>

#include "comm/subgroup.hpp"
#include "cp/head_schedule.hpp"
#include "cp/ring.hpp"
#include "cp/stage_plan.hpp"
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

  const head_schedule& schedule() const { return *plan_.schedule; }
  const stage_plan& plan() const override { return plan_; }

 private:
  enum class pass { forward, backward };
  struct resident_block;
  struct host_block;
  struct chunk_set;
  using head_lists = std::vector<std::span<const int>>;

  head_lists stage_lists(int stage) const;
  head_lists arriving_lists(int stage) const;

  // x's rows (s, D) -> the all-to-all send layout (A, rows, n, d) of the heads `lists` names.
  tensor project_to_send(const normed_input& x, const projection& weight, const head_lists& lists, const char* label);
  tensor exchange(tensor& send, const char* label);
  head_view sequence_heads(const tensor& t) const;
  void rope(const head_view& x, const std::vector<position_run>& positions, rope_direction direction);
  // src's rows (rows, H*d) -> the send layout (A, rows, u, d) of the stage's heads, and back.
  tensor pack_heads(const mat_view& src, int stage, const char* label);
  void unpack_heads(const tensor& recv, int stage, const mat_view& dst);
  resident_block receive_kv(const normed_input& x, const attention_weights& w, int stage, pass which);
  void release_finished(std::vector<resident_block>& resident, int stage);
  // The f32 log-sum-exp of heads [first, first + n) of a (heads, S) tensor, rows [row, row + rows).
  head_view lse_rows(const tensor& lse, int first, int n, std::int64_t row, std::int64_t rows) const;

  void backward_stage(int stage, std::vector<resident_block>& resident, const attention_saved& saved,
                      const normed_input& x, const attention_weights& w, const mat_view& out,
                      const mat_view& d_out, const mat_view& d_x, const attention_grads& grads);
  void send_back_kv(resident_block& block, const normed_input& x, const attention_weights& w, const mat_view& d_x,
                    const attention_grads& grads);
  // For each chunk j of a received gradient (A, rows, n, d): d_x += g W_rows and dW_rows += g^T x.
  void accumulate_input_grads(const tensor& recv, const head_lists& lists, const projection& weight,
                              const projection_grads& d_weight, const normed_input& x, const mat_view& d_x);

  // Sequence chunks (staged_chunks.cpp).
  attention_saved chunked_forward(const mat_view& x, const attention_weights& w, const mat_view& out);
  void chunked_backward(const attention_saved& saved, const normed_input& x, const attention_weights& w,
                        const mat_view& out, const mat_view& d_out, const mat_view& d_x, const attention_grads& grads);
  // The block arriving at `stage`, none of its parts stored yet.
  host_block arriving_block(int stage) const;
  void store_kv_part(host_block& h, const normed_input& x, const attention_weights& w, std::size_t j, pass which);
  // Device buffers for one part of the blocks a stage reads, sized for the longest part.
  chunk_set part_buffers(const std::vector<host_block>& resident, const stage_step& step, pass which);
  // Part j into them on the copy stream (its gradients too in backward: zero when none yet).
  void fetch_part(const std::vector<host_block>& resident, const stage_step& step, std::size_t j, chunk_set& set);
  void attend_chunk(int stage, std::size_t i, const std::vector<host_block>& resident, const tensor& q,
                    const tensor& o, const tensor& lse);
  void backward_chunk(int stage, std::size_t i, std::vector<host_block>& resident, const attention_saved& saved,
                      const normed_input& x, const attention_weights& w, const mat_view& out, const mat_view& d_out,
                      const mat_view& d_x, const attention_grads& grads);
  void send_back_chunk(host_block& block, std::size_t i, const normed_input& x, const attention_weights& w,
                       const mat_view& d_x, const attention_grads& grads);
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
  stage_plan plan_;
  std::int64_t tokens_;    // s
  std::int64_t gathered_;  // S / R: the tokens of the group (the whole sequence but in hybrid)
  int dim_;
  float scale_;
  std::vector<position_run> gathered_positions_;  // the layout: global indices
  std::vector<position_run> rope_positions_;      // RoPE's: restarting at each document
  // Sequence chunks: chunk i's gathered rows are the sequence's [first_i A, (first_i + count_i) A).
  std::vector<std::vector<position_run>> chunk_rope_positions_;
  void documents_changed() override;
};

}  // namespace upipe
