// The gated delta rule on the cpu backend: the chunked stages the GPU runs
// (ops/gated_delta/chunk_driver.hpp), on the host in fp32, and the summaries' scan.
#include <cstdint>
#include <vector>

#include "ops/cpu/cpu_ops.hpp"
#include "ops/gated_delta/host_executor.hpp"
#include "ops/gated_delta/recurrent.hpp"

namespace upipe::cpu {

namespace {

gated_delta::view3<const float> in3(const head_view& v) {
  return {static_cast<const float*>(v.data), v.tokens, v.heads, v.dim, v.token_stride, v.head_stride};
}
gated_delta::view3<float> out3(const head_view& v) {
  return {static_cast<float*>(v.data), v.tokens, v.heads, v.dim, v.token_stride, v.head_stride};
}

}  // namespace

void run(const gated_delta_forward_args& a) {
  gated_delta::host_executor exec;
  gated_delta::chunked_forward(a, exec);
}

void run(const gated_delta_backward_args& a) {
  gated_delta::host_executor exec;
  gated_delta::chunked_backward(a, exec);
}

void run(const gated_delta_summary_args& a) {
  gated_delta::host_executor exec;
  gated_delta::chunked_summary(a, exec);
}

void run(const gated_delta_summary_backward_args& a) {
  gated_delta::host_executor exec;
  gated_delta::chunked_summary_backward(a, exec);
}

void run(const gated_delta_scan_args& a) {
  const std::int64_t heads = a.heads, segments = a.transitions.tokens / heads;
  const std::int64_t dk = a.transitions.heads, dv = a.locals.dim;
  const auto m = in3(a.transitions), local = in3(a.locals);
  const auto out = out3(a.states);
  const bool forward = a.direction == scan_direction::forward;
  for (std::int64_t h = 0; h < heads; ++h) {
    std::vector<float> carry(static_cast<std::size_t>(dk * dv), 0.0f), next(carry.size());
    for (std::int64_t step = 0; step < segments; ++step) {
      const std::int64_t r = forward ? step : segments - 1 - step;
      for (std::int64_t i = 0; i < dk; ++i)
        for (std::int64_t j = 0; j < dv; ++j) out(r * heads + h, i, j) = carry[i * dv + j];
      // forward: carry = M_r carry + L_r; backward: carry = M_r^T carry + L_r.
      for (std::int64_t i = 0; i < dk; ++i)
        for (std::int64_t j = 0; j < dv; ++j) {
          float sum = local(r * heads + h, i, j);
          for (std::int64_t p = 0; p < dk; ++p)
            sum += (forward ? m(r * heads + h, i, p) : m(r * heads + h, p, i)) * carry[p * dv + j];
          next[i * dv + j] = sum;
        }
      carry.swap(next);
    }
  }
}

}  // namespace upipe::cpu
