// The argument checks the op entries share (backend/ops.cpp defines them), for the entry
// files beside it. Each throws with the op, the view, its shape and the rule it broke.
#pragma once

#include <cstdint>
#include <string>

#include "core/tensor.hpp"
#include "ops/op_args.hpp"

namespace upipe::ops::checks {

std::string describe(const mat_view& m);
std::string describe(const head_view& v);

// "ops::gemm: c (2 x 3, ld 3, f32): <rule>"
template <class View>
std::string fail(const char* op, const char* name, const View& v, const std::string& rule) {
  return std::string("ops::") + op + ": " + name + " " + describe(v) + ": " + rule;
}

void check_finite_scalar(const char* op, const char* name, float value, const char* example);
void check_matrix(const char* op, const char* name, const mat_view& m);
// Sizes non-negative and no two elements at one address.
void check_layout(const char* op, const char* name, const head_view& v);
void check_type(const char* op, const char* name, const mat_view& m, dtype want, dtype alt);
void check_type(const char* op, const char* name, const head_view& v, dtype want, dtype alt);
void check_dims(const char* op, const char* name, const mat_view& m, std::int64_t rows, std::int64_t cols);
void check_dims(const char* op, const char* name, const head_view& v, std::int64_t tokens, std::int64_t heads,
                std::int64_t dim);

}  // namespace upipe::ops::checks
