// The weights of a Gated DeltaNet layer (the hybrids' linear attention, docs/design.md
// section 11), by role, whatever tensors a family stores them in: Qwen3.5's in_proj_qkv,
// in_proj_z, in_proj_b and in_proj_a, Qwen3-Next's in_proj_qkvz and in_proj_ba grouped by
// key head (each projection's row_blocks say where its rows lie).
#pragma once

#include "cp/projection.hpp"

namespace upipe {

struct delta_weights {
  projection q, k;      // (Hk dk, D): the convolution's q and k channels
  projection v;         // (Hv dv, D): its v channels
  projection z;         // (Hv dv, D): the output norm's gate
  projection b, a;      // (Hv, D): beta = sigmoid(b); the decay's a
  mat_view conv;        // (C, Kc) over the channels q | k | v, C = 2 Hk dk + Hv dv
  mat_view dt_bias;     // (1, Hv)
  mat_view a_log;       // (1, Hv): the decay g = -exp(A_log) softplus(a + dt_bias)
  mat_view norm;        // (1, dv): the gated RMSNorm's weight (scales by w, no offset)
  projection out;       // (D, Hv dv)
  bool present() const { return conv.rows > 0; }
};

// Gradients, f32, accumulated; a frozen weight's have no rows.
struct delta_grads {
  projection_grads q, k, v, z, b, a;
  mat_view conv, dt_bias, a_log, norm;
  projection_grads out;
};

}  // namespace upipe
