// CUTLASS's Hopper grouped GEMM (TMA, warp-specialized cooperative, bf16 in, fp32
// accumulation) for the experts' three forms: the projection (rows W^T), the input gradient
// (rows W) and the weight gradient (rows^T other). The groups' sizes stay on the device: a
// setup kernel writes each group's problem shape, pointers and strides from the offsets,
// and CUTLASS's tile scheduler reads the shapes there, so nothing waits on the host. An
// empty group gets a problem with no rows (no tiles). Compiled for sm_90a only where the
// CUTLASS headers were fetched (scripts/fetch-cutlass); elsewhere the engine says so.
#include "ops/cuda/grouped_gemm.hpp"

#include <cstdint>
#include <string>

#include "core/error.hpp"

#if defined(UPIPE_HAVE_CUTLASS)

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>
#include "ops/cuda/cuda_check.hpp"

namespace upipe::cuda {

namespace {

using namespace cute;
using problem_shape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using shape3 = typename problem_shape::UnderlyingProblemShape;
using bf16 = cutlass::bfloat16_t;

// One grouped GEMM kernel: bf16 A and B in the given layouts, D (and C) row-major.
template <class LayoutA, class LayoutB, class ElementD>
struct grouped_kernel {
  using LayoutC = cutlass::layout::RowMajor;
  static constexpr int align_ab = 8, align_d = 128 / cutlass::sizeof_bits<ElementD>::value;
  using TileShape = Shape<_128, _128, _64>;
  using ClusterShape = Shape<_1, _1, _1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD, LayoutC*, align_d, ElementD, LayoutC*,
      align_d, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, bf16, LayoutA*, align_ab, bf16, LayoutB*, align_ab, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<problem_shape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
};

using row = cutlass::layout::RowMajor;
using col = cutlass::layout::ColumnMajor;
// rows W^T: A the rows (row-major), B a weight (N x K row-major: K-major, CUTLASS's column-major B).
using projection_kernel = grouped_kernel<row, col, bf16>;
// rows W: B a weight (K x N row-major: N-major).
using input_grad_kernel = grouped_kernel<row, row, bf16>;
using input_grad_f32_kernel = grouped_kernel<row, row, float>;
// rows^T other: A the rows transposed (M-major), B the other rows (N-major), D the f32 gradient.
using weight_grad_kernel = grouped_kernel<col, row, float>;

// A stride whose one dynamic mode among the first two is the leading dimension (the batch
// mode, when dynamic, 0).
template <class Stride>
__device__ Stride leading(std::int64_t ld) {
  Stride s{};
  if constexpr (!cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(s))>>::value) cute::get<0>(s) = ld;
  if constexpr (!cute::is_static<cute::remove_cvref_t<decltype(cute::get<1>(s))>>::value) cute::get<1>(s) = ld;
  return s;
}

// The device arrays of one call, carved from the workspace.
template <class K>
struct group_arrays {
  shape3* shapes;
  const bf16** a;
  const bf16** b;
  const void** c;
  void** d;
  typename K::StrideA* stride_a;
  typename K::StrideB* stride_b;
  typename K::StrideC* stride_c;
  typename K::StrideD* stride_d;
};

constexpr std::size_t align_up(std::size_t v) { return (v + 255) / 256 * 256; }

template <class K>
std::size_t carve(group_arrays<K>& g, std::byte* base, int groups) {
  std::size_t at = 0;
  const auto take = [&](auto*& p, std::size_t each) {
    p = reinterpret_cast<std::remove_reference_t<decltype(p)>>(base + at);
    at += align_up(each * static_cast<std::size_t>(groups));
  };
  take(g.shapes, sizeof(shape3));
  take(g.a, sizeof(void*));
  take(g.b, sizeof(void*));
  take(g.c, sizeof(void*));
  take(g.d, sizeof(void*));
  take(g.stride_a, sizeof(typename K::StrideA));
  take(g.stride_b, sizeof(typename K::StrideB));
  take(g.stride_c, sizeof(typename K::StrideC));
  take(g.stride_d, sizeof(typename K::StrideD));
  return at;
}

// What the setup kernel reads: the call's matrices, and up to `batch` groups' weights.
constexpr int batch = 64;
struct setup_params {
  grouped_form form;
  const std::int32_t* offsets;
  const bf16* rows;
  std::int64_t ld_rows, rows_cols;
  const bf16* other;
  std::int64_t ld_other;
  void* out;
  std::int64_t ld_out, out_bytes;  // out_bytes: the size of one element of out (or of the weights' gradient)
  std::int64_t w_rows, w_cols, ld_w;
  int first, count;
  void* weights[batch];
};

template <class K>
__global__ void setup_kernel(setup_params p, group_arrays<K> g) {
  const int i = static_cast<int>(threadIdx.x);
  if (i >= p.count) return;
  const int group = p.first + i;
  const std::int64_t r0 = p.offsets[group], rows = p.offsets[group + 1] - r0;
  const auto* rows_at = p.rows + r0 * p.ld_rows;
  auto* out_at = static_cast<std::byte*>(p.out) + r0 * p.ld_out * p.out_bytes;
  switch (p.form) {
    case grouped_form::rows_by_weight_t:  // (rows, N) = rows (rows, K) W^T, W (N, K)
      g.shapes[group] = shape3{static_cast<int>(rows), static_cast<int>(p.w_rows), static_cast<int>(p.w_cols)};
      g.a[group] = rows_at;
      g.b[group] = static_cast<const bf16*>(p.weights[i]);
      g.c[group] = out_at;
      g.d[group] = out_at;
      g.stride_a[group] = leading<typename K::StrideA>(p.ld_rows);
      g.stride_b[group] = leading<typename K::StrideB>(p.ld_w);
      g.stride_c[group] = leading<typename K::StrideC>(p.ld_out);
      g.stride_d[group] = leading<typename K::StrideD>(p.ld_out);
      break;
    case grouped_form::rows_by_weight:  // (rows, N) = rows (rows, K) W, W (K, N)
      g.shapes[group] = shape3{static_cast<int>(rows), static_cast<int>(p.w_cols), static_cast<int>(p.w_rows)};
      g.a[group] = rows_at;
      g.b[group] = static_cast<const bf16*>(p.weights[i]);
      g.c[group] = out_at;
      g.d[group] = out_at;
      g.stride_a[group] = leading<typename K::StrideA>(p.ld_rows);
      g.stride_b[group] = leading<typename K::StrideB>(p.ld_w);
      g.stride_c[group] = leading<typename K::StrideC>(p.ld_out);
      g.stride_d[group] = leading<typename K::StrideD>(p.ld_out);
      break;
    case grouped_form::weight_gradient:  // W (M, N) += rows^T (M, rows) other (rows, N); no rows: no tiles
      g.shapes[group] =
          shape3{rows > 0 ? static_cast<int>(p.w_rows) : 0, static_cast<int>(p.w_cols), static_cast<int>(rows)};
      g.a[group] = rows_at;
      g.b[group] = p.other + r0 * p.ld_other;
      g.c[group] = p.weights[i];
      g.d[group] = p.weights[i];
      g.stride_a[group] = leading<typename K::StrideA>(p.ld_rows);
      g.stride_b[group] = leading<typename K::StrideB>(p.ld_other);
      g.stride_c[group] = leading<typename K::StrideC>(p.ld_w);
      g.stride_d[group] = leading<typename K::StrideD>(p.ld_w);
      break;
  }
}

void check(cutlass::Status status, const char* what) {
  if (status != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("CUTLASS grouped GEMM: ") + what + " failed: " +
                             cutlassGetStatusString(status));
}

template <class K>
void run_kernel(const moe_grouped_gemm_args& a, std::byte* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  const int groups = static_cast<int>(a.weights.size());
  group_arrays<K> g{};
  const std::size_t arrays = carve(g, workspace, groups);
  const bool gradient = a.form == grouped_form::weight_gradient;
  setup_params p{};
  p.form = a.form;
  p.offsets = static_cast<const std::int32_t*>(a.offsets.data);
  p.rows = static_cast<const bf16*>(a.rows.data);
  p.ld_rows = a.rows.ld;
  p.rows_cols = a.rows.cols;
  p.other = static_cast<const bf16*>(a.other.data);
  p.ld_other = a.other.ld;
  p.out = a.out.data;
  p.ld_out = a.out.ld;
  p.out_bytes = static_cast<std::int64_t>(dtype_size(gradient ? a.weights.front().type : a.out.type));
  p.w_rows = a.weights.front().rows;
  p.w_cols = a.weights.front().cols;
  p.ld_w = a.weights.front().ld;
  for (int first = 0; first < groups; first += batch) {
    p.first = first;
    p.count = std::min(batch, groups - first);
    for (int i = 0; i < p.count; ++i) p.weights[i] = a.weights[static_cast<std::size_t>(first + i)].data;
    setup_kernel<K><<<1, batch, 0, stream>>>(p, g);
    UPIPE_CUDA_CHECK(cudaGetLastError());
  }
  static const cutlass::KernelHardwareInfo hw = [] {
    int device = 0;
    UPIPE_CUDA_CHECK(cudaGetDevice(&device));
    return cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename K::Kernel>(device);
  }();
  typename K::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                   {groups, g.shapes, nullptr},
                                   {g.a, g.stride_a, g.b, g.stride_b},
                                   {{}, reinterpret_cast<const typename K::Epilogue::ElementC**>(g.c), g.stride_c,
                                    reinterpret_cast<typename K::Epilogue::ElementD**>(g.d), g.stride_d},
                                   hw};
  args.epilogue.thread.alpha = a.alpha;
  args.epilogue.thread.beta = a.beta;
  typename K::Gemm gemm;
  const std::size_t needed = K::Gemm::get_workspace_size(args);
  UPIPE_CHECK(arrays + needed <= workspace_bytes,
              "the grouped GEMM's arrays and CUTLASS's workspace need " + std::to_string(arrays + needed) +
                  " bytes, more than the " + std::to_string(workspace_bytes) + " reserved (grouped_gemm_workspace_bytes)");
  check(gemm.can_implement(args), "can_implement");
  check(gemm.initialize(args, workspace + arrays, stream), "initialize");
  check(gemm.run(stream), "run");
}

}  // namespace

