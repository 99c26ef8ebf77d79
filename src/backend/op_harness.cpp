#include "backend/op_harness.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "backend/ops.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/random.hpp"

namespace upipe {

namespace {

dtype resolve(case_dtype type, const backend& be) {
  switch (type) {
    case case_dtype::work:
      return be.work_dtype();
    case case_dtype::f32:
      return dtype::f32;
    case case_dtype::i32:
      return dtype::i32;
    case case_dtype::bf16:
      return dtype::bf16;
    case case_dtype::u8:
      return dtype::u8;
  }
  return dtype::f32;
}

// Uniform in [lo, hi) from the seed, one stream per tensor.
std::vector<float> uniform_values(std::int64_t n, std::uint64_t seed, std::uint64_t stream, float lo, float hi) {
  std::vector<float> v(static_cast<std::size_t>(n));
  fill_uniform(v, seed, stream, 1.0f);
  for (float& x : v) x = lo + (x + 1.0f) * 0.5f * (hi - lo);
  return v;
}

void fill_tensor(backend& be, const tensor& t, const case_tensor& spec, std::uint64_t seed, std::uint64_t stream) {
  const std::int64_t n = t.numel();
  if (spec.fill == case_fill::ids && t.type() == dtype::u8) {
    const std::vector<float> u = uniform_values(n, seed, stream, spec.lo, spec.hi);
    std::vector<std::uint8_t> codes(u.size());
    for (std::size_t i = 0; i < u.size(); ++i)
      codes[i] = static_cast<std::uint8_t>(std::clamp(std::floor(u[i]), spec.lo, spec.hi - 1));
    be.upload_bytes(t, codes.data(), codes.size());
    return;
  }
  if (spec.fill == case_fill::ids) {
    const std::vector<float> u = uniform_values(n, seed, stream, spec.lo, spec.hi);
    std::vector<std::int32_t> ids(u.size());
    for (std::size_t i = 0; i < u.size(); ++i)
      ids[i] = std::min(static_cast<std::int32_t>(std::floor(u[i])), static_cast<std::int32_t>(spec.hi) - 1);
    be.upload_bytes(t, ids.data(), ids.size() * sizeof(std::int32_t));
    return;
  }
  std::vector<float> v = spec.fill == case_fill::random ? uniform_values(n, seed, stream, spec.lo, spec.hi)
                                                        : std::vector<float>(static_cast<std::size_t>(n),
                                                                             spec.fill == case_fill::zero ? 0.0f
                                                                                                          : spec.lo);
  if (spec.type == case_dtype::work || spec.type == case_dtype::bf16)
    for (float& x : v) x = round_to_bf16(x);
  be.upload_f32(t, v.data());
}

std::vector<float> fetch(backend& be, const tensor& t) {
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  if (t.type() == dtype::u8) {  // codes, compared as numbers
    std::vector<std::uint8_t> codes(out.size());
    be.download_bytes(codes.data(), t, codes.size());
    std::copy(codes.begin(), codes.end(), out.begin());
    return out;
  }
  if (t.type() == dtype::i32) {  // ids and rows (exact below 2^24), compared as numbers
    std::vector<std::int32_t> ids(out.size());
    be.download_bytes(ids.data(), t, ids.size() * sizeof(std::int32_t));
    std::copy(ids.begin(), ids.end(), out.begin());
    return out;
  }
  be.download_f32(out.data(), t);
  return out;
}

void prepare_and_run(backend& be, const op_case& c, const case_tensors& t) {
  if (c.prepare) c.prepare(be, t);
  c.run(be, t);
  be.synchronize();
}

// Up to fd_samples element indices spread over [0, n), from the seed.
std::vector<std::int64_t> sample_indices(std::int64_t n, std::uint64_t seed) {
  std::vector<std::int64_t> out;
  if (n <= fd_samples) {
    for (std::int64_t i = 0; i < n; ++i) out.push_back(i);
    return out;
  }
  const std::int64_t stride = n / fd_samples;
  for (std::int64_t k = 0; k < fd_samples; ++k)
    out.push_back(k * stride + static_cast<std::int64_t>((seed + 7919 * static_cast<std::uint64_t>(k)) % stride));
  return out;
}

}  // namespace

case_tensors make_case_tensors(backend& be, const op_case& c, std::uint64_t seed) {
  std::vector<tensor> list;
  for (std::size_t i = 0; i < c.tensors.size(); ++i) {
    const case_tensor& spec = c.tensors[i];
    list.push_back(be.allocate(mem_tag::activations, resolve(spec.type, be), spec.dims, spec.name));
    if (be.has_data()) fill_tensor(be, list.back(), spec, seed, i);
  }
  return {&c.tensors, std::move(list)};
}

double normalized_error(const std::vector<float>& got, const std::vector<float>& want) {
  const double inf = std::numeric_limits<double>::infinity();
  if (got.size() != want.size()) return inf;
  double err = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i]) || std::isinf(got[i])) {
      if (got[i] != want[i]) err = inf;
      continue;
    }
    const double diff = std::abs(static_cast<double>(got[i]) - want[i]);
    err = std::isnan(diff) ? inf : std::max(err, diff);
    scale = std::max(scale, std::abs(static_cast<double>(want[i])));
  }
  return scale > 0.0 ? err / scale : err;
}

