// Fused attention through cuDNN's graph API, built with NVIDIA's header-only cudnn-frontend:
// one SDPA forward graph (O and the natural-log Stats) and one SDPA backward graph (dQ, dK,
// dV) per shape, built once, cached, and executed with the views' own pointers and strides.
// bf16 operands, fp32 softmax statistics and accumulation; or FP8 (ops/fp8_attention.hpp):
// the operands quantized by kernels_fp8.cu into packed E4M3/E5M2 copies with per-tensor
// scales computed on the device, cuDNN's FP8 graphs, the outputs dequantized back.
#include <cudnn.h>

// The frontend defines helpers this file never calls; its warnings are not ours to fix.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include <cudnn_frontend.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>

#include "core/error.hpp"
#include "ops/cuda/cuda_check.hpp"
#include "ops/cuda/cuda_ops.hpp"
#include "ops/cuda/sdpa_pieces.hpp"
#include "ops/fp8_attention.hpp"
#include "ops/sdpa_workspace.hpp"

namespace upipe::cuda {

namespace {

namespace fe = cudnn_frontend;
using tensor_ptr = std::shared_ptr<fe::graph::Tensor_attributes>;

enum class pass : std::uint8_t { forward, backward };

// The caller's tensors carry fixed uids, so a cached plan binds fresh pointers by number.
enum : std::int64_t { uid_q = 1, uid_k, uid_v, uid_o, uid_stats, uid_d_o, uid_d_q, uid_d_k, uid_d_v };
// FP8's scalars: uid_scalar + their slot in the engine's scalar array (cuda_ops.hpp).
constexpr std::int64_t uid_scalar = 100;
static_assert(fp8_slot::count * sizeof(float) <= sdpa_fp8_scalar_bytes, "FP8's scalars fit their bytes");

// The largest head dim cuDNN's fused bf16 attention runs, forward and backward, on Hopper.
constexpr std::int64_t max_head_dim = 256;
// The fused kernels move Q, K, V, O and their gradients in 16-byte vectors (and TMA tiles):
// every such pointer and outer stride must be a multiple of 16 bytes.
constexpr std::uintptr_t operand_alignment = 16;
constexpr std::int64_t bf16_per_vector = 8;
constexpr std::int64_t f32_per_vector = 4;
constexpr std::int64_t workspace_alignment = 256;
// cuDNN writes forward Stats at their declared strides from 9.12 on, and reads backward
// Stats at their declared strides from 9.26 on; before that only packed [1, h, s, 1] works.
constexpr std::size_t strided_stats_write_version = 91200;
constexpr std::size_t strided_stats_read_version = 92600;

std::string version_name(std::size_t v) {
  return std::to_string(v / 10000) + "." + std::to_string(v % 10000 / 100) + "." + std::to_string(v % 100);
}

// A head_view as cuDNN's [b = 1, h, s, d] tensor: sizes and element strides (d contiguous).
struct bhsd {
  std::int64_t heads = 0, tokens = 0, dim = 0;
  std::int64_t batch_stride = 0, head_stride = 0, token_stride = 0;
  bool operator==(const bhsd&) const = default;
};

bhsd layout_of(const head_view& v) {
  bhsd l{v.heads, v.tokens, v.dim, 0, v.head_stride, v.token_stride};
  // A stride over an extent of one addresses nothing: canonical values keep the plan key
  // and cuDNN's stride checks independent of whatever the view carried there.
  if (l.tokens == 1) l.token_stride = l.dim;
  if (l.heads == 1) l.head_stride = l.tokens * l.token_stride;
  l.batch_stride = std::max(l.heads * l.head_stride, l.tokens * l.token_stride);
  return l;
}

// The packed layout of a (tokens, heads, 1) f32 statistic that every cuDNN 9 reads.
bhsd packed_stats(std::int64_t heads, std::int64_t tokens) { return {heads, tokens, 1, heads * tokens, tokens, 1}; }

// The view of a packed statistic at `data`, for copying between it and the caller's view.
head_view packed_stats_view(void* data, const head_view& like) {
  return {data, dtype::f32, like.tokens, like.heads, 1, 1, like.tokens};
}

bool vector_aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % operand_alignment == 0; }

// Whether cuDNN can write (forward) or read (backward) the caller's log-sum-exp in place;
// otherwise it goes through a packed copy in the workspace.
bool stats_bindable(const head_view& lse, bool strided_supported) {
  const bhsd l = layout_of(lse);
  if (!vector_aligned(lse.data)) return false;
  if (l == packed_stats(l.heads, l.tokens)) return true;
  const auto vector_stride = [](std::int64_t extent, std::int64_t stride) {
    return extent == 1 || stride == 1 || stride % f32_per_vector == 0;
  };
  return strided_supported && vector_stride(l.heads, l.head_stride) && vector_stride(l.tokens, l.token_stride);
}

using namespace sdpa_pieces;

// Everything a built plan depends on. Pointers are not part of it: they are bound per call.

struct plan_key {
  pass direction = pass::forward;
  attn_mask mask = attn_mask::causal;
  band bounds;                    // mask causal: right 0; mask none: used only when left > 0
  std::uint32_t scale_bits = 0;
  attention_dtype arithmetic = attention_dtype::bf16;
  bool stage_stats = false;       // Stats live in the workspace, packed, and are copied
  bhsd q, k, v, o, stats;         // stats as cuDNN sees them (packed when staged)
  bhsd d_o, d_q, d_k, d_v;        // backward only
  bool operator==(const plan_key&) const = default;
};

struct plan_key_hash {
  std::size_t operator()(const plan_key& key) const {
    std::size_t h = 0;
    const auto mix = [&h](std::int64_t x) {
      h ^= std::hash<std::int64_t>{}(x) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    };
    mix(static_cast<std::int64_t>(key.direction));
    mix(static_cast<std::int64_t>(key.mask));
    mix(key.bounds.left);
    mix(key.bounds.right);
    mix(key.scale_bits);
    mix(static_cast<std::int64_t>(key.arithmetic));
    mix(key.stage_stats);
    for (const bhsd* l : {&key.q, &key.k, &key.v, &key.o, &key.stats, &key.d_o, &key.d_q, &key.d_k, &key.d_v})
      for (std::int64_t x : {l->heads, l->tokens, l->dim, l->batch_stride, l->head_stride, l->token_stride}) mix(x);
    return h;
  }
};

std::string describe(const plan_key& key) {
  std::string s = "attention ";
  s += key.direction == pass::forward ? "forward" : "backward";
  s += " (sq " + std::to_string(key.q.tokens) + ", skv " + std::to_string(key.k.tokens) + ", hq " +
       std::to_string(key.q.heads) + ", hk " + std::to_string(key.k.heads) + ", d " + std::to_string(key.q.dim) +
       ", " + (key.mask == attn_mask::causal ? "causal" : "unmasked") +
       (key.bounds.left > 0 ? ", window band (" + std::to_string(key.bounds.left) + ", " +
                                  std::to_string(key.bounds.right) + ")"
                            : std::string()) +
       ", scale " + std::to_string(std::bit_cast<float>(key.scale_bits)) +
       (key.arithmetic == attention_dtype::fp8 ? ", fp8" : "") + ")";
  return s;
}

[[noreturn]] void cannot_run(const plan_key& key, const std::string& reason) {
  throw config_error("cuDNN " + version_name(cudnnGetVersion()) + " cannot run fused " + describe(key) + ": " +
                     reason);
}

// The rules the fused kernels state up front, checked before the frontend so that the
// message names the value; whatever else cuDNN refuses comes back from the frontend.
void check_layouts(const plan_key& key) {
  const std::int64_t d = key.q.dim;
  if (d > max_head_dim)
    cannot_run(key, "head dim " + std::to_string(d) + " (supported up to " + std::to_string(max_head_dim) +
                        "); use a model with head dim <= 256");
  if (d % bf16_per_vector != 0)
    cannot_run(key, "head dim " + std::to_string(d) + " is not a multiple of 8 (the fused kernels load 16 bytes)");
  if (key.arithmetic == attention_dtype::fp8 && !fp8_attention_runs(d, key.direction == pass::backward))
    cannot_run(key, "head dim " + std::to_string(d) + " (on Hopper FP8 attention runs the forward at head dims up to " +
                        std::to_string(fp8_forward_max_head_dim) + " in multiples of " +
                        std::to_string(fp8_head_dim_multiple) + " and the backward at " +
                        std::to_string(fp8_backward_head_dim) + " only); use --attention-dtype bf16");
  const std::pair<const char*, const bhsd*> operands[] = {
      {"q", &key.q},         {"k", &key.k},     {"v", &key.v},     {"out", &key.o},
      {"d_out", &key.d_o},   {"d_q", &key.d_q}, {"d_k", &key.d_k}, {"d_v", &key.d_v}};
  for (const auto& [name, l] : operands) {
    if (l->heads > 1 && l->head_stride % bf16_per_vector != 0)
      cannot_run(key, std::string(name) + " head stride " + std::to_string(l->head_stride) +
                          " is not a multiple of 8 elements (16 bytes); pack the heads densely");
    if (l->tokens > 1 && l->token_stride % bf16_per_vector != 0)
      cannot_run(key, std::string(name) + " token stride " + std::to_string(l->token_stride) +
                          " is not a multiple of 8 elements (16 bytes); pack the tokens densely");
  }
}

void check_pointer(const plan_key& key, const char* name, const head_view& v) {
  if (!vector_aligned(v.data))
    cannot_run(key, std::string(name) + " does not start on a 16-byte boundary; take head and token blocks at "
                                        "multiples of 8 elements");
}

fe::graph::Tensor_attributes& shape_tensor(fe::graph::Tensor_attributes& t, const char* name, std::int64_t uid,
                                           const bhsd& l, fe::DataType_t type) {
  return t.set_name(name)
      .set_uid(uid)
      .set_data_type(type)
      .set_dim({1, l.heads, l.tokens, l.dim})
      .set_stride({l.batch_stride, l.head_stride, l.token_stride, 1});
}

tensor_ptr input(fe::graph::Graph& g, const char* name, std::int64_t uid, const bhsd& l, fe::DataType_t type) {
  fe::graph::Tensor_attributes t;
  return g.tensor(shape_tensor(t, name, uid, l, type));
}

void output(const tensor_ptr& t, const char* name, std::int64_t uid, const bhsd& l, fe::DataType_t type) {
  shape_tensor(*t, name, uid, l, type).set_output(true);
}

// Top-left diagonal with right bound 0: query i sees key j iff j <= i; a window adds the
// left bound, j > i - left. An unmasked block under a window keeps its right bound past
// its last key, which also marks the graph causal-like (cuDNN 9.14.0 refuses a left bound
// without a right one beyond 1024 keys).
template <class Attributes>
void set_band(Attributes& attributes, const plan_key& key) {
  if (key.mask == attn_mask::none && key.bounds.left == 0) return;
  attributes.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
      .set_diagonal_band_right_bound(static_cast<int>(key.bounds.right));
  if (key.bounds.left > 0) attributes.set_diagonal_band_left_bound(static_cast<int>(key.bounds.left));
}

// The composite graph (matmuls, a generated-index mask, softmax) is the one cuDNN fuses
// into its Hopper flash-attention kernels (shared/reference/cudnn_sdpa_graphs.txt), and the
// only one with a causal mask before cuDNN 9.21; both masks use it, so they share numerics
// (FP8's forward too: its attributes are the same type).
fe::graph::SDPA_attributes forward_attributes(const plan_key& key, const char* name) {
  auto attributes = fe::graph::SDPA_attributes()
                        .set_name(name)
                        .set_generate_stats(true)
                        .set_attn_scale(std::bit_cast<float>(key.scale_bits))
                        .set_implementation(fe::AttentionImplementation_t::COMPOSITE);
  set_band(attributes, key);
  return attributes;
}

void add_forward(fe::graph::Graph& g, const plan_key& key) {
  const auto bf16 = fe::DataType_t::BFLOAT16;
  const tensor_ptr q = input(g, "q", uid_q, key.q, bf16);
  const tensor_ptr k = input(g, "k", uid_k, key.k, bf16);
  const tensor_ptr v = input(g, "v", uid_v, key.v, bf16);
  const auto [o, stats] = g.sdpa(q, k, v, forward_attributes(key, "sdpa_forward"));
  output(o, "out", uid_o, key.o, bf16);
  output(stats, "lse", uid_stats, key.stats, fe::DataType_t::FLOAT);
}

// Grouped-query heads: the frontend computes dK and dV at the query head count in virtual
// tensors and reduces each group, so d_k and d_v are written, never accumulated.
void add_backward(fe::graph::Graph& g, const plan_key& key) {
  const auto bf16 = fe::DataType_t::BFLOAT16;
  const tensor_ptr q = input(g, "q", uid_q, key.q, bf16);
  const tensor_ptr k = input(g, "k", uid_k, key.k, bf16);
  const tensor_ptr v = input(g, "v", uid_v, key.v, bf16);
  const tensor_ptr o = input(g, "out", uid_o, key.o, bf16);
  const tensor_ptr d_o = input(g, "d_out", uid_d_o, key.d_o, bf16);
  const tensor_ptr stats = input(g, "lse", uid_stats, key.stats, fe::DataType_t::FLOAT);
  auto attributes = fe::graph::SDPA_backward_attributes()
                        .set_name("sdpa_backward")
                        .set_attn_scale(std::bit_cast<float>(key.scale_bits));
  set_band(attributes, key);
  const auto [d_q, d_k, d_v] = g.sdpa_backward(q, k, v, o, d_o, stats, attributes);
  output(d_q, "d_q", uid_d_q, key.d_q, bf16);
  output(d_k, "d_k", uid_d_k, key.d_k, bf16);
  output(d_v, "d_v", uid_d_v, key.d_v, bf16);
}

// An FP8 scalar (a scale, its inverse, or an amax cuDNN writes): f32 [1, 1, 1, 1] in device
// memory at its slot, bound per call.
tensor_ptr scalar_input(fe::graph::Graph& g, const char* name, int slot) {
  fe::graph::Tensor_attributes t;
  t.set_name(name).set_uid(uid_scalar + slot).set_data_type(fe::DataType_t::FLOAT).set_dim({1, 1, 1, 1}).set_stride(
      {1, 1, 1, 1});
  return g.tensor(t);
}

void scalar_output(const tensor_ptr& t, const char* name, int slot) {
  t->set_name(name).set_uid(uid_scalar + slot).set_data_type(fe::DataType_t::FLOAT).set_dim({1, 1, 1, 1}).set_stride(
      {1, 1, 1, 1});
  t->set_output(true);
}

// FP8 forward (cuDNN's sdpa_fp8, the composite graph as bf16's): Q, K, V in E4M3 with their
// descales, the probabilities quantized at scale_s, O written in E4M3 at scale_o.
void add_forward_fp8(fe::graph::Graph& g, const plan_key& key) {
  namespace slot = fp8_slot;
  const auto e4m3 = fe::DataType_t::FP8_E4M3;
  const tensor_ptr q = input(g, "q", uid_q, key.q, e4m3);
  const tensor_ptr k = input(g, "k", uid_k, key.k, e4m3);
  const tensor_ptr v = input(g, "v", uid_v, key.v, e4m3);
  const auto attributes = forward_attributes(key, "sdpa_fp8_forward");
  const auto [o, stats, amax_s, amax_o] =
      g.sdpa_fp8(q, k, v, scalar_input(g, "descale_q", slot::descale_q), scalar_input(g, "descale_k", slot::descale_k),
                 scalar_input(g, "descale_v", slot::descale_v), scalar_input(g, "descale_s", slot::descale_s),
                 scalar_input(g, "scale_s", slot::scale_s), scalar_input(g, "scale_o", slot::scale_o), attributes);
  output(o, "out", uid_o, key.o, e4m3);
  output(stats, "lse", uid_stats, key.stats, fe::DataType_t::FLOAT);
  scalar_output(amax_s, "amax_s", slot::amax_s_out);
  scalar_output(amax_o, "amax_o", slot::amax_o_out);
}

// FP8 backward (cuDNN's sdpa_fp8_backward): Q, K, V, O in E4M3, dO in E5M2; dS (cuDNN's
// dP) and the outputs dQ, dK, dV in E5M2 at the scales ops/fp8_attention.hpp bounds.
void add_backward_fp8(fe::graph::Graph& g, const plan_key& key) {
  namespace slot = fp8_slot;
  const auto e4m3 = fe::DataType_t::FP8_E4M3, e5m2 = fe::DataType_t::FP8_E5M2;
  const tensor_ptr q = input(g, "q", uid_q, key.q, e4m3);
  const tensor_ptr k = input(g, "k", uid_k, key.k, e4m3);
  const tensor_ptr v = input(g, "v", uid_v, key.v, e4m3);
  const tensor_ptr o = input(g, "out", uid_o, key.o, e4m3);
  const tensor_ptr d_o = input(g, "d_out", uid_d_o, key.d_o, e5m2);
  const tensor_ptr stats = input(g, "lse", uid_stats, key.stats, fe::DataType_t::FLOAT);
  auto attributes = fe::graph::SDPA_fp8_backward_attributes()
                        .set_name("sdpa_fp8_backward")
                        .set_attn_scale(std::bit_cast<float>(key.scale_bits));
  set_band(attributes, key);
  const auto [d_q, d_k, d_v, amax_d_q, amax_d_k, amax_d_v, amax_d_s] = g.sdpa_fp8_backward(
      q, k, v, o, d_o, stats, scalar_input(g, "descale_q", slot::descale_q),
      scalar_input(g, "descale_k", slot::descale_k), scalar_input(g, "descale_v", slot::descale_v),
      scalar_input(g, "descale_o", slot::descale_o), scalar_input(g, "descale_d_o", slot::descale_d_o),
      scalar_input(g, "descale_s", slot::descale_s), scalar_input(g, "descale_d_s", slot::descale_d_s),
      scalar_input(g, "scale_s", slot::scale_s), scalar_input(g, "scale_d_q", slot::scale_d_q),
      scalar_input(g, "scale_d_k", slot::scale_d_k), scalar_input(g, "scale_d_v", slot::scale_d_v),
      scalar_input(g, "scale_d_s", slot::scale_d_s), attributes);
  output(d_q, "d_q", uid_d_q, key.d_q, e5m2);
  output(d_k, "d_k", uid_d_k, key.d_k, e5m2);
  output(d_v, "d_v", uid_d_v, key.d_v, e5m2);
  scalar_output(amax_d_q, "amax_d_q", slot::amax_d_q_out);
  scalar_output(amax_d_k, "amax_d_k", slot::amax_d_k_out);
  scalar_output(amax_d_v, "amax_d_v", slot::amax_d_v_out);
  scalar_output(amax_d_s, "amax_d_s", slot::amax_d_s_out);
}

// A built graph and the workspace it needs: cuDNN's own plus the frontend's (the backward's
// fp32 dQ accumulator and row sums live there), then the packed Stats when staged.
struct sdpa_plan {
  fe::graph::Graph graph;
  std::int64_t stats_offset = 0;
  std::int64_t workspace_bytes = 0;
};

void check_built(fe::error_t status, const plan_key& key) {
  if (status.is_bad()) cannot_run(key, status.get_message());
}

std::unique_ptr<sdpa_plan> build_plan(const plan_key& key, cudnnHandle_t handle) {
  auto plan = std::make_unique<sdpa_plan>();
  fe::graph::Graph& g = plan->graph;
  g.set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const bool fp8 = key.arithmetic == attention_dtype::fp8;
  if (key.direction == pass::forward)
    fp8 ? add_forward_fp8(g, key) : add_forward(g, key);
  else
    fp8 ? add_backward_fp8(g, key) : add_backward(g, key);
  check_built(g.validate(), key);
  check_built(g.build_operation_graph(handle), key);
  check_built(g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), key);
  check_built(g.check_support(), key);
  check_built(g.build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), key);
  std::int64_t graph_bytes = 0;
  check_built(g.get_workspace_size(graph_bytes), key);
  plan->stats_offset = (graph_bytes + workspace_alignment - 1) / workspace_alignment * workspace_alignment;
  const std::int64_t stats_bytes = key.stage_stats ? key.q.heads * key.q.tokens * std::int64_t{sizeof(float)} : 0;
  plan->workspace_bytes = plan->stats_offset + stats_bytes;
  return plan;
}