bool cutlass_grouped_available() { return true; }

void cutlass_grouped_run(const moe_grouped_gemm_args& a, void* workspace, std::size_t workspace_bytes,
                         cudaStream_t stream) {
  auto* base = static_cast<std::byte*>(workspace);
  switch (a.form) {
    case grouped_form::rows_by_weight_t:
      UPIPE_CHECK(a.out.type == dtype::bf16, "the grouped projection writes bf16");
      return run_kernel<projection_kernel>(a, base, workspace_bytes, stream);
    case grouped_form::rows_by_weight:
      if (a.out.type == dtype::f32) return run_kernel<input_grad_f32_kernel>(a, base, workspace_bytes, stream);
      return run_kernel<input_grad_kernel>(a, base, workspace_bytes, stream);
    case grouped_form::weight_gradient:
      return run_kernel<weight_grad_kernel>(a, base, workspace_bytes, stream);
  }
}

}  // namespace upipe::cuda

#else  // no CUTLASS headers in this build

namespace upipe::cuda {

bool cutlass_grouped_available() { return false; }

void cutlass_grouped_run(const moe_grouped_gemm_args&, void*, std::size_t, cudaStream_t) {
  throw config_error("the grouped expert GEMMs need CUTLASS, which this build lacks: run scripts/fetch-cutlass and "
                     "rebuild, or choose --moe-gemm cublas or --moe-gemm loop");
}

}  // namespace upipe::cuda

#endif
