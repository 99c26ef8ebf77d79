// AdamW on a flat shard in every state format, and the fp64 sum of squares behind the
// global gradient norm: the arithmetic of ops/adamw_formula.hpp written so that the
// compiler vectorizes it, every lane computing exactly what the scalar loop would (this
// file compiles with contraction off and without errno from sqrt, so that the vector
// loop and its scalar tail round alike). The f32 path, the one the offload's host runs
// most, is built three times on x86-64 (AVX-512, AVX2, baseline) and the loader picks
// the widest the CPU has. q8 moments go a block of q8_block elements at a time: decode
// with the block's absmax, update, take the new absmax, encode. One call runs on the
// calling thread; the host optimizer spreads pieces of a shard over every core.
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "ops/adamw_formula.hpp"
#include "ops/cpu/cpu_ops.hpp"
#include "ops/q8_map.hpp"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(UPIPE_NO_SIMD_CLONES)
#define UPIPE_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define UPIPE_SIMD_CLONES
#endif

namespace upipe::cpu {

namespace {

using bf16_t = std::uint16_t;

// A stored value as fp32 and back: T is float or bf16 bits.
template <class T>
[[gnu::always_inline]] inline float load(const T* p, std::int64_t i) {
  if constexpr (std::is_same_v<T, float>) return p[i];
  else return bf16_value(p[i]);
}
template <class T>
[[gnu::always_inline]] inline void store(T* p, std::int64_t i, float x) {
  if constexpr (std::is_same_v<T, float>) p[i] = x;
  else p[i] = bf16_bits(x);
}

// The master half of element i: P is float (f32 master), bf16_t (bf16-kahan) or void
// (the moments half alone: the step goes to `direction`); W the working copy's element
// (float, bf16 bits) or void.
template <class P, class W>
[[gnu::always_inline]] inline void finish(const adamw_pointers& q, std::int64_t i, adamw_decay d, float step) {
  if constexpr (std::is_void_v<P>) {
    q.direction[i] = step;
  } else if constexpr (std::is_same_v<P, float>) {
    const float p = adamw_master(static_cast<float*>(q.master)[i], d, step);
    static_cast<float*>(q.master)[i] = p;
    if constexpr (!std::is_void_v<W>) store(static_cast<W*>(q.weights), i, p);
  } else {
    bf16_t& w = static_cast<bf16_t*>(q.master)[i];
    adamw_master_kahan(w, q.comp[i], d, step);
    if constexpr (std::is_same_v<W, float>) static_cast<float*>(q.weights)[i] = bf16_value(w);
    if constexpr (std::is_same_v<W, bf16_t>) static_cast<bf16_t*>(q.weights)[i] = w;
  }
}

// Elements [a, b) with f32 or bf16 moments M (void: the master half alone, reading
// `direction`), gradients G, one decay.
template <class M, class G, class P, class W>
[[gnu::always_inline]] inline void elementwise(const adamw_coefficients& c, adamw_decay d, const adamw_pointers& q,
                                               std::int64_t a, std::int64_t b) {
  const adamw_coefficients k = c;  // in registers: no store below can change it
#pragma omp simd
  for (std::int64_t i = a; i < b; ++i) {
    float step;
    if constexpr (std::is_void_v<M>) {
      step = q.direction[i];
    } else {
      float m = load(static_cast<const M*>(q.m), i), v = load(static_cast<const M*>(q.v), i);
      step = adamw_moments(k, m, v, load(static_cast<const G*>(q.grad), i));
      store(static_cast<M*>(q.m), i, m);
      store(static_cast<M*>(q.v), i, v);
    }
    finish<P, W>(q, i, d, step);
  }
}

// The hot path of the offload: f32 moments, gradients and master, vectorized for the
// widest instruction set the CPU has.
UPIPE_SIMD_CLONES void f32_whole(const adamw_coefficients& c, adamw_decay d, const adamw_pointers& q, std::int64_t a,
                                 std::int64_t b) {
  elementwise<float, float, float, void>(c, d, q, a, b);
}
UPIPE_SIMD_CLONES void f32_whole_f32_copy(const adamw_coefficients& c, adamw_decay d, const adamw_pointers& q,
                                          std::int64_t a, std::int64_t b) {
  elementwise<float, float, float, float>(c, d, q, a, b);
}
UPIPE_SIMD_CLONES void f32_whole_bf16_copy(const adamw_coefficients& c, adamw_decay d, const adamw_pointers& q,
                                           std::int64_t a, std::int64_t b) {
  elementwise<float, float, float, bf16_t>(c, d, q, a, b);
}

// q8 moments, blocks [first, last) of the call: decode, update, the new absmax, encode;
// the master half per element with the decay of its run.
template <class G, class P, class W>
void q8_blocks(const adamw_coefficients& c, std::span<const adamw_run> runs, const adamw_pointers& q, std::int64_t first,
               std::int64_t last) {
  const q8_map& sm = q8_signed_map();
  const q8_map& um = q8_unsigned_map();
  auto* mc = static_cast<std::uint8_t*>(q.m);
  auto* vc = static_cast<std::uint8_t*>(q.v);
  std::size_t run = 0;
  for (std::int64_t blk = first; blk < last; ++blk) {
    const std::int64_t base = blk * q8_block;
    float m[q8_block], v[q8_block], step[q8_block];
    const float a1 = q.m_absmax[blk], a2 = q.v_absmax[blk];
    for (std::int64_t j = 0; j < q8_block; ++j) {
      m[j] = sm.code[mc[base + j]] * a1;
      v[j] = um.code[vc[base + j]] * a2;
      step[j] = adamw_moments(c, m[j], v[j], load(static_cast<const G*>(q.grad), base + j));
    }
    float n1 = 0.0f, n2 = 0.0f;
    for (std::int64_t j = 0; j < q8_block; ++j) {
      const float x = std::fabs(m[j]), y = std::fabs(v[j]);
      n1 = x > n1 ? x : n1;  // a NaN never wins, as fmaxf on the GPU
      n2 = y > n2 ? y : n2;
    }
    q.m_absmax[blk] = n1;
    q.v_absmax[blk] = n2;
    const float i1 = q8_inverse(n1), i2 = q8_inverse(n2);
    for (std::int64_t j = 0; j < q8_block; ++j) {
      mc[base + j] = q8_code(sm.mid, q8_scaled(m[j], i1));
      vc[base + j] = q8_code(um.mid, q8_scaled(v[j], i2));
    }
    for (std::int64_t j = 0; j < q8_block; ++j) {
      const std::int64_t i = base + j;
      while (!runs.empty() && runs[run].end <= i) ++run;
      finish<P, W>(q, i, decay_of(c, runs.empty() || runs[run].decay), step[j]);
    }
  }
}

// The working copy's element type for a call.
template <class F>
void with_weights(const adamw_args& a, F&& f) {
  if (a.weights.data == nullptr || a.weights.cols == 0) f(static_cast<void*>(nullptr));
  else if (a.weights.type == dtype::bf16) f(static_cast<bf16_t*>(nullptr));
  else f(static_cast<float*>(nullptr));
}

template <class F>
void with_grad(const adamw_args& a, F&& f) {
  if (a.grad.type == dtype::bf16) f(static_cast<bf16_t*>(nullptr));
  else f(static_cast<float*>(nullptr));
}

// The master half's type: void for the moments half alone.
template <class F>
void with_master(const adamw_args& a, F&& f) {
  if (a.part == adamw_part::moments) f(static_cast<void*>(nullptr));
  else if (a.master.type == dtype::bf16) f(static_cast<bf16_t*>(nullptr));
  else f(static_cast<float*>(nullptr));
}

// Runs [a, b) of the call with one decay each (the whole call for no runs).
template <class F>
void for_each_run(const adamw_args& a, F&& f) {
  const std::int64_t n = a.part == adamw_part::master ? a.master.cols : a.grad.cols;
  if (a.runs.empty()) return f(0, n, true);  // weight_decay on every element
  std::int64_t begin = 0;
  for (const adamw_run& r : a.runs) {
    f(begin, r.end, r.decay);
    begin = r.end;
  }
}

void run_elementwise(const adamw_args& args, const adamw_coefficients& c, const adamw_pointers& q) {
  const bool f32_moments = args.exp_avg.type == dtype::f32;
  for_each_run(args, [&](std::int64_t a, std::int64_t b, bool decays) {
    const adamw_decay d = decay_of(c, decays);
    // The vectorized clones for the common case.
    if (args.part == adamw_part::whole && f32_moments && args.grad.type == dtype::f32 && args.master.type == dtype::f32) {
      if (q.weights == nullptr) return f32_whole(c, d, q, a, b);
      if (args.weights.type == dtype::bf16) return f32_whole_bf16_copy(c, d, q, a, b);
      return f32_whole_f32_copy(c, d, q, a, b);
    }
    with_master(args, [&]<class P>(P*) {
      with_weights(args, [&]<class W>(W*) {
        if constexpr (std::is_void_v<P> && !std::is_void_v<W>) {
          throw internal_error("adamw: the moments half writes no working copy");
        } else if (args.part == adamw_part::master) {
          elementwise<void, float, P, W>(c, d, q, a, b);
        } else {
          with_grad(args, [&]<class G>(G*) {
            if (f32_moments) elementwise<float, G, P, W>(c, d, q, a, b);
            else elementwise<bf16_t, G, P, W>(c, d, q, a, b);
          });
        }
      });
    });
  });
}

// f32 or bf16 x: eight fp64 lanes, lane j summing the squares of the elements i = j (mod
// 8) in order, then added as a fixed tree, so that a vector of any width computes the
// same sums.
template <class T>
[[gnu::always_inline]] inline double lane_sum(const T* x, std::int64_t n) {
  double lane[8] = {};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) {
      const double v = load(x, i + j);
      lane[j] += v * v;
    }
  for (; i < n; ++i) {
    const double v = load(x, i);
    lane[i & 7] += v * v;
  }
  return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}
UPIPE_SIMD_CLONES double lane_sum_squares(const float* x, std::int64_t n) { return lane_sum(x, n); }
double lane_sum_squares(const bf16_t* x, std::int64_t n) { return lane_sum(x, n); }

UPIPE_SIMD_CLONES void add_loop(float* __restrict dst, const float* __restrict src, std::int64_t n) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) dst[i] += src[i];
}
void add_loop(bf16_t* __restrict dst, const float* __restrict src, std::int64_t n) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) dst[i] = bf16_bits(bf16_value(dst[i]) + src[i]);
}

}  // namespace

