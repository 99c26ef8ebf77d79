// The optimizer's kernels: one AdamW step on a flat shard in every state format
// (ops/adamw_formula.hpp, the arithmetic of the cpu backend and the host optimizer; this
// file compiles with --fmad=false so that each product and sum rounds as on the host),
// and the fp64 sum of squares behind the gradient norm (block sums in fp64, added to the
// result with one atomic a block, so the last bits may vary from run to run).
// f32 and bf16 moments go element by element, one launch per weight-decay run; q8 moments
// a block of q8_block elements per thread block: decode with the block's absmax, update,
// reduce the new absmax, encode, with the maps and the runs in the kernel's parameters.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/error.hpp"
#include "ops/adamw_formula.hpp"
#include "ops/cuda/cuda_ops.hpp"
#include "ops/cuda/kernels_common.cuh"
#include "ops/q8_map.hpp"

namespace upipe::cuda {

namespace {

using namespace kernels;
using bf16_bits_t = std::uint16_t;

constexpr kernel_config adamw_config{.threads = 256, .blocks_per_sm = 8};
constexpr kernel_config q8_config{.threads = static_cast<int>(q8_block), .blocks_per_sm = 8};
constexpr kernel_config sum_squares_config{.threads = 256, .blocks_per_sm = 8};
constexpr int vec_width = 4;  // floats per 16-byte access

template <class T>
__device__ __forceinline__ float load_value(const void* p, std::int64_t i) {
  if constexpr (std::is_same_v<T, float>) return static_cast<const float*>(p)[i];
  else return bf16_value(static_cast<const bf16_bits_t*>(p)[i]);
}
template <class T>
__device__ __forceinline__ void store_value(void* p, std::int64_t i, float x) {
  if constexpr (std::is_same_v<T, float>) static_cast<float*>(p)[i] = x;
  else static_cast<bf16_bits_t*>(p)[i] = bf16_bits(x);
}

// The master half of element i (P: float, bf16 bits for bf16-kahan, void for the moments
// half alone, which writes the step to direction), then the working copy W.
template <class P, class W>
__device__ __forceinline__ void finish(const adamw_pointers& q, std::int64_t i, adamw_decay d, float step) {
  if constexpr (std::is_void_v<P>) {
    q.direction[i] = step;
  } else if constexpr (std::is_same_v<P, float>) {
    const float p = adamw_master(static_cast<float*>(q.master)[i], d, step);
    static_cast<float*>(q.master)[i] = p;
    if constexpr (!std::is_void_v<W>) store_value<W>(q.weights, i, p);
  } else {
    bf16_bits_t w = static_cast<bf16_bits_t*>(q.master)[i], c = q.comp[i];
    adamw_master_kahan(w, c, d, step);
    static_cast<bf16_bits_t*>(q.master)[i] = w;
    q.comp[i] = c;
    if constexpr (std::is_same_v<W, float>) static_cast<float*>(q.weights)[i] = bf16_value(w);
    if constexpr (std::is_same_v<W, bf16_bits_t>) static_cast<bf16_bits_t*>(q.weights)[i] = w;
  }
}

struct elementwise_params {
  adamw_pointers q;
  std::int64_t begin, end;
  adamw_decay decay;
  adamw_coefficients c;
};

// Elements [begin, end): M the moments (float, bf16 bits; void for the master half,
// which reads direction), G the gradient.
template <class M, class G, class P, class W>
__global__ void __launch_bounds__(adamw_config.threads) adamw_elementwise_kernel(elementwise_params p) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = p.begin + static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.end;
       i += stride) {
    float step;
    if constexpr (std::is_void_v<M>) {
      step = p.q.direction[i];
    } else {
      float m = load_value<M>(p.q.m, i), v = load_value<M>(p.q.v, i);
      step = adamw_moments(p.c, m, v, load_value<G>(p.q.grad, i));
      store_value<M>(p.q.m, i, m);
      store_value<M>(p.q.v, i, v);
    }
    finish<P, W>(p.q, i, p.decay, step);
  }
}

