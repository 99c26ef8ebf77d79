// Mixture-of-experts kernels (ops/op_args.hpp), as ops/cpu/moe.cpp defines them, with no
// host synchronization: the router's softmax and top-k (a warp per row, a row's E values in
// its lanes' registers; k rounds of a warp argmax, ties to the lower expert as torch.topk)
// or the given choices, and its backward; the dispatch as a counting sort in token order
// (per-chunk counts, one block's scan of them and of the experts' kept counts, then each
// token's rank among its chunk's tokens of the same expert from a bit mask: no atomics on
// the order, so the layout is the cpu's exactly); the permute and the combine (a warp per
// slot or token, 16-byte vectors where rows allow; the combine sums a token's k rows in
// fp32 and adds to the residual once); the load-balancing statistics (fp64 and u64, each
// expert's sum by one thread in a fixed order: deterministic); Qwen2-MoE's gate backward.
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/cuda_ops.hpp"
#include "ops/cuda/kernels_common.cuh"

namespace upipe::cuda {

namespace {

using namespace kernels;

constexpr kernel_config row_config{.threads = 256, .blocks_per_sm = 8};
constexpr int rows_per_block = row_config.threads / 32;  // a warp per row
constexpr int max_per_lane = 32;                          // E <= 1024 (the entries' limit)
constexpr int vec_width = 8;                              // elements per 16-byte bf16 vector

int row_grid(std::int64_t rows) { return static_cast<int>(ceil_div(rows, rows_per_block)); }

// Row r's softmax in the lanes: v[i] holds expert lane + 32 i.
__device__ __forceinline__ void row_softmax(const float* z, std::int64_t E, int lane, float (&v)[max_per_lane]) {
  float top = -INFINITY;
#pragma unroll
  for (int i = 0; i < max_per_lane; ++i) {
    const std::int64_t e = lane + 32 * i;
    v[i] = e < E ? z[e] : -INFINITY;
    top = fmaxf(top, v[i]);
  }
  top = warp_reduce<max_op>(top);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < max_per_lane; ++i) {
    const std::int64_t e = lane + 32 * i;
    v[i] = e < E ? expf(v[i] - top) : 0.0f;
    sum += v[i];
  }
  sum = warp_reduce<sum_op>(sum);
#pragma unroll
  for (int i = 0; i < max_per_lane; ++i) v[i] /= sum;
}

__global__ void __launch_bounds__(row_config.threads)
    route_kernel(const float* logits, std::int64_t ld_z, float* probs, std::int64_t ld_p, float* weights,
                 std::int64_t ld_w, std::int32_t* experts, std::int64_t ld_x, std::int64_t n, std::int64_t E,
                 std::int64_t k, bool normalize, bool given) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / 32;
  if (r >= n) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  float v[max_per_lane];
  row_softmax(logits + r * ld_z, E, lane, v);
  float* p = probs + r * ld_p;
#pragma unroll
  for (int i = 0; i < max_per_lane; ++i)
    if (lane + 32 * i < E) p[lane + 32 * i] = v[i];
  std::int32_t* x = experts + r * ld_x;
  float* w = weights + r * ld_w;
  if (!given) {
    unsigned taken = 0;
    for (std::int64_t j = 0; j < k; ++j) {
      // This lane's best untaken (the lowest index among equals), then the warp's.
      float best = -INFINITY;
      int best_e = 0x7fffffff;
#pragma unroll
      for (int i = 0; i < max_per_lane; ++i) {
        const int e = lane + 32 * i;
        if (e < E && !((taken >> i) & 1u) && (best_e == 0x7fffffff || v[i] > best)) {
          best = v[i];
          best_e = e;
        }
      }
      for (int offset = 16; offset > 0; offset /= 2) {
        const float other = __shfl_xor_sync(0xffffffffu, best, offset);
        const int other_e = __shfl_xor_sync(0xffffffffu, best_e, offset);
        if (other > best || (other == best && other_e < best_e) || best_e == 0x7fffffff) {
          best = other;
          best_e = other_e;
        }
      }
      if (best_e >= E) best_e = static_cast<int>(j);  // no number in the row (NaN logits): any valid expert
      if (best_e % 32 == lane) taken |= 1u << (best_e / 32);
      if (lane == 0) x[j] = best_e;
    }
  }
  __syncwarp();
  if (lane != 0) return;
  float chosen = 0.0f;  // in fp32 in slot order, as the cpu (and torch) sums the k values
  for (std::int64_t j = 0; j < k; ++j) {
    w[j] = p[x[j]];
    chosen += w[j];
  }
  if (normalize)
    for (std::int64_t j = 0; j < k; ++j) w[j] /= chosen;
}