// The parts both directions share: mask, scale, q, k, v, o and the statistics (bound in
// place when cuDNN can address the caller's layout, else staged packed).
template <class Args>
plan_key common_key(pass direction, const Args& a, const band& bounds, bool strided_stats_supported) {
  plan_key key;
  key.direction = direction;
  key.mask = a.mask;
  key.bounds = bounds;
  key.scale_bits = std::bit_cast<std::uint32_t>(a.scale);
  key.q = layout_of(a.q);
  key.k = layout_of(a.k);
  key.v = layout_of(a.v);
  key.o = layout_of(a.out);
  key.stage_stats = !stats_bindable(a.lse, strided_stats_supported);
  key.stats = key.stage_stats ? packed_stats(a.lse.heads, a.lse.tokens) : layout_of(a.lse);
  return key;
}

plan_key forward_key(const sdpa_forward_args& a, const band& bounds, std::size_t version) {
  return common_key(pass::forward, a, bounds, version >= strided_stats_write_version);
}

plan_key backward_key(const sdpa_backward_args& a, const band& bounds, std::size_t version) {
  plan_key key = common_key(pass::backward, a, bounds, version >= strided_stats_read_version);
  key.d_o = layout_of(a.d_out);
  key.d_q = layout_of(a.d_q);
  key.d_k = layout_of(a.d_k);
  key.d_v = layout_of(a.d_v);
  return key;
}

