#include "cp/head_norm.hpp"

#include "backend/ops.hpp"

namespace upipe {

mat_view head_rows(void* data, dtype type, std::int64_t numel, std::int64_t d) {
  return {data, type, d == 0 ? 0 : numel / d, d, d};
}

head_norm_saved head_norm_forward(backend& be, const mat_view& x, const mat_view& weight,
                                  const attention_config::head_norm_params& norm, norm_keep keep) {
  head_norm_saved saved;
  saved.weight_offset = norm.weight_offset;
  if (keep == norm_keep::for_backward) {
    saved.pre = be.allocate(mem_tag::attention, x.type, {x.rows, x.cols}, "head_norm_pre");
    ops::copy_heads(be, ops::as_heads(saved.pre.matrix()), ops::as_heads(x));
  }
  saved.rstd = be.allocate(mem_tag::attention, dtype::f32, {x.rows, 1}, "head_norm_rstd");
  ops::rmsnorm_forward(be, {x, weight, x, saved.rstd.matrix(), norm.eps, norm.weight_offset});
  if (keep == norm_keep::nothing) saved.rstd.reset();
  return saved;
}

void head_norm_backward(backend& be, head_norm_saved& saved, const mat_view& grad, const mat_view& weight,
                        const mat_view& d_weight) {
  ops::rmsnorm_backward(be, {saved.pre.matrix(), weight, saved.rstd.matrix(), grad, grad, d_weight, saved.weight_offset});
  saved.pre.reset();
  saved.rstd.reset();
}

}  // namespace upipe
