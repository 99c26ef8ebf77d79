#include "cp/projection.hpp"

#include "backend/ops.hpp"
#include "core/error.hpp"

namespace upipe {

namespace {

// x A^T: the adapter's middle, (rows, r) in the working dtype.
tensor adapter_input(backend& be, const projection& w, const mat_view& x) {
  tensor xa = be.allocate(mem_tag::activations, be.work_dtype(), {x.rows, w.lora_a.rows}, "lora_xa");
  ops::gemm(be, {x, transpose::none, w.lora_a, transpose::yes, xa.matrix()});
  return xa;
}

}  // namespace

projection_forward::projection_forward(backend& be, const projection& w, const mat_view& x)
    : be_(be), w_(w), x_(x) {
  if (w_.adapted()) xa_ = adapter_input(be_, w_, x_);
}

void projection_forward::rows(std::int64_t first, std::int64_t count, const mat_view& y, float beta) const {
  w_.rows.for_each_run(first, count, [&](std::int64_t stored, std::int64_t offset, std::int64_t n) {
    const mat_view yr = y.col_block(offset, n);
    ops::gemm(be_, {x_, transpose::none, w_.weight.row_block(stored, n), transpose::yes, yr, 1.0f, beta});
    if (w_.bias.rows > 0) ops::bias_add(be_, {yr, w_.bias.col_block(stored, n)});
    if (w_.adapted())
      ops::gemm(be_, {xa_.matrix(), transpose::none, w_.lora_b.row_block(stored, n), transpose::yes, yr,
                      w_.lora_scale, 1.0f});
  });
}

projection_backward::projection_backward(backend& be, const projection& w, const projection_grads& g,
                                         std::int64_t tokens)
    : be_(be), w_(w), g_(g) {
  if (!w_.adapted()) return;
  UPIPE_CHECK(g_.lora_a.rows == w_.lora_a.rows && g_.lora_b.rows == w_.lora_b.rows,
              "an adapted projection's backward needs its adapter's gradients");
  gb_ = be_.allocate_zeroed(mem_tag::activations, dtype::f32, {tokens, w_.lora_a.rows}, "lora_d_middle");
}

void projection_backward::input_grad(const mat_view& dy, std::int64_t first, const mat_view& d_x, float beta) {
  w_.rows.for_each_run(first, dy.cols, [&](std::int64_t stored, std::int64_t offset, std::int64_t n) {
    const mat_view dyr = dy.col_block(offset, n);
    ops::gemm(be_, {dyr, transpose::none, w_.weight.row_block(stored, n), transpose::none, d_x, 1.0f,
                    offset == 0 ? beta : 1.0f});
    if (w_.adapted())
      ops::gemm(be_, {dyr, transpose::none, w_.lora_b.row_block(stored, n), transpose::none, gb_.matrix(), 1.0f,
                      1.0f});
  });
}

void projection_backward::finish_input_grad(const mat_view& d_x) {
  if (!w_.adapted()) return;
  gb_work_ = be_.allocate(mem_tag::activations, be_.work_dtype(), gb_.dims(), "lora_d_middle_work");
  ops::copy_heads(be_, ops::as_heads(gb_work_.matrix()), ops::as_heads(gb_.matrix()));
  gb_.reset();
  ops::gemm(be_, {gb_work_.matrix(), transpose::none, w_.lora_a, transpose::none, d_x, w_.lora_scale, 1.0f});
}

void projection_backward::start_tile(std::int64_t t0, const mat_view& x) {
  tile_ = x;
  if (!w_.adapted()) return;
  UPIPE_CHECK(!gb_work_.empty(), "projection_backward: finish_input_grad comes before the weight gradients");
  tile_xa_ = adapter_input(be_, w_, x);
  ops::gemm(be_, {gb_work_.matrix().row_block(t0, x.rows), transpose::yes, x, transpose::none, g_.lora_a,
                  w_.lora_scale, 1.0f});
}

void projection_backward::weight_grad(const mat_view& dy, std::int64_t first) {
  w_.rows.for_each_run(first, dy.cols, [&](std::int64_t stored, std::int64_t offset, std::int64_t n) {
    const mat_view dyr = dy.col_block(offset, n);
    if (g_.weight.rows > 0)
      ops::gemm(be_, {dyr, transpose::yes, tile_, transpose::none, g_.weight.row_block(stored, n), 1.0f, 1.0f});
    if (g_.bias.rows > 0) ops::bias_grad(be_, {dyr, g_.bias.col_block(stored, n)});
    if (w_.adapted())
      ops::gemm(be_, {dyr, transpose::yes, tile_xa_.matrix(), transpose::none, g_.lora_b.row_block(stored, n),
                      w_.lora_scale, 1.0f});
  });
}

void linear_forward(backend& be, const mat_view& x, const projection& w, const mat_view& y, float beta) {
  projection_forward(be, w, x).all(y, beta);
}

// One block of output columns: dy B needs no f32 sum across blocks, so it is the output of
// its one GEMM in the working dtype (the same rounding as projection_backward's copy) and
// the step holds fewer and smaller buffers.
void linear_backward(backend& be, const mat_view& x, const mat_view& dy, const projection& w,
                     const projection_grads& g, const mat_view& d_x, float beta) {
  if (w.rows.interleaved()) {  // the blocks' GEMMs, as a stage's heads take them
    projection_backward pass(be, w, g, x.rows);
    pass.input_grad(dy, 0, d_x, beta);
    pass.finish_input_grad(d_x);
    pass.start_tile(0, x);
    pass.weight_grad(dy, 0);
    return;
  }
  ops::gemm(be, {dy, transpose::none, w.weight, transpose::none, d_x, 1.0f, beta});
  if (g.weight.rows > 0) ops::gemm(be, {dy, transpose::yes, x, transpose::none, g.weight, 1.0f, 1.0f});
  if (g.bias.rows > 0) ops::bias_grad(be, {dy, g.bias});
  if (!w.adapted()) return;
  UPIPE_CHECK(g.lora_a.rows == w.lora_a.rows && g.lora_b.rows == w.lora_b.rows,
              "an adapted projection's backward needs its adapter's gradients");
  tensor gb = be.allocate(mem_tag::activations, be.work_dtype(), {x.rows, w.lora_a.rows}, "lora_d_middle_work");
  ops::gemm(be, {dy, transpose::none, w.lora_b, transpose::none, gb.matrix()});
  ops::gemm(be, {gb.matrix(), transpose::none, w.lora_a, transpose::none, d_x, w.lora_scale, 1.0f});
  ops::gemm(be, {gb.matrix(), transpose::yes, x, transpose::none, g.lora_a, w.lora_scale, 1.0f});
  gb.reset();
  const tensor xa = adapter_input(be, w, x);
  ops::gemm(be, {dy, transpose::yes, xa.matrix(), transpose::none, g.lora_b, w.lora_scale, 1.0f});
}

}  // namespace upipe