bool empty(const head_view& v) { return v.tokens == 0 || v.heads == 0 || v.dim == 0; }

void zero(const head_view& v, cudaStream_t stream) {
  if (!empty(v)) run(fill_heads_args{v, 0.0f}, context{.stream = stream});
}

}  // namespace

struct sdpa_engine::impl {
  cudaStream_t stream;
  scratch_fn scratch;
  std::size_t version = cudnnGetVersion();
  cudnnHandle_t handle = nullptr;
  std::unordered_map<plan_key, std::unique_ptr<sdpa_plan>, plan_key_hash> plans;
  // One workspace serves every plan: they all run in order on one stream.
  std::byte* workspace = nullptr;
  std::int64_t workspace_bytes = 0;

  impl(cudaStream_t s, const scratch_fn& fn) : stream(s), scratch(fn) {
    if (version / 10000 != static_cast<std::size_t>(CUDNN_MAJOR))
      throw config_error("cuDNN " + version_name(version) + " is loaded, but upipe was built against cuDNN " +
                         version_name(CUDNN_VERSION) + ": put a cuDNN " + std::to_string(CUDNN_MAJOR) +
                         ".x library first on the library path");
    UPIPE_LIBRARY_CHECK("cuDNN", cudnnCreate(&handle), cudnnGetErrorString);
    UPIPE_LIBRARY_CHECK("cuDNN", cudnnSetStream(handle, stream), cudnnGetErrorString);
  }

