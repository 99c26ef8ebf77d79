// Layout kernels on strided (tokens, heads, dim) views: copy with dtype conversion (the
// all-to-all pack and unpack), add (an fp32 sum stored once), fill, the fp32 log-sum-exp
// merge of ring attention; and the embedding gather and scatter-add. As ops/cpu/heads.cpp,
// ops/cpu/attention.cpp (lse_merge) and ops/cpu/embedding.cpp.
//
// A (token, head) row of dim contiguous elements goes to a group of up to a warp of
// threads, 16-byte chunks where every row of every view is 16-byte aligned. Views whose
// tokens nest their heads evenly are walked as plain rows, without a division per row.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "ops/cuda/cuda_ops.hpp"
#include "ops/cuda/kernels_common.cuh"

namespace upipe::cuda {

namespace {

using namespace kernels;

constexpr kernel_config layout_config{.threads = 256, .blocks_per_sm = 8};
constexpr int vec_width = 8;            // elements per chunk of a head row
constexpr int max_row_group = 32;       // threads per row, at most (lse_merge relies on a warp)
constexpr int embedding_grad_width = 4; // floats per vector atomicAdd (sm_90 float4 atomics)

// A view's base and strides in elements; heads == 1 walks (after collapsing) have
// head_stride 0 and token_stride the row stride.
struct strided {
  void* data;
  std::int64_t token_stride, head_stride;
};

// rows = tokens * heads rows of dim elements; a thread group of `group` per row.
struct heads_walk {
  std::int64_t rows, heads, dim;
  int group;
  bool vec;
};

template <class T>
__device__ __forceinline__ T* row_ptr(const strided& v, std::int64_t t, std::int64_t h) {
  return static_cast<T*>(v.data) + t * v.token_stride + h * v.head_stride;
}

__device__ __forceinline__ void token_and_head(std::int64_t row, std::int64_t heads, std::int64_t& t,
                                               std::int64_t& h) {
  if (heads == 1) {
    t = row;
    h = 0;
  } else {
    split_index(row, heads, t, h);
  }
}

enum class combine : std::uint8_t { copy, add };

template <class D, class S, combine Op>
__global__ void __launch_bounds__(layout_config.threads) heads_binary_kernel(heads_walk w, strided dst, strided src) {
  const int lane = static_cast<int>(threadIdx.x) & (w.group - 1);
  for_each_row(w.rows, w.group, [&](std::int64_t row, bool active) {
    if (!active) return;
    std::int64_t t, h;
    token_and_head(row, w.heads, t, h);
    D* d = row_ptr<D>(dst, t, h);
    const S* s = row_ptr<const S>(src, t, h);
    for_each_chunk<vec_width>(w.dim, w.vec, lane, w.group, [&](std::int64_t j, auto width) {
      constexpr int n = decltype(width)::value;
      float v[n];
      load_vec<n>(s + j, v);
      if constexpr (Op == combine::add) {
        float acc[n];
        load_vec<n>(d + j, acc);
#pragma unroll
        for (int e = 0; e < n; ++e) v[e] += acc[e];
      }
      store_vec<n>(d + j, v);
    });
  });
}

template <class D>
__global__ void __launch_bounds__(layout_config.threads) fill_heads_kernel(heads_walk w, strided dst, float value) {
  const int lane = static_cast<int>(threadIdx.x) & (w.group - 1);
  for_each_row(w.rows, w.group, [&](std::int64_t row, bool active) {
    if (!active) return;
    std::int64_t t, h;
    token_and_head(row, w.heads, t, h);
    D* d = row_ptr<D>(dst, t, h);
    for_each_chunk<vec_width>(w.dim, w.vec, lane, w.group, [&](std::int64_t j, auto width) {
      constexpr int n = decltype(width)::value;
      float v[n];
#pragma unroll
      for (int e = 0; e < n; ++e) v[e] = value;
      store_vec<n>(d + j, v);
    });
  });
}

// lse = log(exp(lse) + exp(lse_part)); out = out * exp(old - lse) + part * exp(lse_part - lse),
// with the row's scalars in fp64. A -inf part changes nothing; into a -inf accumulator the
// part is copied as is (out may hold garbage). A row's group lies in one warp: the lane
// that writes the new lse waits (__syncwarp) until every lane has read the old one.
template <class P>
__global__ void __launch_bounds__(layout_config.threads)
    lse_merge_kernel(heads_walk w, strided out, strided lse, strided out_part, strided lse_part) {
  constexpr double neg_inf = -INFINITY;
  const int lane = static_cast<int>(threadIdx.x) & (w.group - 1);
  for_each_row(w.rows, w.group, [&](std::int64_t row, bool active) {
    std::int64_t t = 0, h = 0;
    if (active) token_and_head(row, w.heads, t, h);
    float* lse_at = row_ptr<float>(lse, t, h);
    const double old_lse = active ? *lse_at : neg_inf;
    const double part_lse = active ? *row_ptr<const float>(lse_part, t, h) : neg_inf;
    const bool take = old_lse == neg_inf;
    double new_lse = part_lse;
    float w_old = 0.0f, w_part = 1.0f;
    if (!take && part_lse != neg_inf) {
      const double top = fmax(old_lse, part_lse);
      new_lse = top + log(exp(old_lse - top) + exp(part_lse - top));
      w_old = static_cast<float>(exp(old_lse - new_lse));
      w_part = static_cast<float>(exp(part_lse - new_lse));
    }
    float* o = row_ptr<float>(out, t, h);
    const P* part = row_ptr<const P>(out_part, t, h);
    const std::int64_t n = part_lse == neg_inf ? 0 : w.dim;
    for_each_chunk<vec_width>(n, w.vec, lane, w.group, [&](std::int64_t j, auto width) {
      constexpr int k = decltype(width)::value;
      float v[k], acc[k];
      load_vec<k>(part + j, v);
      if (!take) {
        load_vec<k>(o + j, acc);
#pragma unroll
        for (int e = 0; e < k; ++e) v[e] = fmaf(w_old, acc[e], w_part * v[e]);
      }
      store_vec<k>(o + j, v);
    });
    __syncwarp();
    if (lane == 0 && part_lse != neg_inf) *lse_at = static_cast<float>(new_lse);
  });
}

struct embedding_forward_params {
  const bf16* table;  // (vocab, dim), ld_table
  const std::int32_t* ids;
  bf16* out;  // (n, dim), ld_out
  std::int64_t n, dim, vocab, ld_table, ld_ids, ld_out;
  int group;
  bool vec;
  float scale;
};

__global__ void __launch_bounds__(layout_config.threads) embedding_forward_kernel(embedding_forward_params p) {
  const int lane = static_cast<int>(threadIdx.x) & (p.group - 1);
  for_each_row(p.n, p.group, [&](std::int64_t row, bool active) {
    if (!active) return;
    const std::int32_t id = p.ids[row * p.ld_ids];
    if (id < 0 || id >= p.vocab) trap_out_of_range("embedding_forward", "id", id, row, p.vocab);
    const bf16* src = p.table + id * p.ld_table;
    bf16* dst = p.out + row * p.ld_out;
    // A bf16 copy through fp32 is exact; a scale rounds once, as bf16 * bf16 does.
    for_each_chunk<vec_width>(p.dim, p.vec, lane, p.group, [&](std::int64_t j, auto width) {
      constexpr int k = decltype(width)::value;
      float v[k];
      load_vec<k>(src + j, v);
#pragma unroll
      for (int e = 0; e < k; ++e) v[e] *= p.scale;
      store_vec<k>(dst + j, v);
    });
  });
}

struct embedding_backward_params {
  const void* d_out;  // (n, dim), ld_d_out
  const std::int32_t* ids;
  float* d_table;  // (vocab, dim) f32, ld_d_table, accumulated
  std::int64_t n, dim, vocab, ld_d_out, ld_ids, ld_d_table;
  int group;
  bool vec;
  float scale;
  std::int32_t padding_id;  // rows of this id add nothing; -1: none
};

// Repeated ids meet in atomics, so the order of their additions (and the last bits of
// d_table) varies from run to run.
template <class G>
__global__ void __launch_bounds__(layout_config.threads) embedding_backward_kernel(embedding_backward_params p) {
  const int lane = static_cast<int>(threadIdx.x) & (p.group - 1);
  for_each_row(p.n, p.group, [&](std::int64_t row, bool active) {
    if (!active) return;
    const std::int32_t id = p.ids[row * p.ld_ids];
    if (id < 0 || id >= p.vocab) trap_out_of_range("embedding_backward", "id", id, row, p.vocab);
    if (id == p.padding_id) return;
    const G* src = static_cast<const G*>(p.d_out) + row * p.ld_d_out;
    float* dst = p.d_table + id * p.ld_d_table;
    for_each_chunk<embedding_grad_width>(p.dim, p.vec, lane, p.group, [&](std::int64_t j, auto width) {
      constexpr int k = decltype(width)::value;
      float v[k];
      load_vec<k>(src + j, v);
#pragma unroll
      for (int e = 0; e < k; ++e) v[e] *= p.scale;
      if constexpr (k == 4)
        atomicAdd(reinterpret_cast<float4*>(dst + j), make_float4(v[0], v[1], v[2], v[3]));
      else
        atomicAdd(dst + j, v[0]);
    });
  });
}

// ---------------------------------------------------------------------------------------
// Launchers

// True when every row of v starts on a 16-byte boundary.
bool view_rows_aligned16(const strided& v, std::int64_t tokens, std::int64_t heads, dtype type) {
  const auto bytes = static_cast<std::int64_t>(dtype_size(type));
  return aligned16(v.data) && (tokens <= 1 || v.token_stride * bytes % 16 == 0) &&
         (heads <= 1 || v.head_stride * bytes % 16 == 0);
}

// The walk shared by views of one (tokens, heads) shape: collapsed to plain rows when
// every view's token stride is heads head strides; chunked when every view in `vector`
// is row-aligned. `views` lists all of them, `vector` those of dim elements.
struct walked_views {
  heads_walk walk;
  strided views[4];
};

walked_views walk_views(std::initializer_list<head_view> vector_views, std::initializer_list<head_view> scalar_views) {
  const head_view& first = *vector_views.begin();
  std::int64_t tokens = first.tokens, heads = first.heads;
  bool collapse = true;
  for (const auto* list : {&vector_views, &scalar_views})
    for (const head_view& v : *list) collapse = collapse && (v.heads <= 1 || v.token_stride == v.heads * v.head_stride);
  walked_views out{};
  int i = 0;
  for (const auto* list : {&vector_views, &scalar_views})
    for (const head_view& v : *list) {
      if (collapse)
        out.views[i++] = {v.data, heads > 1 ? v.head_stride : v.token_stride, 0};
      else
        out.views[i++] = {v.data, v.token_stride, v.head_stride};
    }
  if (collapse) {
    tokens *= heads;
    heads = 1;
  }
  bool vec = true;
  i = 0;
  for (const head_view& v : vector_views) vec = vec && view_rows_aligned16(out.views[i++], tokens, heads, v.type);
  const std::int64_t units = vec ? ceil_div(first.dim, vec_width) : first.dim;
  out.walk = {tokens * heads, heads, first.dim, pow2_at_least(units, max_row_group), vec};
  return out;
}

int grid_for_rows(const heads_walk& w) {
  return grid_size(layout_config, ceil_div(w.rows, layout_config.threads / w.group));
}

bool empty(const head_view& v) { return v.tokens == 0 || v.heads == 0 || v.dim == 0; }

template <combine Op>
void heads_binary(const char* name, const head_view& dst, const head_view& src, cudaStream_t stream) {
  if (empty(src)) return;
  const walked_views w = walk_views({dst, src}, {});
  with_types(
      [&](auto d, auto s) {
        using D = typename decltype(d)::type;
        using S = typename decltype(s)::type;
        launch(name, heads_binary_kernel<D, S, Op>, grid_for_rows(w.walk), layout_config, 0, stream, w.walk,
               w.views[0], w.views[1]);
      },
      dst.type, src.type);
}

int embedding_group(std::int64_t units) { return pow2_at_least(units, max_row_group); }

}  // namespace

void run(const copy_heads_args& args, const context& ctx) {
  heads_binary<combine::copy>("heads_binary_kernel<copy>", args.dst, args.src, ctx.stream);
}

void run(const add_heads_args& args, const context& ctx) {
  heads_binary<combine::add>("heads_binary_kernel<add>", args.dst, args.src, ctx.stream);
}

void run(const fill_heads_args& args, const context& ctx) {
  const head_view& dst = args.dst;
  const float value = args.value;
  const cudaStream_t stream = ctx.stream;
  if (empty(dst)) return;
  const walked_views w = walk_views({dst}, {});
  with_types(
      [&](auto d) {
        using D = typename decltype(d)::type;
        launch("fill_heads_kernel", fill_heads_kernel<D>, grid_for_rows(w.walk), layout_config, 0, stream, w.walk,
               w.views[0], value);
      },
      dst.type);
}

void run(const lse_merge_args& args, const context& ctx) {
  const cudaStream_t stream = ctx.stream;
  if (args.out.tokens == 0 || args.out.heads == 0) return;
  const walked_views w = walk_views({args.out, args.out_part}, {args.lse, args.lse_part});
  with_types(
      [&](auto p) {
        using P = typename decltype(p)::type;
        launch("lse_merge_kernel", lse_merge_kernel<P>, grid_for_rows(w.walk), layout_config, 0, stream, w.walk,
               w.views[0], w.views[2], w.views[1], w.views[3]);
      },
      args.out_part.type);
}

void run(const embedding_forward_args& args, const context& ctx) {
  const cudaStream_t stream = ctx.stream;
  const std::int64_t n = args.ids.rows, dim = args.table.cols;
  if (n == 0 || dim == 0) return;
  const bool vec = rows_aligned16(args.table.data, args.table.rows, args.table.ld, sizeof(bf16)) &&
                   rows_aligned16(args.out.data, n, args.out.ld, sizeof(bf16));
  const int group = embedding_group(vec ? ceil_div(dim, vec_width) : dim);
  const embedding_forward_params params{static_cast<const bf16*>(args.table.data),
                                        static_cast<const std::int32_t*>(args.ids.data),
                                        static_cast<bf16*>(args.out.data),
                                        n,
                                        dim,
                                        args.table.rows,
                                        args.table.ld,
                                        args.ids.ld,
                                        args.out.ld,
                                        group,
                                        vec,
                                        args.scale};
  launch("embedding_forward_kernel", embedding_forward_kernel,
         grid_size(layout_config, ceil_div(n, layout_config.threads / group)), layout_config, 0, stream, params);
}

void run(const embedding_backward_args& args, const context& ctx) {
  const cudaStream_t stream = ctx.stream;
  const std::int64_t n = args.ids.rows, dim = args.d_table.cols;
  if (n == 0 || dim == 0) return;
  const bool vec = rows_aligned16(args.d_table.data, args.d_table.rows, args.d_table.ld, sizeof(float)) &&
                   rows_aligned16(args.d_out.data, n, args.d_out.ld, dtype_size(args.d_out.type));
  const int group = embedding_group(vec ? ceil_div(dim, embedding_grad_width) : dim);
  const embedding_backward_params params{args.d_out.data,
                                         static_cast<const std::int32_t*>(args.ids.data),
                                         static_cast<float*>(args.d_table.data),
                                         n,
                                         dim,
                                         args.d_table.rows,
                                         args.d_out.ld,
                                         args.ids.ld,
                                         args.d_table.ld,
                                         group,
                                         vec,
                                         args.scale,
                                         args.padding_id};
  const int grid = grid_size(layout_config, ceil_div(n, layout_config.threads / group));
  with_types(
      [&](auto g) {
        using G = typename decltype(g)::type;
        launch("embedding_backward_kernel", embedding_backward_kernel<G>, grid, layout_config, 0, stream, params);
      },
      args.d_out.type);
}

}  // namespace upipe::cuda