__global__ void __launch_bounds__(row_config.threads)
    route_backward_kernel(const float* probs, std::int64_t ld_p, const std::int32_t* experts, std::int64_t ld_x,
                          const float* d_weights, std::int64_t ld_w, const float* aux, const std::uint8_t* counted,
                          std::int64_t ld_c, float* d_logits, std::int64_t ld_z, std::int64_t n, std::int64_t E,
                          std::int64_t k, bool normalize) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / 32;
  if (r >= n) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const float* p = probs + r * ld_p;
  const std::int32_t* x = experts + r * ld_x;
  const float* d_w = d_weights + r * ld_w;
  const bool with_aux = aux != nullptr && (counted == nullptr || counted[r * ld_c] != 0);
  float chosen = 0.0f, weighted = 0.0f;
  for (std::int64_t j = 0; j < k; ++j) chosen += p[x[j]];
  for (std::int64_t j = 0; j < k; ++j) weighted += d_w[j] * p[x[j]] / chosen;
  // d_p_e = aux_e + the top-k's term where e is chosen; d_z_e = p_e (d_p_e - p . d_p).
  float d_p[max_per_lane];
  float dot = 0.0f;
#pragma unroll
  for (int i = 0; i < max_per_lane; ++i) {
    const std::int64_t e = lane + 32 * i;
    d_p[i] = 0.0f;
    if (e >= E) continue;
    d_p[i] = with_aux ? aux[e] : 0.0f;
    for (std::int64_t j = 0; j < k; ++j)
      if (x[j] == e) d_p[i] += normalize ? (d_w[j] - weighted) / chosen : d_w[j];
    dot += p[e] * d_p[i];
  }
  dot = warp_reduce<sum_op>(dot);
#pragma unroll
  for (int i = 0; i < max_per_lane; ++i) {
    const std::int64_t e = lane + 32 * i;
    if (e < E) d_logits[r * ld_z + e] = p[e] * (d_p[i] - dot);
  }
}

// ---------------------------------------------------------------------------------------
// The dispatch: a counting sort of the (token, slot) pairs by expert, in token order.

constexpr int chunk = static_cast<int>(moe_dispatch_chunk);  // a block's tokens, a thread each
constexpr int chunk_words = chunk / 32;

// counts[c][e] = chunk c's tokens that chose e.
__global__ void __launch_bounds__(chunk)
    dispatch_count_kernel(const std::int32_t* experts, std::int64_t ld_x, std::int64_t n, std::int64_t k,
                          std::int64_t E, std::int32_t* counts) {
  extern __shared__ int hist[];
  for (std::int64_t e = threadIdx.x; e < E; e += chunk) hist[e] = 0;
  __syncthreads();
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * chunk + threadIdx.x;
  if (t < n)
    for (std::int64_t j = 0; j < k; ++j) atomicAdd(&hist[experts[t * ld_x + j]], 1);
  __syncthreads();
  for (std::int64_t e = threadIdx.x; e < E; e += chunk) counts[blockIdx.x * E + e] = hist[e];
}

// One block: each expert's chunk counts become the chunk's first rank among the expert's
// tokens; the experts' kept counts (capacity) are scanned into the offsets.
constexpr int scan_threads = 1024;
__global__ void __launch_bounds__(scan_threads)
    dispatch_scan_kernel(std::int32_t* counts, std::int64_t chunks, std::int64_t E, std::int64_t capacity,
                         std::int32_t* offsets) {
  using block_scan = cub::BlockScan<int, scan_threads>;
  __shared__ typename block_scan::TempStorage scratch;
  const std::int64_t e = threadIdx.x;
  int total = 0;
  if (e < E)
    for (std::int64_t c = 0; c < chunks; ++c) {
      const int here = counts[c * E + e];
      counts[c * E + e] = total;
      total += here;
    }
  const int kept = e < E ? (capacity > 0 && total > capacity ? static_cast<int>(capacity) : total) : 0;
  int first = 0, all = 0;
  block_scan(scratch).ExclusiveSum(kept, first, all);
  if (e < E) offsets[e] = first;
  if (e == 0) offsets[E] = all;
}

