// Reference fused softmax cross-entropy on one chunk of fp32 logits, in place: each row
// becomes its gradient and its loss goes to row_loss. Max-shifted, fp64 sums. Every
// label is checked before anything is written, so a bad label leaves the chunk as it was.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "core/error.hpp"
#include "ops/cpu/cpu_ops.hpp"

namespace upipe::cpu {

namespace {

float* mutable_row_of(const mat_view& m, std::int64_t i) { return static_cast<float*>(m.data) + i * m.ld; }

std::int32_t label_at(const mat_view& labels, std::int64_t row) {
  return static_cast<const std::int32_t*>(labels.data)[row * labels.ld];
}

// Negative labels are masked rows; the entry cannot see device data, so labels >= V are
// caught here.
void check_labels(const mat_view& labels, std::int64_t vocab) {
  for (std::int64_t r = 0; r < labels.rows; ++r) {
    const std::int32_t label = label_at(labels, r);
    UPIPE_CHECK(label < vocab, "cpu::cross_entropy: label " + std::to_string(label) + " at row " + std::to_string(r) +
                                   " is outside the vocabulary [0, " + std::to_string(vocab) +
                                   "); negative labels (e.g. -100) mask a row");
  }
}

// One unmasked row: loss = logsumexp(x) - x[label], x replaced by (softmax - onehot) * scale.
double loss_and_gradient(float* x, std::int64_t vocab, std::int32_t label, double grad_scale) {
  const double top = *std::max_element(x, x + vocab);
  double sum = 0.0;
  for (std::int64_t j = 0; j < vocab; ++j) sum += std::exp(x[j] - top);
  const double lse = top + std::log(sum);
  const double loss = lse - x[label];
  for (std::int64_t j = 0; j < vocab; ++j) {
    const double p = std::exp(x[j] - lse);
    x[j] = static_cast<float>((p - (j == label ? 1.0 : 0.0)) * grad_scale);
  }
  return loss;
}

}  // namespace

void run(const cross_entropy_args& args) {
  const std::int64_t vocab = args.logits.cols;
  check_labels(args.labels, vocab);
  for (std::int64_t r = 0; r < args.logits.rows; ++r) {
    float* x = mutable_row_of(args.logits, r);
    const std::int32_t label = label_at(args.labels, r);
    float* loss = mutable_row_of(args.row_loss, r);
    if (label < 0) {
      std::fill(x, x + vocab, 0.0f);
      *loss = 0.0f;
      continue;
    }
    *loss = static_cast<float>(loss_and_gradient(x, vocab, label, args.grad_scale));
  }
}

}  // namespace upipe::cpu