// ---------------------------------------------------------------------------------------
// Attention of a query row that sees exactly one key (a one-token document): cuDNN
// refuses s_q = s_kv = 1. The softmax over one key is 1, so out = v and lse = scale q.k;
// in backward dS = P (dP - rowsum(dO O)) = 0, so d_q = d_k = 0 and d_v sums its group's d_out.

namespace upipe::cuda {

namespace {

struct one_row {
  void* data;
  std::int64_t head_stride;
};

one_row row_of(const head_view& v) { return {v.data, v.head_stride}; }

// One block, a warp per query head: out[h] = v[h / G], lse[h] = scale * q[h] . k[h / G].
template <class T>
__global__ void single_key_forward_kernel(one_row q, one_row k, one_row v, one_row out, one_row lse, int hq, int group,
                                          int d, float scale) {
  const int lane = threadIdx.x % 32;
  for (int h = threadIdx.x / 32; h < hq; h += blockDim.x / 32) {
    const T* qh = static_cast<const T*>(q.data) + h * q.head_stride;
    const T* kh = static_cast<const T*>(k.data) + (h / group) * k.head_stride;
    const T* vh = static_cast<const T*>(v.data) + (h / group) * v.head_stride;
    T* oh = static_cast<T*>(out.data) + h * out.head_stride;
    float dot = 0.0f;
    for (int e = lane; e < d; e += 32) {
      dot += kernels::to_float(qh[e]) * kernels::to_float(kh[e]);
      oh[e] = vh[e];
    }
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_down_sync(0xffffffffu, dot, offset);
    if (lane == 0) static_cast<float*>(lse.data)[h * lse.head_stride] = scale * dot;
  }
}

// d_v[g] = sum over the group's query heads of d_out[h]; d_q and d_k are zeroed apart.
template <class T>
__global__ void single_key_backward_kernel(one_row d_out, one_row d_v, int hk, int group, int d) {
  for (int i = threadIdx.x; i < hk * d; i += blockDim.x) {
    const int g = i / d, e = i % d;
    float sum = 0.0f;
    for (int h = g * group; h < (g + 1) * group; ++h)
      sum += kernels::to_float(static_cast<const T*>(d_out.data)[h * d_out.head_stride + e]);
    static_cast<T*>(d_v.data)[g * d_v.head_stride + e] = kernels::from_float<T>(sum);
  }
}

}  // namespace

void single_key_attention_forward(const sdpa_forward_args& a, cudaStream_t stream) {
  const int hq = static_cast<int>(a.q.heads), group = static_cast<int>(a.q.heads / a.k.heads);
  with_types(
      [&](auto t) {
        using T = typename decltype(t)::type;
        launch("single_key_forward_kernel", single_key_forward_kernel<T>, 1, layout_config, 0, stream, row_of(a.q),
               row_of(a.k), row_of(a.v), row_of(a.out), row_of(a.lse), hq, group, static_cast<int>(a.q.dim), a.scale);
      },
      a.q.type);
}

void single_key_attention_backward(const sdpa_backward_args& a, cudaStream_t stream) {
  run(fill_heads_args{a.d_q, 0.0f}, context{.stream = stream});
  run(fill_heads_args{a.d_k, 0.0f}, context{.stream = stream});
  const int hk = static_cast<int>(a.k.heads), group = static_cast<int>(a.q.heads / a.k.heads);
  with_types(
      [&](auto t) {
        using T = typename decltype(t)::type;
        launch("single_key_backward_kernel", single_key_backward_kernel<T>, 1, layout_config, 0, stream,
               row_of(a.d_out), row_of(a.d_v), hk, group, static_cast<int>(a.q.dim));
      },
      a.q.type);
}

}  // namespace upipe::cuda