double head_rms_error(const std::vector<float>& got, const std::vector<float>& want, const shape& dims) {
  const double inf = std::numeric_limits<double>::infinity();
  if (got.size() != want.size() || dims.rank != 3) return inf;
  const std::int64_t tokens = dims[0], heads = dims[1], dim = dims[2];
  std::vector<double> err(static_cast<std::size_t>(heads), 0.0), ref(static_cast<std::size_t>(heads), 0.0);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t x = 0; x < dim; ++x) {
        const auto i = static_cast<std::size_t>((t * heads + h) * dim + x);
        const double diff = static_cast<double>(got[i]) - want[i];
        err[static_cast<std::size_t>(h)] += std::isnan(diff) ? inf : diff * diff;
        ref[static_cast<std::size_t>(h)] += static_cast<double>(want[i]) * want[i];
      }
  double worst = 0.0;
  for (std::size_t h = 0; h < err.size(); ++h)
    worst = std::max(worst, ref[h] > 0.0 ? std::sqrt(err[h] / ref[h]) : std::sqrt(err[h]));
  return worst;
}

std::vector<output_error> compare_with_reference(backend& reference, backend& tested, const op_case& c,
                                                 std::uint64_t seed) {
  const case_tensors want = make_case_tensors(reference, c, seed);
  const case_tensors got = make_case_tensors(tested, c, seed);
  prepare_and_run(reference, c, want);
  prepare_and_run(tested, c, got);
  std::vector<output_error> errors;
  for (std::size_t i = 0; i < c.tensors.size(); ++i) {
    const case_tensor& spec = c.tensors[i];
    if (spec.bf16_tolerance <= 0.0) continue;
    const tensor& g = got.list()[i];
    const std::vector<float> a = fetch(tested, g), b = fetch(reference, want.list()[i]);
    errors.push_back({spec.name, spec.per_head_rms ? head_rms_error(a, b, spec.dims) : normalized_error(a, b),
                      g.type() == dtype::bf16 && spec.type != case_dtype::bf16 ? spec.bf16_tolerance
                                                                                : spec.f32_tolerance});
  }
  return errors;
}

namespace {

// A tensor's values on the host in float64 (i32 tensors: their ids).
std::vector<double> fetch_f64(backend& be, const tensor& t) {
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  if (t.type() == dtype::i32) {
    std::vector<std::int32_t> ids(out.size());
    be.download_bytes(ids.data(), t, ids.size() * sizeof(std::int32_t));
    std::copy(ids.begin(), ids.end(), out.begin());
  } else {
    const std::vector<float> values = fetch(be, t);
    std::copy(values.begin(), values.end(), out.begin());
  }
  return out;
}

}  // namespace

std::vector<output_error> compare_with_float64(backend& be, const op_case& c, std::uint64_t seed) {
  UPIPE_CHECK(c.float64 != nullptr, "compare_with_float64: the case " + c.size + " has no float64 reference");
  const case_tensors t = make_case_tensors(be, c, seed);
  if (c.prepare) c.prepare(be, t);
  be.synchronize();
  f64::host_case want;
  for (std::size_t i = 0; i < c.tensors.size(); ++i) want[c.tensors[i].name] = fetch_f64(be, t.list()[i]);
  c.run(be, t);
  be.synchronize();
  c.float64(want);
  std::vector<output_error> errors;
  for (std::size_t i = 0; i < c.tensors.size(); ++i) {
    const case_tensor& spec = c.tensors[i];
    if (spec.bf16_tolerance <= 0.0) continue;
    const std::vector<double>& expected = want.at(spec.name);
    const std::vector<float> rounded(expected.begin(), expected.end());
    const tensor& g = t.list()[i];
    // A case's tolerance is against another backend's f32 arithmetic and may be exact (0);
    // against float64 an f32 result carries its own rounding, a few ulps.
    constexpr double f32_rounding = 1e-6;
    errors.push_back({spec.name, normalized_error(fetch(be, g), rounded),
                      g.type() == dtype::bf16 ? spec.bf16_tolerance : std::max(spec.f32_tolerance, f32_rounding)});
  }
  return errors;
}