  ~impl() {
    plans.clear();  // execution plans before the handle they were built with
    if (handle == nullptr) return;
    const cudnnStatus_t status = cudnnDestroy(handle);
    if (status != CUDNN_STATUS_SUCCESS)
      std::fprintf(stderr, "upipe: cudnnDestroy failed: %s\n", cudnnGetErrorString(status));
  }

  sdpa_plan& plan_for(const plan_key& key) {
    if (auto it = plans.find(key); it != plans.end()) return *it->second;
    check_layouts(key);
    std::unique_ptr<sdpa_plan> plan;
    try {
      plan = build_plan(key, handle);
    } catch (const config_error&) {
      throw;
    } catch (const std::exception& e) {  // the frontend throws for a few graphs it cannot express
      cannot_run(key, e.what());
    }
    // At least the meta backend's model, so that the planner's arena is this one.
    const std::size_t modelled = key.direction == pass::forward
                                     ? sdpa_forward_workspace_bytes(key.q.tokens, key.q.heads)
                                     : sdpa_backward_workspace_bytes(key.q.tokens, key.q.heads, key.q.dim,
                                                                     key.k.tokens, key.mask);
    plan->workspace_bytes = std::max(plan->workspace_bytes, static_cast<std::int64_t>(modelled));
    // Scratch belongs to the backend for its lifetime, so a smaller block is simply left behind.
    if (plan->workspace_bytes > workspace_bytes) {
      workspace = static_cast<std::byte*>(scratch(static_cast<std::size_t>(plan->workspace_bytes)));
      workspace_bytes = plan->workspace_bytes;
    }
    return *plans.emplace(key, std::move(plan)).first->second;
  }