// Each slot's row: its expert's offset plus the token's rank among the expert's tokens
// (the chunks before, then this chunk's tokens before it, from a bit a token); -1 past the
// expert's capacity.
__global__ void __launch_bounds__(chunk)
    dispatch_position_kernel(const std::int32_t* experts, std::int64_t ld_x, std::int64_t n, std::int64_t k,
                             std::int64_t E, const std::int32_t* ranks, const std::int32_t* offsets,
                             std::int64_t capacity, std::int32_t* position, std::int64_t ld_pos) {
  extern __shared__ unsigned masks[];  // E x chunk_words
  for (std::int64_t i = threadIdx.x; i < E * chunk_words; i += chunk) masks[i] = 0u;
  __syncthreads();
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * chunk + threadIdx.x;
  const int word = static_cast<int>(threadIdx.x / 32), bit = static_cast<int>(threadIdx.x % 32);
  if (t < n)
    for (std::int64_t j = 0; j < k; ++j) atomicOr(&masks[experts[t * ld_x + j] * chunk_words + word], 1u << bit);
  __syncthreads();
  if (t >= n) return;
  for (std::int64_t j = 0; j < k; ++j) {
    const std::int32_t e = experts[t * ld_x + j];
    const unsigned* m = masks + e * chunk_words;
    int before = __popc(m[word] & ((1u << bit) - 1u));
    for (int w = 0; w < word; ++w) before += __popc(m[w]);
    const std::int64_t rank = ranks[blockIdx.x * E + e] + before;
    position[t * ld_pos + j] = capacity > 0 && rank >= capacity ? -1 : static_cast<std::int32_t>(offsets[e] + rank);
  }
}

// ---------------------------------------------------------------------------------------
// Permute, combine and the combine's backward: a warp per slot or token, columns in
// 16-byte vectors where every row allows.

template <class T>
__global__ void __launch_bounds__(row_config.threads)
    permute_kernel(const T* src, std::int64_t ld_s, const std::int32_t* position, std::int64_t ld_pos, T* dst,
                   std::int64_t ld_d, std::int64_t n, std::int64_t k, std::int64_t cols, bool vec) {
  const std::int64_t slot = static_cast<std::int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / 32;
  if (slot >= n * k) return;
  const std::int64_t t = slot / k;
  const std::int32_t at = position[t * ld_pos + slot % k];
  if (at < 0) return;
  const T* s = src + t * ld_s;
  T* d = dst + static_cast<std::int64_t>(at) * ld_d;
  for_each_chunk<vec_width>(cols, vec, static_cast<int>(threadIdx.x % 32), 32, [&](std::int64_t j, auto width) {
    constexpr int W = decltype(width)::value;
    float v[W];
    load_vec<W>(s + j, v);
    store_vec<W>(d + j, v);
  });
}

template <class S, class H, class Y>
__global__ void __launch_bounds__(row_config.threads)
    combine_kernel(const S* src, std::int64_t ld_s, const std::int32_t* position, std::int64_t ld_pos,
                   const float* weights, std::int64_t ld_w, const H* shared, std::int64_t ld_h, const float* gate,
                   std::int64_t ld_g, Y* dst, std::int64_t ld_d, std::int64_t n, std::int64_t k, std::int64_t cols,
                   bool vec) {
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / 32;
  if (t >= n) return;
  const float g = shared != nullptr ? 1.0f / (1.0f + expf(-gate[t * ld_g])) : 0.0f;
  for_each_chunk<vec_width>(cols, vec, static_cast<int>(threadIdx.x % 32), 32, [&](std::int64_t c, auto width) {
    constexpr int W = decltype(width)::value;
    float sum[W] = {};
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t at = position[t * ld_pos + j];
      if (at < 0) continue;
      const float w = weights != nullptr ? weights[t * ld_w + j] : 1.0f;
      float v[W];
      load_vec<W>(src + static_cast<std::int64_t>(at) * ld_s + c, v);
#pragma unroll
      for (int i = 0; i < W; ++i) sum[i] += w * v[i];
    }
    if (shared != nullptr) {
      float v[W];
      load_vec<W>(shared + t * ld_h + c, v);
#pragma unroll
      for (int i = 0; i < W; ++i) sum[i] += g * v[i];
    }
    float y[W];
    load_vec<W>(dst + t * ld_d + c, y);
#pragma unroll
    for (int i = 0; i < W; ++i) y[i] += sum[i];
    store_vec<W>(dst + t * ld_d + c, y);
  });
}