void accumulate(float* dst, const float* src, std::int64_t n) { add_loop(dst, src, n); }
void accumulate(std::uint16_t* dst, const float* src, std::int64_t n) { add_loop(dst, src, n); }

void run(const adamw_args& args) {
  const adamw_coefficients c = adamw_coefficients_of(args);
  const adamw_pointers q = pointers_of(args);
  if (args.part == adamw_part::master || args.exp_avg.type != dtype::u8) return run_elementwise(args, c, q);
  const std::int64_t blocks = args.grad.cols / q8_block;
  with_master(args, [&]<class P>(P*) {
    with_weights(args, [&]<class W>(W*) {
      if constexpr (std::is_void_v<P> && !std::is_void_v<W>) {
        throw internal_error("adamw: the moments half writes no working copy");
      } else {
        with_grad(args, [&]<class G>(G*) { q8_blocks<G, P, W>(c, args.runs, q, 0, blocks); });
      }
    });
  });
}

void sum_squares_blocks(const float* x, std::int64_t n, double* block_sums) {
  for (std::int64_t b = 0; b * sum_squares_block < n; ++b) {
    const std::int64_t begin = b * sum_squares_block;
    block_sums[b] = lane_sum_squares(x + begin, n - begin < sum_squares_block ? n - begin : sum_squares_block);
  }
}

void sum_squares_blocks(const std::uint16_t* x, std::int64_t n, double* block_sums) {
  for (std::int64_t b = 0; b * sum_squares_block < n; ++b) {
    const std::int64_t begin = b * sum_squares_block;
    block_sums[b] = lane_sum_squares(x + begin, n - begin < sum_squares_block ? n - begin : sum_squares_block);
  }
}

void run(const sum_squares_args& args) {
  const mat_view& x = args.x;
  const std::size_t element = dtype_size(x.type);
  double sum = 0.0;
  for (std::int64_t r = 0; r < x.rows; ++r) {
    const char* row = static_cast<const char*>(x.data) + static_cast<std::size_t>(r * x.ld) * element;
    for (std::int64_t begin = 0; begin < x.cols; begin += sum_squares_block) {
      const std::int64_t n = x.cols - begin < sum_squares_block ? x.cols - begin : sum_squares_block;
      sum += x.type == dtype::bf16 ? lane_sum_squares(reinterpret_cast<const bf16_t*>(row) + begin, n)
                                   : lane_sum_squares(reinterpret_cast<const float*>(row) + begin, n);
    }
  }
  *args.result = sum;
}

}  // namespace upipe::cpu