  void* staged_stats(const sdpa_plan& plan) const { return workspace + plan.stats_offset; }

  // Scratch for a piece's d_k and d_v whose key rows an earlier piece wrote (a window's
  // query rows split over one band of keys): grown, never shrunk, as the workspace.
  std::byte* grad_scratch = nullptr;
  std::size_t grad_scratch_bytes = 0;
  std::byte* gradients(std::size_t bytes) {
    if (bytes > grad_scratch_bytes) {
      grad_scratch = static_cast<std::byte*>(scratch(bytes));
      grad_scratch_bytes = bytes;
    }
    return grad_scratch;
  }

  void execute(sdpa_plan& plan, std::unordered_map<std::int64_t, void*>& pack) {
    fe::error_t status = plan.graph.execute(handle, pack, workspace);
    if (status.is_bad())
      fail("cuDNN", "cudnn_frontend Graph::execute", status.get_message().c_str(), __FILE__, __LINE__);
  }

  // One fused call on the whole of a's rows (no documents, no window left), with `bounds`.
  void forward(const sdpa_forward_args& a, const band& bounds);
  void backward(const sdpa_backward_args& a, const band& bounds);

  // FP8: the operands' packed copies after the scalars (ops/sdpa_workspace.hpp), grown
  // before the plan's workspace, as the meta backend models it.
  std::byte* fp8_buffer = nullptr;
  std::size_t fp8_buffer_bytes = 0;
  std::byte* fp8_space(std::size_t bytes) {
    if (bytes > fp8_buffer_bytes) {
      fp8_buffer = static_cast<std::byte*>(scratch(bytes));
      fp8_buffer_bytes = bytes;
    }
    return fp8_buffer;
  }
  void forward_fp8(const sdpa_forward_args& a);
  void backward_fp8(const sdpa_backward_args& a);
};

