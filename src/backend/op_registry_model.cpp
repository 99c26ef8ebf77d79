// The registry's entries for the ops the model families brought beside Llama's: a
// projection's bias (Qwen2's q, k and v), added in forward and summed in backward.
#include <string>
#include <vector>

#include "backend/op_cases.hpp"
#include "backend/ops.hpp"

namespace upipe::op_cases {

namespace {

// y (rows, cols) viewed as columns [first, first + cols) of a wider buffer, so that strided
// rows run; y_type f32 is an accumulator's, work a projection output's.
struct bias_shape {
  std::int64_t rows, cols, pad, first;
  case_dtype y_type;
};

std::string bias_text(const bias_shape& b) {
  return dims_text({{"rows", b.rows}, {"cols", b.cols}, {"ld", b.cols + b.pad}}) +
         (b.y_type == case_dtype::f32 ? " f32" : "");
}

op_case bias_add_case(const bias_shape& b, double bytes) {
  op_case c;
  c.size = bias_text(b);
  c.tensors = {out({.name = "y", .type = b.y_type, .dims = {b.rows, b.cols + b.pad}}),
               {.name = "bias", .dims = {1, b.cols}}};
  c.run = [b](backend& be, const case_tensors& t) {
    ops::bias_add(be, {cols_of(t["y"], b.cols, b.first), t["bias"].matrix()});
  };
  c.float64 = [b](f64::host_case& h) { f64::bias_add(h, b.rows, b.cols, b.cols + b.pad, b.first); };
  c.bytes = bytes;
  return c;
}

// The objective is sum(y * d_y) over y = x + bias: its gradient by the bias is the
// column sums of d_y, which bias_grad adds to d_bias.
op_case bias_grad_case(const bias_shape& b, double bytes) {
  op_case c;
  c.size = bias_text(b);
  c.tensors = {{.name = "bias", .dims = {1, b.cols}},
               {.name = "x", .type = b.y_type, .dims = {b.rows, b.cols + b.pad}},
               {.name = "y", .type = b.y_type, .dims = {b.rows, b.cols + b.pad}},
               {.name = "d_y", .type = b.y_type, .dims = {b.rows, b.cols + b.pad}},
               // Rows summed in another order on another backend.
               out({.name = "d_bias", .type = case_dtype::f32, .dims = {1, b.cols}}, bf16_tol, 1e-5)};
  c.run = [b](backend& be, const case_tensors& t) {
    ops::bias_grad(be, {cols_of(t["d_y"], b.cols, b.first), t["d_bias"].matrix()});
  };
  c.objective = [b](backend& be, const case_tensors& t) {
    ops::copy_heads(be, ops::as_heads(t["y"].matrix()), ops::as_heads(t["x"].matrix()));
    ops::bias_add(be, {cols_of(t["y"], b.cols, b.first), t["bias"].matrix()});
    // Only the view's columns: the padding of d_y is not the bias's.
    std::vector<float> y(static_cast<std::size_t>(t["y"].numel())), d(y.size());
    be.download_f32(y.data(), t["y"]);
    be.download_f32(d.data(), t["d_y"]);
    const std::int64_t width = b.cols + b.pad;
    double sum = 0.0;
    for (std::int64_t r = 0; r < b.rows; ++r)
      for (std::int64_t j = b.first; j < b.first + b.cols; ++j)
        sum += static_cast<double>(y[static_cast<std::size_t>(r * width + j)]) * d[static_cast<std::size_t>(r * width + j)];
    return sum;
  };
  c.gradients = {{"bias", "d_bias"}};
  c.bytes = bytes;
  return c;
}

// Aligned rows, a strided view with odd columns, f32 rows, and more rows than a block's
// range of the CUDA gradient.
const bias_shape bias_test_shapes[] = {{33, 128, 0, 0, case_dtype::work},
                                       {17, 37, 5, 2, case_dtype::work},
                                       {9, 64, 3, 1, case_dtype::f32},
                                       {700, 96, 0, 0, case_dtype::work}};

op_entry bias_add_entry() {
  return {"bias_add",
          [] {
            std::vector<op_case> cases;
            for (const bias_shape& b : bias_test_shapes) cases.push_back(bias_add_case(b, 0.0));
            return cases;
          },
          [](std::int64_t tokens, dtype work) {
            // The q projection's bias over a shard of Llama3-8B's width.
            return bias_add_case({tokens, q_heads * head_dim, 0, 0, case_dtype::work},
                                 2.0 * tokens * q_heads * head_dim * dtype_size(work));
          }};
}

op_entry bias_grad_entry() {
  return {"bias_grad",
          [] {
            std::vector<op_case> cases;
            for (const bias_shape& b : bias_test_shapes) cases.push_back(bias_grad_case(b, 0.0));
            return cases;
          },
          [](std::int64_t tokens, dtype work) {
            return bias_grad_case({tokens, q_heads * head_dim, 0, 0, case_dtype::work},
                                  1.0 * tokens * q_heads * head_dim * dtype_size(work));
          }};
}

}  // namespace

std::vector<op_entry> model_op_entries() { return {bias_add_entry(), bias_grad_entry()}; }

}  // namespace upipe::op_cases