template <class G, class S, class D>
__global__ void __launch_bounds__(row_config.threads)
    combine_backward_kernel(const G* d_dst, std::int64_t ld_g, const std::int32_t* position, std::int64_t ld_pos,
                            const float* weights, std::int64_t ld_w, const S* src, std::int64_t ld_s, D* d_src,
                            std::int64_t ld_ds, float* d_weights, std::int64_t ld_dw, std::int64_t n, std::int64_t k,
                            std::int64_t cols, bool vec) {
  const std::int64_t slot = static_cast<std::int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / 32;
  if (slot >= n * k) return;
  const std::int64_t t = slot / k, j = slot % k;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int32_t at = position[t * ld_pos + j];
  if (at < 0) {
    if (lane == 0) d_weights[t * ld_dw + j] = 0.0f;
    return;
  }
  const float w = weights[t * ld_w + j];
  const G* g = d_dst + t * ld_g;
  const S* s = src + static_cast<std::int64_t>(at) * ld_s;
  D* d = d_src + static_cast<std::int64_t>(at) * ld_ds;
  float dot = 0.0f;
  for_each_chunk<vec_width>(cols, vec, lane, 32, [&](std::int64_t c, auto width) {
    constexpr int W = decltype(width)::value;
    float gv[W], sv[W], out[W];
    load_vec<W>(g + c, gv);
    load_vec<W>(s + c, sv);
#pragma unroll
    for (int i = 0; i < W; ++i) {
      dot += sv[i] * gv[i];
      out[i] = w * gv[i];
    }
    store_vec<W>(d + c, out);
  });
  dot = warp_reduce<sum_op>(dot);
  if (lane == 0) d_weights[t * ld_dw + j] = dot;
}

// ---------------------------------------------------------------------------------------
// The load-balancing statistics: a block per 32 experts (a lane each), its warps over the
// rows; the warps' partial sums added in warp order by one thread per expert.

constexpr int balance_warps = 32;
__global__ void __launch_bounds__(32 * balance_warps)
    balance_kernel(const float* probs, std::int64_t ld_p, const std::int32_t* experts, std::int64_t ld_x,
                   const std::uint8_t* counted, std::int64_t ld_c, std::int64_t n, std::int64_t E, std::int64_t k,
                   unsigned long long* counts, double* sums) {
  __shared__ double part_sum[balance_warps][32];
  __shared__ unsigned long long part_count[balance_warps][32];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * 32 + lane;
  double sum = 0.0;
  unsigned long long count = 0;
  for (std::int64_t t = warp; t < n; t += balance_warps) {
    if (counted != nullptr && counted[t * ld_c] == 0) continue;
    if (e < E) sum += probs[t * ld_p + e];
    for (std::int64_t j = 0; j < k; ++j) count += experts[t * ld_x + j] == e ? 1 : 0;
  }
  part_sum[warp][lane] = sum;
  part_count[warp][lane] = count;
  __syncthreads();
  if (warp != 0 || e >= E) return;
  for (int w = 1; w < balance_warps; ++w) {
    sum += part_sum[w][lane];
    count += part_count[w][lane];
  }
  sums[e] += sum;
  counts[e] += count;
}

template <class S, class G, class D>
__global__ void __launch_bounds__(row_config.threads)
    sigmoid_gate_backward_kernel(const float* z, std::int64_t ld_z, const S* s, std::int64_t ld_s, const G* d_y,
                                 std::int64_t ld_g, D* d_s, std::int64_t ld_d, float* d_z, std::int64_t ld_dz,
                                 std::int64_t rows, std::int64_t cols) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / 32;
  if (r >= rows) return;
  const float g = 1.0f / (1.0f + expf(-z[r * ld_z]));
  float dot = 0.0f;
  for (std::int64_t j = threadIdx.x % 32; j < cols; j += 32) {
    const float gj = to_float(d_y[r * ld_g + j]);
    dot += to_float(s[r * ld_s + j]) * gj;
    d_s[r * ld_d + j] = from_float<D>(g * gj);
  }
  dot = warp_reduce<sum_op>(dot);
  if (threadIdx.x % 32 == 0) d_z[r * ld_dz] = g * (1.0f - g) * dot;
}

