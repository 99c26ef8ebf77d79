// The op harness: runs a registered op's case (backend/op_registry.hpp) on a tested backend
// and on the reference (cpu) from the same seeded values, and measures each compared
// output's normalized error; checks the reference itself against each op's float64
// definition, and a gradient op against central finite differences of its objective; runs a case on meta for shapes and allocations only; and times every
// registered op at a benchmark size (the perf mode behind `upipe bench-kernels --ops`).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "backend/op_registry.hpp"

namespace upipe {

// The case's tensors allocated on be and filled from seed: the same values on every
// backend, those of working-dtype tensors rounded to bf16 first so that a bf16 backend
// and an f32 one start from the same numbers.
case_tensors make_case_tensors(backend& be, const op_case& c, std::uint64_t seed);

// max |got - want| / max |want| over all elements; NaN, or an infinity where the other
// side has not the same one, is an infinite error.
double normalized_error(const std::vector<float>& got, const std::vector<float>& want);

// Over a (tokens, heads, dim) tensor: the worst head's sqrt(sum (got - want)^2 / sum want^2);
// NaN is an infinite error.
double head_rms_error(const std::vector<float>& got, const std::vector<float>& want, const shape& dims);

struct output_error {
  std::string output;
  double error = 0.0, tolerance = 0.0;
  bool ok() const { return error <= tolerance; }
};

// prepare and run on both backends; one row per compared output, its tolerance the one
// of the dtype the tested backend stores it in.
std::vector<output_error> compare_with_reference(backend& reference, backend& tested, const op_case& c,
                                                 std::uint64_t seed);

// prepare and run on `be` and the case's float64 reference (op_case::float64) from the same
// inputs: one row per compared output, its tolerance the one of the dtype `be` stores it in.
// The cpu backend, the reference of every other, is itself checked so.
std::vector<output_error> compare_with_float64(backend& be, const op_case& c, std::uint64_t seed);

// Finite differences in float32 on the reference: step fd_step on inputs of order one;
// the error of up to fd_samples elements per input, max |op - fd| / max |fd| over them,
// must stay within fd_tolerance (the f32 rounding of the objective over the step, and the
// step's own truncation, stay well below it).
inline constexpr float fd_step = 1e-2f;
inline constexpr int fd_samples = 24;
inline constexpr double fd_tolerance = 2e-2;
std::vector<output_error> check_gradients(backend& reference, const op_case& c, std::uint64_t seed);

// meta: allocations and the entries' checks, no data. Throws what an entry throws;
// returns the device bytes the case's tensors took.
std::size_t run_shapes_only(backend& meta, const op_case& c);

// ---------------------------------------------------------------------------------------
// Perf mode

struct perf_peaks {
  double copy_gbytes_per_s = 0.0;  // device-to-device copy_bytes of a large buffer
  double gemm_tflops = 0.0;        // the square GEMM of hidden size at `tokens` rows
};

struct op_timing {
  std::string op, size;
  double ms = 0.0, gbytes_per_s = 0.0, tflops = 0.0;
  double share_of_peak = 0.0;  // GB/s over the copy bandwidth, or TFLOP/s over the GEMM's
};

// Mean time of fn over `repeats` runs after one warm-up, the backend synchronized around them.
double time_mean_ms(backend& be, int repeats, const std::function<void()>& fn);
perf_peaks measure_peaks(backend& be, std::int64_t tokens, int repeats);
// Every registered op at `tokens` (each op's perf_case), run (not prepare) timed.
std::vector<op_timing> time_registered_ops(backend& be, std::int64_t tokens, int repeats, const perf_peaks& peaks);
// A header, one fixed-width row per op (op, size, time, GB/s, TFLOP/s, % of peak) and a
// summary line, as nccl-tests prints.
void print_op_timings(std::FILE* out, const std::vector<op_timing>& rows, const perf_peaks& peaks);

}  // namespace upipe