namespace {

// A packed (tokens, heads, dim) FP8 copy of an operand, carved from the FP8 buffer.
struct fp8_operand {
  std::uint8_t* data = nullptr;
  bhsd layout;
};

fp8_operand carve(std::byte*& at, const head_view& like) {
  const head_view packed{at, dtype::u8, like.tokens, like.heads, like.dim, like.heads * like.dim, like.dim};
  const fp8_operand o{reinterpret_cast<std::uint8_t*>(at), layout_of(packed)};
  at += sdpa_fp8_operand_bytes(like);
  return o;
}

void bind_scalars(std::unordered_map<std::int64_t, void*>& pack, float* slots, std::initializer_list<int> used) {
  for (const int slot : used) pack[uid_scalar + slot] = slots + slot;
}

}  // namespace

// Amaxes, scales and quantized copies on the stream, then cuDNN's FP8 graph, then O back
// in the working dtype.
void sdpa_engine::impl::forward_fp8(const sdpa_forward_args& a) {
  namespace slot = fp8_slot;
  std::byte* at = fp8_space(sdpa_fp8_forward_bytes(a));
  float* slots = reinterpret_cast<float*>(at);
  at += sdpa_fp8_scalar_bytes;
  const fp8_operand q = carve(at, a.q), k = carve(at, a.k), v = carve(at, a.v), o = carve(at, a.out);
  UPIPE_CUDA_CHECK(cudaMemsetAsync(slots, 0, sdpa_fp8_scalar_bytes, stream));
  fp8_amax(a.q, slots + slot::amax_q, stream);
  fp8_amax(a.k, slots + slot::amax_k, stream);
  fp8_amax(a.v, slots + slot::amax_v, stream);
  compute_fp8_forward_scales(slots, stream);
  fp8_quantize(a.q, q.data, slots + slot::scale_q, fp8_format::e4m3, stream);
  fp8_quantize(a.k, k.data, slots + slot::scale_k, fp8_format::e4m3, stream);
  fp8_quantize(a.v, v.data, slots + slot::scale_v, fp8_format::e4m3, stream);
  plan_key key = forward_key(a, band{}, version);
  key.arithmetic = attention_dtype::fp8;
  key.q = q.layout;
  key.k = k.layout;
  key.v = v.layout;
  key.o = o.layout;
  sdpa_plan& plan = plan_for(key);
  void* stats = key.stage_stats ? staged_stats(plan) : a.lse.data;
  std::unordered_map<std::int64_t, void*> pack{
      {uid_q, q.data}, {uid_k, k.data}, {uid_v, v.data}, {uid_o, o.data}, {uid_stats, stats}};
  bind_scalars(pack, slots,
               {slot::descale_q, slot::descale_k, slot::descale_v, slot::descale_s, slot::scale_s, slot::scale_o,
                slot::amax_s_out, slot::amax_o_out});
  execute(plan, pack);
  if (key.stage_stats) run(copy_heads_args{a.lse, packed_stats_view(stats, a.lse)}, context{.stream = stream});
  fp8_dequantize(o.data, a.out, slots + slot::descale_o, fp8_format::e4m3, stream);
}