// The f32 path of the offload-less GPU step, 16-byte accesses: f32 moments, gradients
// and master, a bf16 or no working copy.
struct f32_params {
  float *master, *m, *v;
  const float* grad;
  void* weights;
  std::int64_t begin, n;
  adamw_decay decay;
  adamw_coefficients c;
};

template <class W>
__global__ void __launch_bounds__(adamw_config.threads) adamw_f32_kernel(f32_params p) {
  for_each_matrix_chunk<vec_width>(1, p.n, true, [&](std::int64_t, std::int64_t k, auto width) {
    constexpr int w = decltype(width)::value;
    const std::int64_t j = p.begin + k;
    float master[w], m[w], v[w], g[w];
    load_vec<w>(p.master + j, master);
    load_vec<w>(p.m + j, m);
    load_vec<w>(p.v + j, v);
    load_vec<w>(p.grad + j, g);
#pragma unroll
    for (int e = 0; e < w; ++e) master[e] = adamw_master(master[e], p.decay, adamw_moments(p.c, m[e], v[e], g[e]));
    store_vec<w>(p.master + j, master);
    store_vec<w>(p.m + j, m);
    store_vec<w>(p.v + j, v);
    if constexpr (!std::is_void_v<W>) {
#pragma unroll
      for (int e = 0; e < w; ++e) static_cast<bf16_bits_t*>(p.weights)[j + e] = bf16_bits(master[e]);
    }
  });
}

struct q8_params {
  adamw_pointers q;
  std::int64_t blocks;
  adamw_coefficients c;
  float codes[2][256];  // the signed map (exp_avg) and the unsigned one (exp_avg_sq)
  adamw_run runs[adamw_max_runs];
  int run_count;  // 0: every element decays
};

struct fmax_op {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }  // a NaN never wins
};

// One q8 block per thread block and pass, one element per thread.
template <class G, class P, class W>
__global__ void __launch_bounds__(q8_config.threads) adamw_q8_kernel(q8_params p) {
  __shared__ float code[2][256], mid[2][255];
  __shared__ float scratch[32];
  for (int k = threadIdx.x; k < 256; k += blockDim.x) {
    code[0][k] = p.codes[0][k];
    code[1][k] = p.codes[1][k];
  }
  __syncthreads();
  for (int k = threadIdx.x; k < 255; k += blockDim.x) {
    mid[0][k] = (code[0][k] + code[0][k + 1]) / 2.0f;
    mid[1][k] = (code[1][k] + code[1][k + 1]) / 2.0f;
  }
  __syncthreads();
  auto* mc = static_cast<std::uint8_t*>(p.q.m);
  auto* vc = static_cast<std::uint8_t*>(p.q.v);
  for (std::int64_t blk = blockIdx.x; blk < p.blocks; blk += gridDim.x) {
    const std::int64_t i = blk * q8_block + threadIdx.x;
    float m = code[0][mc[i]] * p.q.m_absmax[blk];
    float v = code[1][vc[i]] * p.q.v_absmax[blk];
    const float step = adamw_moments(p.c, m, v, load_value<G>(p.q.grad, i));
    // Every thread has read the old absmax before the reduction's barriers.
    const float n1 = group_reduce<fmax_op, q8_config.threads, q8_config.threads>(fabsf(m), scratch);
    const float n2 = group_reduce<fmax_op, q8_config.threads, q8_config.threads>(fabsf(v), scratch);
    if (threadIdx.x == 0) {
      p.q.m_absmax[blk] = n1;
      p.q.v_absmax[blk] = n2;
    }
    mc[i] = q8_code(mid[0], q8_scaled(m, q8_inverse(n1)));
    vc[i] = q8_code(mid[1], q8_scaled(v, q8_inverse(n2)));
    bool decays = true;
    if (p.run_count > 0) {
      int r = 0;
      while (r + 1 < p.run_count && p.runs[r].end <= i) ++r;
      decays = p.runs[r].decay;
    }
    finish<P, W>(p.q, i, decay_of(p.c, decays), step);
  }
}

