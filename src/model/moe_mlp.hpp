// A sparse layer's MLP on one tile of a rank's own tokens (docs/design.md section 11): the
// router (softmax in fp32, top-k, renormalized where the config says), the tile's rows
// gathered in the experts' order, each expert's gated MLP on its block of rows, and the
// outputs scattered back weighted by the routing; Qwen2-MoE's shared expert beside them
// behind sigmoid(shared_expert_gate). Attention is untouched, so every CP strategy carries
// over: each rank routes its own tokens.
//
// The load-balancing loss (transformers' load_balancing_loss_func) needs, over every
// sparse layer and every token of the sequence, each expert's top-k count and summed
// probability: the forward pass adds this rank's into `balance`, the transformer sums them
// over the CP group, and the backward adds the loss's gradient on the probabilities
// (`aux_grad`, one value per expert) through the router.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/backend.hpp"
#include "model/config.hpp"
#include "model/parameters.hpp"

namespace upipe {

// A working-dtype copy of an f32 gradient block, as gemm operands are in the working dtype
// on the GPU (on the cpu backend both are f32 and this is a plain copy).
tensor working_copy(backend& be, const mat_view& src, const char* label);

// One step's router statistics: per expert, the top-k assignments and the summed
// probabilities over the counted rows of every sparse layer.
struct router_balance {
  std::vector<double> counts, prob_sums;  // E each
  double rows = 0;                        // counted rows, over the sparse layers
  void reset(int experts);
};

class moe_exchange;

class moe_mlp {
 public:
  // With `experts` (an EP group: expert parallelism, model/moe_exchange.hpp) the weights
  // hold this rank's experts alone and the tile's rows travel to their experts' ranks.
  moe_mlp(const model_config& model, backend& be, communicator* experts = nullptr);
  ~moe_mlp();

  // y += MoE(h) over one tile: h (n, D) normed rows, y (n, D) the residual. Where
  // `counted` is given (a byte per row, 1 for a row the loss counts), the routing's
  // statistics of those rows are added to `balance`.
  void forward(const moe_weights& w, const mat_view& h, const mat_view& y, std::span<const std::uint8_t> counted = {},
               router_balance* balance = nullptr);
  // d_h (n, D) f32 = the MoE's gradient at h given d_y (n, D) f32; the weights' gradients
  // accumulate into g. With `aux_grad` (E values, the load-balancing loss's gradient on a
  // counted row's probabilities) the rows marked in `counted` take it too.
  void backward(const moe_weights& w, const moe_grads& g, const mat_view& h, const mat_view& d_y, const mat_view& d_h,
                std::span<const std::uint8_t> counted = {}, const tensor* aux_grad = nullptr);

 private:
  struct routing {
    tensor probs, weights, experts;  // (n, E) f32, (n, k) f32, (n, k) i32
    std::vector<std::int64_t> offsets;  // expert e's rows: [offsets[e], offsets[e + 1]) of the gathered tile
    tensor index, slot;                 // (m, 1) i32 each: the token and its (token, k) slot of each gathered row
    std::vector<std::int32_t> host_experts;  // (n, k) where the backend has data
  };
  routing route(const moe_weights& w, const mat_view& h);
  void dispatch(routing& r, std::int64_t n);
  // Where the experts' row blocks go (rows of the expert order, `offsets` per expert of the
  // weights): forward, moe_scatter's index, slot and weights into dst; backward, the same
  // addressing of the incoming gradient (dst), the routing weights' gradients at the
  // slots (d_weights), and each row's input gradient scattered by index into d_src.
  struct expert_rows {
    mat_view index, slot, weights, dst, d_weights, d_src;
  };
  void experts_forward(const moe_weights& w, const mat_view& x, std::span<const std::int64_t> offsets,
                       const expert_rows& to);
  void experts_backward(const moe_weights& w, const moe_grads& g, const mat_view& x,
                        std::span<const std::int64_t> offsets, const expert_rows& to);
  // Expert parallelism (model/moe_exchange.cpp): the gathered tile (m, D) to the experts'
  // ranks and back around the experts, then scattered as without it.
  void exchanged_forward(const moe_weights& w, const routing& r, tensor gathered, const mat_view& y,
                         std::int64_t n);
  void exchanged_backward(const moe_weights& w, const moe_grads& g, const routing& r, tensor gathered,
                          const mat_view& d_y, const mat_view& d_h, const mat_view& d_weights, std::int64_t n);
  void add_balance(const routing& r, std::span<const std::uint8_t> counted, router_balance& balance);
  // The shared expert's forward (its output s (n, D) and gate logit z (n, 1) f32).
  struct shared_out {
    tensor s, z;
  };
  shared_out shared_forward(const moe_weights& w, const mat_view& h);
  void shared_backward(const moe_weights& w, const moe_grads& g, const mat_view& h, const mat_view& d_y,
                       const mat_view& d_h);

  const model_config& model_;
  backend& be_;
  std::unique_ptr<moe_exchange> exchange_;  // expert parallelism; null without
};

}  // namespace upipe
