// Expert parallelism's token exchange (docs/design.md sections 11 and 12). A sparse layer's
// experts are split over the P ranks of an EP group, L = experts / P each (EP rank b holds
// experts b L .. b L + L - 1). Each rank routes its own tokens and dispatches them on the
// device (moe_mlp's steps 1 and 2): the tile's kept (token, choice) rows lie expert by
// expert, so the rows for EP rank b are one contiguous block. One all_to_all_v sends each
// block to its rank with each row's expert; the receiver dispatches what it received by
// that expert on the device (moe_dispatch with one choice a row: sources in rank order
// within an expert), runs its experts on them, and puts the outputs back in the received
// order for the all_to_all_v that returns them.
//
// The sizes come first: each rank sends each EP rank the slice of its dispatch offsets that
// covers that rank's experts (one small all_to_all), and the host reads its own slices and
// the received ones back in one download: all_to_all_v takes its sizes on the host (NCCL's
// sends and receives), so this is the one host synchronization of a sparse layer's tile and
// direction under EP (none without it).
//
// Dropless routing has no fixed size: a rank receives at most P n min(k, L) rows (every
// source sending it all of its tokens' choices that land on its experts) and an expert at
// most P n (a token chooses an expert once); a capacity c bounds these by P L c and P c.
// Without data (the meta backend, the planner) those worst cases are what the buffers hold,
// so a plan never undercounts a step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "model/config.hpp"

namespace upipe {

// The most rows a rank receives from one tile of n tokens on each of P ranks with L of the
// model's experts (top-k routing; capacity 0: dropless), and the most one expert receives.
struct dispatch_bound {
  std::int64_t rank_rows = 0, expert_rows = 0;
};
dispatch_bound worst_case_dispatch(std::int64_t tile_tokens, int top_k, int ep, int local_experts,
                                   std::int64_t capacity = 0);

class moe_exchange {
 public:
  // peers: the EP group (its size P divides the model's experts).
  moe_exchange(const model_config& model, backend& be, communicator& peers);

  int ranks() const { return peers_.size(); }
  int local_experts() const { return local_; }
  int first_expert() const { return peers_.rank() * local_; }

  // One tile's exchange: the rows this rank sends each EP rank and gets from it, and the
  // received rows' dispatch by local expert.
  struct plan {
    std::vector<std::size_t> send_rows, recv_rows;  // per EP rank
    std::int64_t sent = 0, received = 0;            // their sums
    tensor position;  // (received, 1) i32: each received row's place in the local experts' order
    tensor offsets;   // (1, experts + 1) i32: this rank's experts' rows at [first, first + L]
    std::vector<std::int64_t> host_offsets;  // L + 1: local expert e's rows at [e, e + 1)
  };
  // From this rank's dispatch of a tile of n tokens: its offsets (1, experts + 1) i32 and
  // positions (n, k) i32 on the device, the choices (n, k) i32, the rows it laid out, and the
  // capacity it applied (for the bound without data).
  plan make_plan(const mat_view& offsets, const mat_view& position, const mat_view& choices, std::int64_t rows,
                 std::int64_t capacity);
  // The local experts' groups for the grouped GEMMs: (1, L + 1) i32, a view into p.offsets.
  mat_view group_offsets(const plan& p) const;

  // Rows (m, cols) in this rank's dispatch order (the first p.sent of them) to the experts'
  // ranks: (received, cols) in the local experts' order. Working dtype or f32 rows.
  tensor to_experts(const plan& p, const mat_view& rows, const char* label);
  // Rows (received, cols) in the local experts' order back to their sources: (m, cols) in
  // this rank's dispatch order (rows past p.sent left unwritten, as no position names them).
  tensor to_sources(const plan& p, const mat_view& rows, std::int64_t m, const char* label);

 private:
  // rows' first sum(send_rows) rows out, sum(recv_rows) rows into `into`.
  void exchange(const mat_view& rows, std::span<const std::size_t> send_rows, std::span<const std::size_t> recv_rows,
                const mat_view& into, const char* label);
  void sizes_from_counts(plan& p, const std::vector<std::int32_t>& host);
  void plan_without_data(plan& p, std::int64_t rows, std::int64_t tile_tokens, std::int64_t capacity);

  const model_config& model_;
  backend& be_;
  communicator& peers_;
  int local_;
};

}  // namespace upipe