__global__ void __launch_bounds__(sum_squares_config.threads)
    sum_squares_kernel(const void* x, bool bf16_x, std::int64_t rows, std::int64_t cols, std::int64_t ld, bool vec,
                       double* result) {
  __shared__ double scratch[32];
  double sum = 0.0;
  for_each_matrix_chunk<vec_width>(rows, cols, vec, [&](std::int64_t row, std::int64_t j, auto width) {
    constexpr int w = decltype(width)::value;
    float v[w];
    if (bf16_x) load_vec<w>(static_cast<const bf16*>(x) + row * ld + j, v);
    else load_vec<w>(static_cast<const float*>(x) + row * ld + j, v);
#pragma unroll
    for (int e = 0; e < w; ++e) sum = fma(static_cast<double>(v[e]), static_cast<double>(v[e]), sum);
  });
  sum = group_sum<sum_squares_config.threads, sum_squares_config.threads>(sum, scratch);
  if (threadIdx.x == 0) atomicAdd(result, sum);
}

// Calls f with the element types of the call: M (moments), G (gradient), P (master), W
// (working copy); void where a half leaves one out.
template <class F>
void with_adamw_types(const adamw_args& a, F&& f) {
  const auto storage = [](dtype t, auto&& g) {
    if (t == dtype::bf16) g(static_cast<bf16_bits_t*>(nullptr));
    else g(static_cast<float*>(nullptr));
  };
  const auto master = [&](auto&& g) {
    if (a.part == adamw_part::moments) g(static_cast<void*>(nullptr));
    else storage(a.master.type, g);
  };
  const auto weights = [&](auto&& g) {
    if (a.weights.data == nullptr || a.weights.cols == 0) g(static_cast<void*>(nullptr));
    else storage(a.weights.type, g);
  };
  const auto moments = [&](auto&& g) {
    if (a.part == adamw_part::master) g(static_cast<void*>(nullptr));
    else storage(a.exp_avg.type, g);
  };
  moments([&]<class M>(M*) {
    storage(a.part == adamw_part::master ? dtype::f32 : a.grad.type, [&]<class G>(G*) {
      master([&]<class P>(P*) { weights([&]<class W>(W*) { f(static_cast<M*>(nullptr), static_cast<G*>(nullptr),
                                                            static_cast<P*>(nullptr), static_cast<W*>(nullptr)); }); });
    });
  });
}

void run_elementwise(const adamw_args& args, const context& ctx) {
  const std::int64_t n = args.part == adamw_part::master ? args.master.cols : args.grad.cols;
  const adamw_coefficients c = adamw_coefficients_of(args);
  const adamw_pointers q = pointers_of(args);
  const auto launch_run = [&](std::int64_t begin, std::int64_t end, bool decays) {
    if (begin == end) return;
    const adamw_decay d = decay_of(c, decays);
    const bool f32_fast = args.part == adamw_part::whole && args.exp_avg.type == dtype::f32 &&
                          args.grad.type == dtype::f32 && args.master.type == dtype::f32 &&
                          (q.weights == nullptr || args.weights.type == dtype::bf16);
    if (f32_fast && begin % vec_width == 0 && aligned16(q.master) && aligned16(q.m) && aligned16(q.v) &&
        aligned16(q.grad)) {
      const f32_params fp{static_cast<float*>(q.master), static_cast<float*>(q.m), static_cast<float*>(q.v),
                          static_cast<const float*>(q.grad), q.weights, begin, end - begin, d, c};
      const int grid = grid_for_units(adamw_config, ceil_div(end - begin, vec_width));
      if (q.weights == nullptr) launch("adamw_f32_kernel<no weights>", adamw_f32_kernel<void>, grid, adamw_config, 0,
                                       ctx.stream, fp);
      else launch("adamw_f32_kernel<bf16>", adamw_f32_kernel<bf16_bits_t>, grid, adamw_config, 0, ctx.stream, fp);
      return;
    }
    const elementwise_params p{q, begin, end, d, c};
    const int grid = grid_for_units(adamw_config, end - begin);
    with_adamw_types(args, [&]<class M, class G, class P, class W>(M*, G*, P*, W*) {
      if constexpr (std::is_void_v<P> && !std::is_void_v<W>) {
        throw internal_error("adamw: the moments half writes no working copy");
      } else {
        launch("adamw_elementwise_kernel", adamw_elementwise_kernel<M, G, P, W>, grid, adamw_config, 0, ctx.stream, p);
      }
    });
  };
  if (args.runs.empty()) return launch_run(0, n, true);
  std::int64_t begin = 0;
  for (const adamw_run& r : args.runs) {
    launch_run(begin, r.end, r.decay);
    begin = r.end;
  }
}