void sdpa_engine::impl::backward_fp8(const sdpa_backward_args& a) {
  namespace slot = fp8_slot;
  std::byte* at = fp8_space(sdpa_fp8_backward_bytes(a));
  float* slots = reinterpret_cast<float*>(at);
  at += sdpa_fp8_scalar_bytes;
  const fp8_operand q = carve(at, a.q), k = carve(at, a.k), v = carve(at, a.v), o = carve(at, a.out),
                    d_o = carve(at, a.d_out), d_q = carve(at, a.d_q), d_k = carve(at, a.d_k), d_v = carve(at, a.d_v);
  UPIPE_CUDA_CHECK(cudaMemsetAsync(slots, 0, sdpa_fp8_scalar_bytes, stream));
  fp8_amax(a.q, slots + slot::amax_q, stream);
  fp8_amax(a.k, slots + slot::amax_k, stream);
  fp8_amax(a.v, slots + slot::amax_v, stream);
  fp8_amax(a.out, slots + slot::amax_o, stream);
  fp8_amax(a.d_out, slots + slot::amax_d_o, stream);
  compute_fp8_backward_scales(slots, a.q.tokens, a.q.dim, a.scale, stream);
  fp8_quantize(a.q, q.data, slots + slot::scale_q, fp8_format::e4m3, stream);
  fp8_quantize(a.k, k.data, slots + slot::scale_k, fp8_format::e4m3, stream);
  fp8_quantize(a.v, v.data, slots + slot::scale_v, fp8_format::e4m3, stream);
  fp8_quantize(a.out, o.data, slots + slot::scale_o, fp8_format::e4m3, stream);
  fp8_quantize(a.d_out, d_o.data, slots + slot::scale_d_o, fp8_format::e5m2, stream);
  plan_key key = backward_key(a, band{}, version);
  key.arithmetic = attention_dtype::fp8;
  key.q = q.layout;
  key.k = k.layout;
  key.v = v.layout;
  key.o = o.layout;
  key.d_o = d_o.layout;
  key.d_q = d_q.layout;
  key.d_k = d_k.layout;
  key.d_v = d_v.layout;
  sdpa_plan& plan = plan_for(key);
  void* stats = a.lse.data;
  if (key.stage_stats) {
    stats = staged_stats(plan);
    run(copy_heads_args{packed_stats_view(stats, a.lse), a.lse}, context{.stream = stream});
  }
  std::unordered_map<std::int64_t, void*> pack{{uid_q, q.data},     {uid_k, k.data},     {uid_v, v.data},
                                               {uid_o, o.data},     {uid_d_o, d_o.data}, {uid_stats, stats},
                                               {uid_d_q, d_q.data}, {uid_d_k, d_k.data}, {uid_d_v, d_v.data}};
  bind_scalars(pack, slots,
               {slot::descale_q, slot::descale_k, slot::descale_v, slot::descale_o, slot::descale_d_o,
                slot::descale_s, slot::descale_d_s, slot::scale_s, slot::scale_d_q, slot::scale_d_k, slot::scale_d_v,
                slot::scale_d_s, slot::amax_d_q_out, slot::amax_d_k_out, slot::amax_d_v_out, slot::amax_d_s_out});
  execute(plan, pack);
  fp8_dequantize(d_q.data, a.d_q, slots + slot::descale_d_q, fp8_format::e5m2, stream);
  fp8_dequantize(d_k.data, a.d_k, slots + slot::descale_d_k, fp8_format::e5m2, stream);
  fp8_dequantize(d_v.data, a.d_v, slots + slot::descale_d_v, fp8_format::e5m2, stream);
}

void sdpa_engine::impl::forward(const sdpa_forward_args& a, const band& bounds) {
  const plan_key key = forward_key(a, bounds, version);
  for (const auto& [name, view] : {std::pair{"q", &a.q}, std::pair{"k", &a.k}, std::pair{"v", &a.v},
                                   std::pair{"out", &a.out}})
    check_pointer(key, name, *view);
  sdpa_plan& plan = plan_for(key);
  void* stats = key.stage_stats ? staged_stats(plan) : a.lse.data;
  std::unordered_map<std::int64_t, void*> pack{
      {uid_q, a.q.data}, {uid_k, a.k.data}, {uid_v, a.v.data}, {uid_o, a.out.data}, {uid_stats, stats}};
  execute(plan, pack);
  if (key.stage_stats) run(copy_heads_args{a.lse, packed_stats_view(stats, a.lse)}, context{.stream = stream});
}

// The frontend keeps its fp32 dQ accumulator and row sums in the plan's workspace, laid out
// as its kernels want them.
void sdpa_engine::impl::backward(const sdpa_backward_args& a, const band& bounds) {
  const plan_key key = backward_key(a, bounds, version);
  for (const auto& [name, view] :
       {std::pair{"q", &a.q}, std::pair{"k", &a.k}, std::pair{"v", &a.v}, std::pair{"out", &a.out},
        std::pair{"d_out", &a.d_out}, std::pair{"d_q", &a.d_q}, std::pair{"d_k", &a.d_k}, std::pair{"d_v", &a.d_v}})
    check_pointer(key, name, *view);
  sdpa_plan& plan = plan_for(key);
  void* stats = a.lse.data;
  if (key.stage_stats) {
    stats = staged_stats(plan);
    run(copy_heads_args{packed_stats_view(stats, a.lse), a.lse}, context{.stream = stream});
  }
  std::unordered_map<std::int64_t, void*> pack{
      {uid_q, a.q.data},     {uid_k, a.k.data},         {uid_v, a.v.data},
      {uid_o, a.out.data},   {uid_d_o, a.d_out.data},   {uid_stats, stats},
      {uid_d_q, a.d_q.data}, {uid_d_k, a.d_k.data},     {uid_d_v, a.d_v.data}};
  execute(plan, pack);
}

sdpa_engine::sdpa_engine(cudaStream_t stream, const scratch_fn& scratch)
    : impl_(std::make_unique<impl>(stream, scratch)) {}

sdpa_engine::~sdpa_engine() = default;

std::size_t sdpa_engine::library_version() { return cudnnGetVersion(); }

void run(const sdpa_forward_args& args, const context& ctx) { ctx.sdpa->forward(args); }

void run(const sdpa_backward_args& args, const context& ctx) { ctx.sdpa->backward(args); }

namespace {

// One set of scales holds for a whole call, so FP8 runs a call as one piece.
template <class Args>
void refuse_fp8_pieces(const Args& a) {
  if (in_pieces(a))
    throw config_error("FP8 attention on the CUDA backend runs each attention call whole, but this one has packed "
                       "documents or a sliding window, which cuDNN runs as pieces; use --attention-dtype bf16 with "
                       "packed documents and sliding-window models");
}

}  // namespace

