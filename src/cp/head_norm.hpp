// Qwen3's and Gemma 3's per-head RMSNorm on q and k (over d, one weight vector shared by all
// heads; Gemma's scales by 1 + weight),
// applied in place right after the projection and before RoPE. Tensors are seen as
// contiguous rows of d: (tokens x heads, d).
#pragma once

#include "backend/backend.hpp"
#include "cp/attention_config.hpp"

namespace upipe {

enum class norm_keep : std::uint8_t { nothing, for_backward };

// What backward needs: the rows before the norm and their 1/rms.
struct head_norm_saved {
  tensor pre;   // (rows, d)
  tensor rstd;  // (rows, 1) f32
  float weight_offset = 0.0f;
};

// Rows of d of a contiguous (..., heads, d) buffer.
mat_view head_rows(void* data, dtype type, std::int64_t numel, std::int64_t d);
inline mat_view head_rows(const tensor& t, std::int64_t d) { return head_rows(t.data(), t.type(), t.numel(), d); }

// Normalizes x in place; keeps the pre-norm copy and rstd when asked.
head_norm_saved head_norm_forward(backend& be, const mat_view& x, const mat_view& weight,
                                  const attention_config::head_norm_params& norm, norm_keep keep);

// grad rows (f32 or working dtype) turn from d(normalized) into d(pre-norm) in place;
// d_weight (1, d, f32) accumulates. Frees the saved tensors.
void head_norm_backward(backend& be, head_norm_saved& saved, const mat_view& grad, const mat_view& weight,
                        const mat_view& d_weight);

}  // namespace upipe