void run_q8(const adamw_args& args, const context& ctx) {
  q8_params p{};
  p.q = pointers_of(args);
  p.blocks = args.grad.cols / q8_block;
  p.c = adamw_coefficients_of(args);
  for (int k = 0; k < 256; ++k) {
    p.codes[0][k] = q8_signed_map().code[k];
    p.codes[1][k] = q8_unsigned_map().code[k];
  }
  for (std::size_t r = 0; r < args.runs.size(); ++r) p.runs[r] = args.runs[r];
  p.run_count = static_cast<int>(args.runs.size());
  const int grid = grid_size(q8_config, p.blocks);
  with_adamw_types(args, [&]<class M, class G, class P, class W>(M*, G*, P*, W*) {
    if constexpr (std::is_void_v<P> && !std::is_void_v<W>) {
      throw internal_error("adamw: the moments half writes no working copy");
    } else {
      launch("adamw_q8_kernel", adamw_q8_kernel<G, P, W>, grid, q8_config, 0, ctx.stream, p);
    }
  });
}

}  // namespace

void run(const adamw_args& args, const context& ctx) {
  const std::int64_t n = args.part == adamw_part::master ? args.master.cols : args.grad.cols;
  if (n == 0) return;
  if (args.part != adamw_part::master && args.exp_avg.type == dtype::u8) return run_q8(args, ctx);
  run_elementwise(args, ctx);
}

void run(const sum_squares_args& args, const context& ctx) {
  const mat_view& x = args.x;
  *args.result = 0.0;
  if (x.rows == 0 || x.cols == 0) return;
  const cudaStream_t stream = ctx.stream;
  double* result = ctx.sum_result;
  UPIPE_CUDA_CHECK(cudaMemsetAsync(result, 0, sizeof(double), stream));
  const bool packed = x.rows <= 1 || x.ld == x.cols;
  const std::int64_t rows = packed ? 1 : x.rows, cols = packed ? x.rows * x.cols : x.cols;
  const std::size_t element = dtype_size(x.type);
  const int width = static_cast<int>(16 / element);  // elements per 16 bytes
  const bool vec = (packed ? aligned16(x.data) : rows_aligned16(x.data, x.rows, x.ld, element)) && width == vec_width;
  const int grid = grid_for_units(sum_squares_config, rows * (vec ? ceil_div(cols, vec_width) : cols));
  launch("sum_squares_kernel", sum_squares_kernel, grid, sum_squares_config, 0, stream, x.data,
         x.type == dtype::bf16, rows, cols, x.ld, vec, result);
  UPIPE_CUDA_CHECK(cudaMemcpyAsync(args.result, result, sizeof(double), cudaMemcpyDeviceToHost, stream));
}

}  // namespace upipe::cuda
