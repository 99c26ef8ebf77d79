// A linear projection y = x W^T (Hugging Face layout) with an optional bias b and an
// optional LoRA adapter, y = x W^T + b + s (x A^T) B^T with s = alpha / r, forward and
// backward. The attention
// strategies, the output projection and the MLP run their weight GEMMs through here, so
// that an adapter follows its weight wherever the weight's rows go (a UPipe stage takes
// the rows of its heads from W and from B alike) and a frozen weight's gradient GEMM is
// never run (docs/design.md section 10).
#pragma once

#include <algorithm>
#include <cstdint>

#include "backend/backend.hpp"

namespace upipe {

// Where a projection's output rows lie in the tensor that stores them: contiguous, or in
// blocks of `block` rows every `stride` rows (a fused tensor interleaved by heads: the
// hybrids' gated q_proj holds each head's query rows then its gate rows, Qwen3-Next's
// in_proj_qkvz each key head's q, k, v and z rows). Logical row r is stored row
// (r / block) stride + r % block of the views, which begin at the projection's first row.
struct row_blocks {
  std::int64_t block = 0, stride = 0;  // 0: contiguous
  bool interleaved() const { return block > 0 && stride != block; }
  // The logical rows of a view of `stored` rows.
  std::int64_t logical_rows(std::int64_t stored) const {
    return interleaved() ? (stored + stride - block) / stride * block : stored;
  }
  // fn(stored first row, logical offset from `first`, rows) over the stored runs of logical
  // rows [first, first + count).
  template <class Fn>
  void for_each_run(std::int64_t first, std::int64_t count, Fn&& fn) const {
    if (!interleaved()) return fn(first, std::int64_t{0}, count);
    for (std::int64_t r = first; r < first + count;) {
      const std::int64_t n = std::min(block - r % block, first + count - r);
      fn(r / block * stride + r % block, r - first, n);
      r += n;
    }
  }
  bool operator==(const row_blocks&) const = default;
};

struct projection {
  mat_view weight;          // (out, in), working dtype
  mat_view bias;            // (1, out), working dtype; no rows without a bias
  mat_view lora_a, lora_b;  // (r, in) and (out, r), working dtype; no rows without an adapter
  float lora_scale = 0.0f;  // alpha / r
  row_blocks rows;          // where the output rows lie in weight, bias and lora_b

  projection() = default;
  projection(const mat_view& w) : weight(w) {}  // NOLINT(google-explicit-constructor): a plain weight
  bool adapted() const { return lora_a.rows > 0; }
  std::int64_t out_rows() const { return rows.logical_rows(weight.rows); }
};

// The gradients of a projection, f32, accumulated (+=). A frozen weight has none (no rows):
// its weight-gradient GEMM is not run.
struct projection_grads {
  mat_view weight;          // (out, in)
  mat_view bias;            // (1, out) with a trained bias
  mat_view lora_a, lora_b;  // (r, in), (out, r) with an adapter

  projection_grads() = default;
  projection_grads(const mat_view& w) : weight(w) {}  // NOLINT(google-explicit-constructor): a plain weight's
};

// The forward over one tile of input rows x: with an adapter, x A^T (rows, r) is computed
// once here and shared by every block of output columns asked for.
class projection_forward {
 public:
  projection_forward(backend& be, const projection& w, const mat_view& x);

  // y (x.rows, count) = beta y + x W[first, first + count)^T (+ b[first, first + count))
  // (+ s (x A^T) B[first, first + count)^T).
  void rows(std::int64_t first, std::int64_t count, const mat_view& y, float beta = 0.0f) const;
  void all(const mat_view& y, float beta = 0.0f) const { rows(0, w_.out_rows(), y, beta); }

 private:
  backend& be_;
  projection w_;
  mat_view x_;
  tensor xa_;  // (x.rows, r) working dtype, with an adapter
};

// The backward of one projection whose output gradient dy arrives as blocks of output
// columns (a stage's heads) and whose input x may come a tile of rows at a time:
//   1. input_grad for every block, then finish_input_grad (the adapter's share of d_x);
//   2. for each tile of x: start_tile, then weight_grad for every block.
class projection_backward {
 public:
  projection_backward(backend& be, const projection& w, const projection_grads& g, std::int64_t tokens);

  // d_x (tokens, in) = beta d_x + dy W[first, first + dy.cols); with an adapter, dy
  // B[first, ...) is summed for its gradients.
  void input_grad(const mat_view& dy, std::int64_t first, const mat_view& d_x, float beta = 1.0f);
  // After the last input_grad: d_x += s (dy B) A.
  void finish_input_grad(const mat_view& d_x);
  // Whether any weight gradient is wanted: when not, the tiles of x need not be made.
  bool trains() const { return g_.weight.rows > 0 || g_.bias.rows > 0 || w_.adapted(); }
  // Input rows [t0, t0 + x.rows): dA += s (dy B)[rows]^T x, and x A^T for weight_grad.
  void start_tile(std::int64_t t0, const mat_view& x);
  // For the current tile, dy its rows of output columns [first, first + dy.cols):
  // dW[first, ...) += dy^T x unless the weight is frozen, db[first, ...) += dy's column
  // sums with a trained bias, dB[first, ...) += s dy^T (x A^T).
  void weight_grad(const mat_view& dy, std::int64_t first);

 private:
  backend& be_;
  projection w_;
  projection_grads g_;
  tensor gb_;       // (tokens, r) f32: dy B summed over the blocks
  tensor gb_work_;  // its working-dtype copy (GEMM operands are in the working dtype)
  mat_view tile_;
  tensor tile_xa_;  // (tile rows, r) working dtype
};

// y = beta y + x W^T (+ bias) (+ adapter).
void linear_forward(backend& be, const mat_view& x, const projection& w, const mat_view& y, float beta = 0.0f);

// The whole backward for an input x held whole: d_x = beta d_x + dy W (+ s (dy B) A), and
// the weight (and bias) gradients.
void linear_backward(backend& be, const mat_view& x, const mat_view& dy, const projection& w,
                     const projection_grads& g, const mat_view& d_x, float beta);

}  // namespace upipe
