// Helpers shared by the op tests: a small cpu backend, padded f32 matrices filled at
// random, i32 columns of ids or labels, error measures under which NaN cannot hide,
// central finite differences, and the message of an expected internal_error.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.hpp"
#include "core/error.hpp"

namespace upipe::op_test {

inline memory_limits small_limits() { return memory_limits{std::size_t{256} << 20, std::size_t{64} << 20}; }

inline std::unique_ptr<backend> make_test_backend() { return make_cpu_backend(small_limits()); }

// The larger of two errors, where NaN wins (std::max would silently drop it).
inline double worse(double err, double diff) {
  return std::isnan(err) || std::isnan(diff) ? diff + err : std::max(err, diff);
}

// A rows x cols f32 view inside a rows x (cols + pad) allocation, so ld > cols.
struct test_matrix {
  tensor storage;
  mat_view view;
  float& operator()(std::int64_t i, std::int64_t j) const { return static_cast<float*>(view.data)[i * view.ld + j]; }
};

// Every element, padding included, is drawn from [lo, hi).
inline test_matrix make_matrix(backend& be, std::int64_t rows, std::int64_t cols, std::int64_t pad, std::mt19937& rng,
                               float lo, float hi, const char* label) {
  tensor t = be.allocate(mem_tag::activations, dtype::f32, shape{rows, cols + pad}, label);
  std::uniform_real_distribution<float> dist(lo, hi);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.as<float>()[i] = dist(rng);
  mat_view v = t.matrix().col_block(0, cols);
  return {std::move(t), v};
}

// The view's elements row by row, without the padding.
inline std::vector<double> to_vector(const test_matrix& m) {
  std::vector<double> out;
  for (std::int64_t i = 0; i < m.view.rows; ++i)
    for (std::int64_t j = 0; j < m.view.cols; ++j) out.push_back(m(i, j));
  return out;
}

// Every element of the allocation, padding included, as stored.
inline std::vector<float> snapshot(const tensor& t) { return {t.as<float>(), t.as<float>() + t.numel()}; }

// max |got - want| / max |want| over the view.
inline double max_rel_error(const test_matrix& got, const std::vector<double>& want) {
  double err = 0.0, scale = 0.0;
  for (std::int64_t i = 0; i < got.view.rows; ++i)
    for (std::int64_t j = 0; j < got.view.cols; ++j) {
      err = worse(err, std::abs(got(i, j) - want[i * got.view.cols + j]));
      scale = std::max(scale, std::abs(want[i * got.view.cols + j]));
    }
  return err / scale;
}

// An (n x 1) i32 column of ids or labels inside an (n, 1 + pad) allocation; the padding
// holds INT32_MAX, which no vocabulary admits, so reading it throws.
struct index_column {
  tensor storage;
  mat_view view;
};

inline index_column make_index_column(backend& be, std::span<const std::int32_t> values, std::int64_t pad,
                                      const char* label) {
  const auto rows = static_cast<std::int64_t>(values.size());
  tensor t = be.allocate(mem_tag::activations, dtype::i32, shape{rows, 1 + pad}, label);
  std::fill(t.as<std::int32_t>(), t.as<std::int32_t>() + t.numel(), std::numeric_limits<std::int32_t>::max());
  for (std::int64_t i = 0; i < rows; ++i) t.as<std::int32_t>()[i * (1 + pad)] = values[i];
  mat_view v = t.matrix().col_block(0, 1);
  return {std::move(t), v};
}

// d eval / d input[i] for every i, by central differences in fp64.
inline std::vector<double> finite_differences(std::vector<double>& input, const std::function<double()>& eval,
                                              double step = 1e-6) {
  std::vector<double> grad(input.size());
  for (std::size_t i = 0; i < input.size(); ++i) {
    const double saved = input[i];
    input[i] = saved + step;
    const double up = eval();
    input[i] = saved - step;
    const double down = eval();
    input[i] = saved;
    grad[i] = (up - down) / (2 * step);
  }
  return grad;
}

// The message of the internal_error that call throws; empty when it throws none.
inline std::string internal_error_message(const std::function<void()>& call) {
  try {
    call();
  } catch (const internal_error& e) {
    return e.what();
  }
  return {};
}

// True when text contains every one of parts.
inline bool mentions(const std::string& text, std::initializer_list<std::string> parts) {
  return std::all_of(parts.begin(), parts.end(),
                     [&](const std::string& p) { return text.find(p) != std::string::npos; });
}

}  // namespace upipe::op_test