// Every row of these matrices starts on 16 bytes and the columns fill whole vectors.
bool vectorizable(std::int64_t cols, std::initializer_list<mat_view> views) {
  if (cols % vec_width != 0) return false;
  for (const mat_view& m : views)
    if (m.rows > 0 && !rows_aligned16(m.data, m.rows, m.ld, dtype_size(m.type))) return false;
  return true;
}

const std::uint8_t* mask_of(const mat_view& counted) {
  return counted.rows > 0 ? static_cast<const std::uint8_t*>(counted.data) : nullptr;
}

}  // namespace

void run(const moe_route_args& a, const context& ctx) {
  if (a.logits.rows == 0) return;
  launch("moe_route_kernel", route_kernel, row_grid(a.logits.rows), row_config, 0, ctx.stream,
         static_cast<const float*>(a.logits.data), a.logits.ld, static_cast<float*>(a.probs.data), a.probs.ld,
         static_cast<float*>(a.weights.data), a.weights.ld, static_cast<std::int32_t*>(a.experts.data), a.experts.ld,
         a.logits.rows, a.logits.cols, a.weights.cols, a.normalize, a.given);
}

void run(const moe_route_backward_args& a, const context& ctx) {
  if (a.probs.rows == 0) return;
  launch("moe_route_backward_kernel", route_backward_kernel, row_grid(a.probs.rows), row_config, 0, ctx.stream,
         static_cast<const float*>(a.probs.data), a.probs.ld, static_cast<const std::int32_t*>(a.experts.data),
         a.experts.ld, static_cast<const float*>(a.d_weights.data), a.d_weights.ld,
         a.aux_grad.rows > 0 ? static_cast<const float*>(a.aux_grad.data) : nullptr, mask_of(a.counted),
         a.counted.ld, static_cast<float*>(a.d_logits.data), a.d_logits.ld, a.probs.rows, a.probs.cols,
         a.experts.cols, a.normalize);
}

void run(const moe_dispatch_args& a, const context& ctx) {
  const std::int64_t n = a.experts.rows, k = a.experts.cols, E = a.offsets.cols - 1;
  const std::int64_t chunks = moe_dispatch_scratch_rows(n);
  const auto* experts = static_cast<const std::int32_t*>(a.experts.data);
  auto* counts = static_cast<std::int32_t*>(a.scratch.data);
  auto* offsets = static_cast<std::int32_t*>(a.offsets.data);
  constexpr kernel_config chunk_config{.threads = chunk, .blocks_per_sm = 8};
  constexpr kernel_config scan_config{.threads = scan_threads, .blocks_per_sm = 1};
  if (n > 0)
    launch("moe_dispatch_count_kernel", dispatch_count_kernel, static_cast<int>(chunks), chunk_config,
           static_cast<std::size_t>(E) * sizeof(int), ctx.stream, experts, a.experts.ld, n, k, E, counts);
  launch("moe_dispatch_scan_kernel", dispatch_scan_kernel, 1, scan_config, 0, ctx.stream, counts, chunks, E,
         a.capacity, offsets);
  if (n > 0)
    launch("moe_dispatch_position_kernel", dispatch_position_kernel, static_cast<int>(chunks), chunk_config,
           static_cast<std::size_t>(E * chunk_words) * sizeof(unsigned), ctx.stream, experts, a.experts.ld, n, k, E,
           static_cast<const std::int32_t*>(counts), static_cast<const std::int32_t*>(offsets), a.capacity,
           static_cast<std::int32_t*>(a.position.data), a.position.ld);
}

void run(const moe_permute_args& a, const context& ctx) {
  const std::int64_t slots = a.position.rows * a.position.cols;
  if (slots == 0 || a.src.cols == 0) return;
  const bool vec = vectorizable(a.src.cols, {a.src, a.dst});
  with_types(
      [&](auto t) {
        using T = typename decltype(t)::type;
        launch("moe_permute_kernel", permute_kernel<T>, row_grid(slots), row_config, 0, ctx.stream,
               static_cast<const T*>(a.src.data), a.src.ld, static_cast<const std::int32_t*>(a.position.data),
               a.position.ld, static_cast<T*>(a.dst.data), a.dst.ld, a.position.rows, a.position.cols, a.src.cols, vec);
      },
      a.src.type);
}

