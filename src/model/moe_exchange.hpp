// Expert parallelism's token exchange (docs/design.md sections 11 and 12). A sparse layer's
// experts are split over the E ranks of an EP group, L = experts / E each (EP rank b holds
// experts b L .. b L + L - 1). Each rank routes its own tokens and orders the tile's n k
// (token, choice) rows expert by expert (moe_mlp's dispatch), so the rows for EP rank b
// are one contiguous block; one all_to_all_v sends each block to its rank, which orders
// what it received by local expert (sources in rank order within an expert), runs its
// experts, and puts the outputs back in the received order for the all_to_all_v that
// returns them. The sizes come first: each rank's per-expert counts go to the experts'
// ranks in one small all_to_all, read back by the host once a tile (the only host read
// the exchange adds).
//
// Dropless routing has no fixed size: a rank receives at most E n min(k, L) rows (every
// source sending it all of its tokens' choices that land on its experts) and an expert at
// most E n (a token chooses an expert once). Without data (the meta backend, the planner)
// those worst cases are what the buffers hold, so a plan never undercounts a step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "model/config.hpp"

namespace upipe {

// The most rows a rank receives from one tile of n tokens on each of E ranks with L of
// the model's experts (top-k routing, dropless), and the most one expert receives.
struct dispatch_bound {
  std::int64_t rank_rows = 0, expert_rows = 0;
};
dispatch_bound worst_case_dispatch(std::int64_t tile_tokens, int top_k, int ep, int local_experts);

class moe_exchange {
 public:
  // peers: the EP group (its size E divides the model's experts).
  moe_exchange(const model_config& model, backend& be, communicator& peers);

  int ranks() const { return peers_.size(); }
  int local_experts() const { return local_; }
  int first_expert() const { return peers_.rank() * local_; }

  // One tile's exchange: the rows each EP rank sends here and gets from here, and the
  // received rows in local expert order.
  struct plan {
    std::vector<std::size_t> send_rows, recv_rows;  // per EP rank
    std::vector<std::int64_t> offsets;  // L + 1: local expert e's rows are [offsets[e], offsets[e + 1])
    tensor to_experts;  // (R, 1) i32: the received row at each place of the experts' order
    tensor to_sources;  // (R, 1) i32: the place in the experts' order of each received row
    tensor rows;        // (R, 1) i32: 0 .. R - 1 (the experts' rows' own places, for the ops' index)
  };
  // `offsets` (experts + 1): this rank's tile rows of each expert, expert by expert, as its
  // dispatch ordered them; tile_tokens the tile's n (for the bound without data).
  plan make_plan(std::span<const std::int64_t> offsets, std::int64_t tile_tokens);

  // Rows (m, cols) in this rank's dispatch order to the experts' ranks: (R, cols) in the
  // local experts' order. Working dtype or f32 rows.
  tensor dispatch(const plan& p, const mat_view& rows, const char* label);
  // Rows (R, cols) in the local experts' order back to their sources: (m, cols) in each
  // source's dispatch order.
  tensor combine(const plan& p, const mat_view& rows, const char* label);

 private:
  tensor exchange(const mat_view& rows, std::span<const std::size_t> send_rows, std::span<const std::size_t> recv_rows,
                  const char* label);
  void plan_without_data(plan& p, std::span<const std::int64_t> offsets, std::int64_t tile_tokens);

  const model_config& model_;
  backend& be_;
  communicator& peers_;
  int local_;
};

}  // namespace upipe
