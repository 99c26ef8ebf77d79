// A sparse layer's MLP on one tile of a rank's own tokens (docs/design.md section 11), in
// four named steps, each on the device with no host synchronization (the per-expert loop
// alone reads the experts' row counts):
//   1. route:    the router's logits, softmax (fp32) and top-k, renormalized where the
//                config says (or the choices of a routing log, replayed);
//   2. dispatch: each (token, slot)'s row in the experts' order, each expert's rows (a
//                capacity drops the rows past it, in token order), the tile's rows permuted;
//   3. experts:  each expert's gated MLP on its block of rows, as grouped GEMMs (or the
//                per-expert loop);
//   4. combine:  the expert outputs weighted by the routing, summed per token in fp32 and
//                added to the residual once, with Qwen2-MoE's shared expert.
// Expert parallelism exchanges the dispatched rows between steps 2 and 3 (and the outputs
// back between 3 and 4). Attention is untouched, so every CP strategy carries over: each
// rank routes its own tokens.
//
// The load-balancing loss (transformers' load_balancing_loss_func) needs, over every
// sparse layer and every token of the sequence, each expert's top-k count and summed
// probability: the forward adds this tile's into the step's device sums (moe_balance), the
// transformer reads them once a step and sums them over the CP group, and the backward adds
// the loss's gradient on the probabilities (`aux_grad`, one value per expert) through the router.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "backend/backend.hpp"
#include "model/config.hpp"
#include "model/moe_routing_log.hpp"
#include "model/parameters.hpp"

namespace upipe {

// A working-dtype copy of an f32 gradient block, as gemm operands are in the working dtype
// on the GPU (on the cpu backend both are f32 and this is a plain copy).
tensor working_copy(backend& be, const mat_view& src, const char* label);

// The experts' GEMMs: grouped through CUTLASS (the groups' sizes read on the device),
// grouped through cuBLAS (sizes read on the host: a synchronization per call), or one GEMM
// per expert (the experts' row counts read on the host once per tile and direction).
enum class moe_gemm : std::uint8_t { grouped, cublas, loop };
std::string_view moe_gemm_name(moe_gemm g);
// Parses "grouped", "cublas" or "loop"; throws config_error naming the valid values.
moe_gemm parse_moe_gemm(std::string_view text);

struct moe_options {
  moe_gemm gemm = moe_gemm::grouped;
  // > 0: an expert takes at most ceil(F n k / E) of a tile's n tokens, the rest dropped in
  // token order (Switch, GShard); 0: dropless.
  double capacity_factor = 0;
  // Tests: record every tile's expert choices, or replay them (not owned).
  moe_routing_log* routing_log = nullptr;
};
// Throws config_error naming the value unless 0 (dropless) or a finite F > 0.
void validate_moe_options(const moe_options& o);
// The rows an expert keeps of a tile of n tokens: ceil(F n k / E), 0 for dropless.
std::int64_t moe_capacity(double factor, std::int64_t n, std::int64_t k, std::int64_t experts);

// The step's load-balancing sums (moe_balance_args::sums): E u64 counts, then E f64
// probability sums, read from the device's words.
struct router_balance {
  std::vector<double> counts, prob_sums;  // E each
};
router_balance read_router_balance(backend& be, const tensor& sums, std::int64_t experts);

class moe_mlp {
 public:
  moe_mlp(const model_config& model, backend& be, const moe_options& options, int rank);

  // Where a tile sits, and what the load-balancing loss asks of it: its rows that count
  // ((n, 1) u8 on the device; no rows: every row), the step's sums (forward; null: none
  // collected) and the loss's gradient on the probabilities (backward; null: none).
  struct tile {
    int layer = 0;
    std::int64_t first = 0;  // the tile's first local token
    mat_view counted;
    const tensor* balance = nullptr;
    const tensor* aux_grad = nullptr;
  };

  // y += MoE(h) over one tile: h (n, D) normed rows, y (n, D) the residual.
  void forward(const moe_weights& w, const tile& at, const mat_view& h, const mat_view& y);
  // d_h (n, D) f32 = the MoE's gradient at h given d_y (n, D) f32; the weights' gradients
  // accumulate into g.
  void backward(const moe_weights& w, const moe_grads& g, const tile& at, const mat_view& h, const mat_view& d_y,
                const mat_view& d_h);

 private:
  struct routing {
    tensor probs, weights, experts;  // (n, E) f32, (n, k) f32, (n, k) i32
  };
  struct dispatch_plan {
    tensor position, offsets;  // (n, k) i32: each slot's row (-1: dropped); (1, E + 1) i32
    std::int64_t rows = 0;     // rows laid out at most (n k, or E x capacity)
    std::vector<std::int64_t> host_offsets;  // the per-expert loop's copy of offsets
  };
  // The expert GEMMs' operands over the dispatched rows.
  struct expert_pass {
    tensor x, gate, up;  // (rows, D), (rows, I), (rows, I)
  };
  routing route(const moe_weights& w, const tile& at, const mat_view& h);
  dispatch_plan dispatch(const routing& r, std::int64_t n);
  tensor permute(const dispatch_plan& d, const mat_view& h);
  // gate and up of the permuted rows x (kept in the pass for the weight gradients).
  expert_pass experts_in(const moe_weights& w, const dispatch_plan& d, tensor x);
  // One grouped GEMM of the experts (or the per-expert loop).
  void expert_gemm(const dispatch_plan& d, grouped_form form, const mat_view& rows, const mat_view& other,
                   std::vector<mat_view> weights, const mat_view& out, float beta = 0.0f);
  void experts_backward(const moe_weights& w, const moe_grads& g, const dispatch_plan& d, const routing& r,
                        const mat_view& h, const mat_view& d_y, const mat_view& d_h, const mat_view& d_weights);
  void router_backward(const moe_weights& w, const moe_grads& g, const tile& at, const routing& r, const mat_view& h,
                       const mat_view& d_weights, const mat_view& d_h);
  // The shared expert's forward (its output s (n, D) and gate logit z (n, 1) f32).
  struct shared_out {
    tensor s, z;
  };
  shared_out shared_forward(const moe_weights& w, const mat_view& h);
  void shared_backward(const moe_weights& w, const moe_grads& g, const mat_view& h, const mat_view& d_y,
                       const mat_view& d_h);

  const model_config& model_;
  backend& be_;
  moe_options options_;
  int rank_;
};

}  // namespace upipe