void run(const moe_combine_args& a, const context& ctx) {
  if (a.dst.rows == 0 || a.dst.cols == 0) return;
  const bool shared = a.shared.rows > 0;
  const bool vec = vectorizable(a.dst.cols, {a.src, a.dst, a.shared});
  with_types(
      [&](auto s, auto h, auto y) {
        using S = typename decltype(s)::type;
        using H = typename decltype(h)::type;
        using Y = typename decltype(y)::type;
        launch("moe_combine_kernel", combine_kernel<S, H, Y>, row_grid(a.dst.rows), row_config, 0, ctx.stream,
               static_cast<const S*>(a.src.data), a.src.ld, static_cast<const std::int32_t*>(a.position.data),
               a.position.ld, a.weights.rows > 0 ? static_cast<const float*>(a.weights.data) : nullptr, a.weights.ld,
               shared ? static_cast<const H*>(a.shared.data) : nullptr, a.shared.ld,
               shared ? static_cast<const float*>(a.shared_gate.data) : nullptr, a.shared_gate.ld,
               static_cast<Y*>(a.dst.data), a.dst.ld, a.dst.rows, a.position.cols, a.dst.cols, vec);
      },
      a.src.type, shared ? a.shared.type : a.src.type, a.dst.type);
}

void run(const moe_combine_backward_args& a, const context& ctx) {
  const std::int64_t slots = a.position.rows * a.position.cols;
  if (slots == 0) return;
  const bool vec = vectorizable(a.d_dst.cols, {a.d_dst, a.src, a.d_src});
  with_types(
      [&](auto g, auto s, auto d) {
        using G = typename decltype(g)::type;
        using S = typename decltype(s)::type;
        using D = typename decltype(d)::type;
        launch("moe_combine_backward_kernel", combine_backward_kernel<G, S, D>, row_grid(slots), row_config, 0,
               ctx.stream, static_cast<const G*>(a.d_dst.data), a.d_dst.ld,
               static_cast<const std::int32_t*>(a.position.data), a.position.ld,
               static_cast<const float*>(a.weights.data), a.weights.ld, static_cast<const S*>(a.src.data), a.src.ld,
               static_cast<D*>(a.d_src.data), a.d_src.ld, static_cast<float*>(a.d_weights.data), a.d_weights.ld,
               a.position.rows, a.position.cols, a.d_dst.cols, vec);
      },
      a.d_dst.type, a.src.type, a.d_src.type);
}

void run(const moe_balance_args& a, const context& ctx) {
  const std::int64_t n = a.probs.rows, E = a.probs.cols;
  if (n == 0) return;
  auto* counts = static_cast<unsigned long long*>(a.sums.data);
  auto* sums = reinterpret_cast<double*>(counts + E);
  constexpr kernel_config balance_config{.threads = 32 * balance_warps, .blocks_per_sm = 1};
  launch("moe_balance_kernel", balance_kernel, static_cast<int>(ceil_div(E, 32)), balance_config, 0, ctx.stream,
         static_cast<const float*>(a.probs.data), a.probs.ld, static_cast<const std::int32_t*>(a.experts.data),
         a.experts.ld, mask_of(a.counted), a.counted.ld, n, E, a.experts.cols, counts, sums);
}

void run(const sigmoid_gate_backward_args& a, const context& ctx) {
  if (a.s.rows == 0) return;
  with_types(
      [&](auto s, auto g, auto d) {
        using S = typename decltype(s)::type;
        using G = typename decltype(g)::type;
        using D = typename decltype(d)::type;
        launch("sigmoid_gate_backward_kernel", sigmoid_gate_backward_kernel<S, G, D>, row_grid(a.s.rows), row_config,
               0, ctx.stream, static_cast<const float*>(a.z.data), a.z.ld, static_cast<const S*>(a.s.data), a.s.ld,
               static_cast<const G*>(a.d_y.data), a.d_y.ld, static_cast<D*>(a.d_s.data), a.d_s.ld,
               static_cast<float*>(a.d_z.data), a.d_z.ld, a.s.rows, a.s.cols);
      },
      a.s.type, a.d_y.type, a.d_s.type);
}

}  // namespace upipe::cuda