std::vector<output_error> check_gradients(backend& reference, const op_case& c, std::uint64_t seed) {
  UPIPE_CHECK(reference.kind() == backend_kind::cpu, "finite differences run on the cpu backend");
  const case_tensors t = make_case_tensors(reference, c, seed);
  // Gradients start at zero, so the padding around a view reads as the zero gradient that
  // perturbing it gives.
  for (const auto& [input, grad] : c.gradients) reference.fill_bytes(t[grad].data(), 0, t[grad].bytes());
  prepare_and_run(reference, c, t);
  std::vector<std::vector<float>> op_grads;
  for (const auto& [input, grad] : c.gradients) op_grads.push_back(fetch(reference, t[grad]));

  std::vector<output_error> errors;
  for (std::size_t g = 0; g < c.gradients.size(); ++g) {
    const tensor& x = t[c.gradients[g].first];
    UPIPE_CHECK(x.type() == dtype::f32 && x.numel() == static_cast<std::int64_t>(op_grads[g].size()),
                std::string("finite differences need an f32 input the size of its gradient: ") + x.label());
    float* data = x.as<float>();
    double err = 0.0, scale = 0.0;
    for (const std::int64_t i : sample_indices(x.numel(), seed)) {
      const float saved = data[i];
      data[i] = saved + fd_step;
      const float up_at = data[i];
      const double up = c.objective(reference, t);
      data[i] = saved - fd_step;
      const float down_at = data[i];
      const double down = c.objective(reference, t);
      data[i] = saved;
      const double fd = (up - down) / (static_cast<double>(up_at) - down_at);
      const double diff = std::abs(fd - op_grads[g][static_cast<std::size_t>(i)]);
      err = std::isnan(diff) ? std::numeric_limits<double>::infinity() : std::max(err, diff);
      scale = std::max(scale, std::abs(fd));
    }
    errors.push_back({std::string("d/d ") + c.gradients[g].first, scale > 0.0 ? err / scale : err, fd_tolerance});
  }
  return errors;
}

std::size_t run_shapes_only(backend& meta, const op_case& c) {
  const std::size_t before = meta.device_arena().in_use();
  const case_tensors t = make_case_tensors(meta, c, 0);
  const std::size_t taken = meta.device_arena().in_use() - before;
  prepare_and_run(meta, c, t);
  return taken;
}

// ---------------------------------------------------------------------------------------
// Perf mode

double time_mean_ms(backend& be, int repeats, const std::function<void()>& fn) {
  fn();
  be.synchronize();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < repeats; ++i) fn();
  be.synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / repeats;
}

perf_peaks measure_peaks(backend& be, std::int64_t tokens, int repeats) {
  perf_peaks peaks;
  const std::int64_t words = std::int64_t{64} << 20;  // 256 MiB each way
  tensor src = be.allocate_zeroed(mem_tag::activations, dtype::f32, {words}, "peak_copy_src");
  tensor dst = be.allocate(mem_tag::activations, dtype::f32, {words}, "peak_copy_dst");
  const double copy_ms = time_mean_ms(be, repeats, [&] { be.copy_bytes(dst.data(), src.data(), src.bytes()); });
  peaks.copy_gbytes_per_s = 2.0 * static_cast<double>(src.bytes()) / (copy_ms * 1e6);
  for (const op_entry& e : op_registry()) {
    if (std::string_view(e.name) != "gemm") continue;
    const op_case c = e.perf_case(tokens, be.work_dtype());
    const case_tensors t = make_case_tensors(be, c, 1);
    const double ms = time_mean_ms(be, repeats, [&] { c.run(be, t); });
    peaks.gemm_tflops = c.flops / (ms * 1e9);
  }
  return peaks;
}

std::vector<op_timing> time_registered_ops(backend& be, std::int64_t tokens, int repeats, const perf_peaks& peaks) {
  std::vector<op_timing> rows;
  for (const op_entry& e : op_registry()) {
    const op_case c = e.perf_case(tokens, be.work_dtype());
    const case_tensors t = make_case_tensors(be, c, 1);
    if (c.prepare) c.prepare(be, t);
    op_timing row{e.name, c.size, time_mean_ms(be, repeats, [&] { c.run(be, t); })};
    row.gbytes_per_s = c.bytes / (row.ms * 1e6);
    row.tflops = c.flops / (row.ms * 1e9);
    row.share_of_peak = c.flops > 0.0 ? (peaks.gemm_tflops > 0.0 ? row.tflops / peaks.gemm_tflops : 0.0)
                                      : (peaks.copy_gbytes_per_s > 0.0 ? row.gbytes_per_s / peaks.copy_gbytes_per_s : 0.0);
    rows.push_back(row);
  }
  return rows;
}

void print_op_timings(std::FILE* out, const std::vector<op_timing>& rows, const perf_peaks& peaks) {
  std::fprintf(out, "# peaks: device copy %.1f GB/s, gemm %.1f TFLOP/s\n", peaks.copy_gbytes_per_s, peaks.gemm_tflops);
  std::fprintf(out, "%-20s %-44s %12s %10s %10s %8s\n", "op", "size", "time_us", "GB/s", "TFLOP/s", "%peak");
  double total_ms = 0.0;
  for (const op_timing& r : rows) {
    std::fprintf(out, "%-20s %-44s %12.1f %10.1f %10.2f %8.1f\n", r.op.c_str(), r.size.c_str(), r.ms * 1e3,
                 r.gbytes_per_s, r.tflops, 100.0 * r.share_of_peak);
    total_ms += r.ms;
  }
  std::fprintf(out, "# %zu ops, %.3f ms in all\n", rows.size(), total_ms);
}

}  // namespace upipe
