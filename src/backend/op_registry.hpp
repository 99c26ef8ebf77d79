// The registry of ops: one entry per op, saying how to build its arguments at a few test
// shapes and at a benchmark size, which outputs to compare across backends, and, for a
// gradient op, the scalar whose gradient it computes. The harness (backend/op_harness.hpp)
// sweeps every entry on every backend, so an op is tested the day it is registered.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "backend/backend.hpp"
#include "backend/op_float64.hpp"
#include "core/tensor.hpp"

namespace upipe {

// The element type of a case's tensor, resolved on each backend: `work` is the backend's
// working dtype (f32 on cpu, bf16 on cuda and meta); bf16 and u8 (8-bit codes) are those
// on every backend.
enum class case_dtype : std::uint8_t { work, f32, i32, bf16, u8 };
// random: uniform in [lo, hi); zero; constant: every element lo (-inf for an empty
// log-sum-exp); ids: integers uniform in [lo, hi) (i32 and u8 only; negative labels are
// masked).
enum class case_fill : std::uint8_t { random, zero, constant, ids };

struct case_tensor {
  const char* name;
  case_dtype type = case_dtype::work;
  shape dims;
  case_fill fill = case_fill::random;
  float lo = -1.0f, hi = 1.0f;
  // > 0: an output compared against the reference backend, the normalized error (max
  // |got - want| / max |want|, over the whole allocation) at most this where the tested
  // backend stores a working-dtype tensor in bf16; f32_tolerance where it stores it as the
  // reference does (f32, or a bf16 or u8 tensor on every backend).
  double bf16_tolerance = 0.0;
  double f32_tolerance = 1e-5;
  // How the error is measured: the normalized error above, or (for outputs of FP8 attention,
  // where an element may land one FP8 step away) the worst head's relative RMS error over a
  // (tokens, heads, dim) tensor.
  bool per_head_rms = false;
};

// A case's tensors on one backend, found by name.
class case_tensors {
 public:
  case_tensors(const std::vector<case_tensor>* specs, std::vector<tensor> list)
      : specs_(specs), list_(std::move(list)) {}
  const tensor& operator[](std::string_view name) const;
  const std::vector<tensor>& list() const { return list_; }

 private:
  const std::vector<case_tensor>* specs_;
  std::vector<tensor> list_;
};

using case_step = std::function<void(backend&, const case_tensors&)>;

struct op_case {
  std::string size;  // "rows 37 cols 96", a row label for tests and the perf mode
  std::vector<case_tensor> tensors;
  case_step prepare;  // optional: the forward state a backward op reads (not timed)
  case_step run;      // the op, through its checked entry in backend/ops.hpp
  // Work of one run, for the perf mode: FLOPs (compute-bound ops) and bytes moved.
  double flops = 0.0, bytes = 0.0;
  // Gradient ops: the scalar whose gradient the op computes (from the same tensors, after
  // prepare), and (input, gradient of the scalar by that input) name pairs, checked by
  // central finite differences on the reference backend.
  std::function<double(backend&, const case_tensors&)> objective;
  std::vector<std::pair<const char*, const char*>> gradients;
  // Every other op: the op in float64 on the host (backend/op_float64.hpp), which the cpu
  // backend's outputs are compared with. Each case has this or gradients, or else
  // reference_test: the test that holds this mode of the op to its definition (AdamW's
  // low-precision modes: tests/optim/adamw_modes_test.cpp).
  std::function<void(f64::host_case&)> float64;
  std::string reference_test;
};

struct op_entry {
  const char* name;
  std::function<std::vector<op_case>()> test_cases;         // small shapes, edge cases included
  // Llama3-8B-like shapes at `tokens`; `work` sizes the bytes moved.
  std::function<op_case(std::int64_t tokens, dtype work)> perf_case;
};

// Every registered op.
const std::vector<op_entry>& op_registry();

// sum a[i] * b[i] over two f32 or bf16 tensors of one size, in fp64 on the host (the
// objectives of the gradient ops).
double host_dot(backend& be, const tensor& a, const tensor& b);

}  // namespace upipe