void sdpa_engine::forward(const sdpa_forward_args& a) {
  if (empty(a.q)) return;
  if (a.arithmetic == attention_dtype::fp8 && a.k.tokens > 0) {
    refuse_fp8_pieces(a);
    impl_->forward_fp8(a);
    return;
  }
  if (a.k.tokens == 0 || (in_pieces(a) && a.mask == attn_mask::none)) {
    // No keys, or rows of a past block that may reach none: out 0 and lse -inf, which
    // lse_merge ignores, then the pieces overwrite their rows.
    zero(a.out, impl_->stream);
    run(fill_heads_args{a.lse, -std::numeric_limits<float>::infinity()}, context{.stream = impl_->stream});
    if (a.k.tokens == 0) return;
  }
  if (!in_pieces(a)) {
    impl_->forward(a, band{});
    return;
  }
  for_each_piece(a, [&](const sdpa_piece& p) {
    const sdpa_forward_args sub = rows_of(a, p);
    if (p.q.count == 1 && p.k.count == 1)
      single_key_attention_forward(sub, impl_->stream);
    else
      impl_->forward(sub, p.bounds);
  });
}

void sdpa_engine::backward(const sdpa_backward_args& a) {
  if (a.arithmetic == attention_dtype::fp8 && !empty(a.q) && a.k.tokens > 0) {
    refuse_fp8_pieces(a);
    impl_->backward_fp8(a);
    return;
  }
  if (empty(a.q) || a.k.tokens == 0 || (in_pieces(a) && a.mask == attn_mask::none)) {
    // Nothing attends, or keys and queries outside every piece: their gradients are zero.
    zero(a.d_q, impl_->stream);
    zero(a.d_k, impl_->stream);
    zero(a.d_v, impl_->stream);
    if (empty(a.q) || a.k.tokens == 0) return;
  }
  if (!in_pieces(a)) {
    impl_->backward(a, band{});
    return;
  }
  // Pieces come in ascending key rows: documents' are disjoint, but a window's query rows
  // split over one band of keys share some, and cuDNN writes d_k and d_v, never adds. A
  // piece whose keys begin below `written` runs into scratch; its rows past `written` are
  // copied, the shared ones added.
  std::int64_t written = 0;
  for_each_piece(a, [&](const sdpa_piece& p) {
    sdpa_backward_args sub = rows_of(a, p);
    sub.d_out = a.d_out.token_block(p.q.first, p.q.count);
    sub.d_q = a.d_q.token_block(p.q.first, p.q.count);
    const head_view d_k = a.d_k.token_block(p.k.first, p.k.count), d_v = a.d_v.token_block(p.k.first, p.k.count);
    const std::int64_t shared = std::clamp<std::int64_t>(written - p.k.first, 0, p.k.count);
    sub.d_k = d_k;
    sub.d_v = d_v;
    if (shared > 0) {
      const auto packed = [&](const head_view& like, std::byte* at) {
        return head_view{at, like.type, like.tokens, like.heads, like.dim, like.heads * like.dim, like.dim};
      };
      const std::size_t bytes = static_cast<std::size_t>(d_k.tokens * d_k.heads * d_k.dim) * dtype_size(d_k.type);
      std::byte* at = impl_->gradients(2 * bytes);
      sub.d_k = packed(d_k, at);
      sub.d_v = packed(d_v, at + bytes);
    }
    if (p.q.count == 1 && p.k.count == 1)
      single_key_attention_backward(sub, impl_->stream);
    else
      impl_->backward(sub, p.bounds);
    if (shared > 0) {
      const context ctx{.stream = impl_->stream};
      for (const auto& [dst, src] : {std::pair{d_k, sub.d_k}, std::pair{d_v, sub.d_v}}) {
        run(add_heads_args{dst.token_block(0, shared), src.token_block(0, shared)}, ctx);
        if (shared < p.k.count)
          run(copy_heads_args{dst.token_block(shared, p.k.count - shared), src.token_block(shared, p.k.count - shared)},
              ctx);
      }
    }
    written = std::max(written, p.k.first + p.k.count);
  });
}

std::string sdpa_engine::fp8_support(std::int64_t head_dim, bool backward) {
  cudnnHandle_t handle = nullptr;
  UPIPE_LIBRARY_CHECK("cuDNN", cudnnCreate(&handle), cudnnGetErrorString);
  const std::int64_t tokens = 256, q_heads = 2, kv_heads = 1;
  const auto packed = [&](std::int64_t heads) {
    return layout_of({nullptr, dtype::u8, tokens, heads, head_dim, heads * head_dim, head_dim});
  };
  plan_key key;
  key.direction = backward ? pass::backward : pass::forward;
  key.mask = attn_mask::causal;
  key.scale_bits = std::bit_cast<std::uint32_t>(1.0f / std::sqrt(static_cast<float>(head_dim)));
  key.arithmetic = attention_dtype::fp8;
  key.q = key.o = packed(q_heads);
  key.k = key.v = packed(kv_heads);
  key.stats = packed_stats(q_heads, tokens);
  if (backward) {
    key.d_o = key.d_q = key.q;
    key.d_k = key.d_v = key.k;
  }
  std::string refusal;
  try {
    build_plan(key, handle);
  } catch (const std::exception& e) {
    refusal = e.what();
  }
  cudnnDestroy(handle);
  return refusal;
}

}  // namespace upipe::cuda
