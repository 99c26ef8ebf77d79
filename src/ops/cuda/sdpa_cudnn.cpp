// Fused attention through cuDNN's graph API, built with NVIDIA's header-only cudnn-frontend:
// one SDPA forward graph (O and the natural-log Stats) and one SDPA backward graph (dQ, dK,
// dV) per shape, built once, cached, and executed with the views' own pointers and strides.
// bf16 operands, fp32 softmax statistics and accumulation.
#include <cudnn.h>

// The frontend defines helpers this file never calls; its warnings are not ours to fix.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include <cudnn_frontend.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>

#include "core/error.hpp"
#include "ops/cuda/cuda_check.hpp"
#include "ops/cuda/cuda_ops.hpp"
#include "ops/sdpa_workspace.hpp"

namespace upipe::cuda {

namespace {

namespace fe = cudnn_frontend;
using tensor_ptr = std::shared_ptr<fe::graph::Tensor_attributes>;

enum class pass : std::uint8_t { forward, backward };

// The caller's tensors carry fixed uids, so a cached plan binds fresh pointers by number.
enum : std::int64_t { uid_q = 1, uid_k, uid_v, uid_o, uid_stats, uid_d_o, uid_d_q, uid_d_k, uid_d_v };

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

// Everything a built plan depends on. Pointers are not part of it: they are bound per call.
// A sliding window's diagonal band on the call's rows (top-left aligned): query row i keeps
// key row j iff i - left < j (left > 0; 0: no left bound) and j <= i + right (right >= 0;
// the causal mask is right 0, an unmasked block's band a right bound past its last key).
struct band {
  std::int64_t left = 0, right = 0;
  bool operator==(const band&) const = default;
};

struct plan_key {
  pass direction = pass::forward;
  attn_mask mask = attn_mask::causal;
  band bounds;                    // mask causal: right 0; mask none: used only when left > 0
  std::uint32_t scale_bits = 0;
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
       ", scale " +
       std::to_string(std::bit_cast<float>(key.scale_bits)) + ")";
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
// only one with a causal mask before cuDNN 9.21; both masks use it, so they share numerics.
void add_forward(fe::graph::Graph& g, const plan_key& key) {
  const auto bf16 = fe::DataType_t::BFLOAT16;
  const tensor_ptr q = input(g, "q", uid_q, key.q, bf16);
  const tensor_ptr k = input(g, "k", uid_k, key.k, bf16);
  const tensor_ptr v = input(g, "v", uid_v, key.v, bf16);
  auto attributes = fe::graph::SDPA_attributes()
                        .set_name("sdpa_forward")
                        .set_generate_stats(true)
                        .set_attn_scale(std::bit_cast<float>(key.scale_bits))
                        .set_implementation(fe::AttentionImplementation_t::COMPOSITE);
  set_band(attributes, key);
  const auto [o, stats] = g.sdpa(q, k, v, attributes);
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
  if (key.direction == pass::forward)
    add_forward(g, key);
  else
    add_backward(g, key);
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
};

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

namespace {

// Packed documents as ordinary calls on row ranges: under the causal mask (queries and
// keys the same rows) each document is a causal call of its own; a block strictly in the
// past (ring) has at most one document that holds queries and keys, the one its first
// query is in, and the later queries see nothing. Each distinct length is a plan of its
// own. fn(q rows, k rows, mask) with rows as [first, count).
struct row_range {
  std::int64_t first = 0, count = 0;
};
template <class Fn>
void for_each_document_call(const document_mask& m, attn_mask mask, std::int64_t sq, std::int64_t skv, Fn&& fn) {
  if (!m.active()) {
    fn(row_range{0, sq}, row_range{0, skv}, mask);
    return;
  }
  if (mask == attn_mask::causal) {
    UPIPE_CHECK(m.q_first == m.k_first && sq == skv, "sdpa: documents under the causal mask need q and k on the same rows");
    std::int64_t row = 0;
    while (row < sq) {
      const std::int64_t g = m.q_first + row;
      const auto next = std::upper_bound(m.starts.begin(), m.starts.end(), g);
      const std::int64_t end = next == m.starts.end() ? sq : std::min(sq, *next - m.q_first);
      fn(row_range{row, end - row}, row_range{row, end - row}, attn_mask::causal);
      row = end;
    }
    return;
  }
  const std::int64_t start = m.start_of(m.q_first), k_last = m.k_first + skv - 1;
  if (start > k_last) return;
  const auto next = std::upper_bound(m.starts.begin(), m.starts.end(), m.q_first);
  const std::int64_t q_end = next == m.starts.end() ? sq : std::min(sq, *next - m.q_first);
  const std::int64_t k_begin = std::max<std::int64_t>(0, start - m.k_first);
  fn(row_range{0, q_end}, row_range{k_begin, skv - k_begin}, attn_mask::none);
}

// One call cuDNN runs: rows of q and k, the mask and, under a window, its band.
struct sdpa_piece {
  row_range q, k;
  attn_mask mask = attn_mask::causal;
  band bounds;
};

// A call's rows under a window W, whose rows start at global indices gq and gk, as the
// pieces cuDNN's band can express (a positive left bound, s_q <= s_kv): causal rows keep the
// band (W, 0) unless W reaches back past their first row; in a block of the past query row
// i sees key rows from i + c on (c = gq - gk - W + 1), so the key rows before c are cut
// (band (1, last key)), or the band starts at 1 - c; query rows that reach no key are left
// out (the caller has zeroed them), and more query rows than keys split.
template <class Fn>
void for_each_window_piece(std::int64_t window, std::int64_t gq, std::int64_t gk, row_range q, row_range k,
                           attn_mask mask, Fn&& fn) {
  if (q.count == 0 || k.count == 0) return;
  if (mask == attn_mask::causal) {
    fn(sdpa_piece{q, k, mask, window > 0 && window < q.count ? band{window, 0} : band{}});
    return;
  }
  const std::int64_t c = gq - gk - window + 1;
  if (window == 0 || c + q.count - 1 <= 0) {  // every query reaches every key
    fn(sdpa_piece{q, k, mask, {}});
    return;
  }
  if (c >= k.count) return;  // no query reaches a key
  const std::int64_t cut = std::max<std::int64_t>(c, 0);
  const row_range keys{k.first + cut, k.count - cut};
  const row_range queries{q.first, std::min(q.count, k.count - c)};
  if (queries.count > keys.count) {  // s_q <= s_kv: split the query rows
    for (std::int64_t i = 0; i < queries.count; i += keys.count) {
      const std::int64_t n = std::min(keys.count, queries.count - i);
      for_each_window_piece(window, gq + i, gk, row_range{q.first + i, n}, k, mask, fn);
    }
    return;
  }
  fn(sdpa_piece{queries, keys, mask, band{1 - (c - cut), keys.count - 1}});
}

// Every piece of a call: its documents' calls, each cut by the window.
template <class Args, class Fn>
void for_each_piece(const Args& a, Fn&& fn) {
  const document_mask& m = a.documents;
  for_each_document_call(m, a.mask, a.q.tokens, a.k.tokens, [&](row_range q, row_range k, attn_mask mask) {
    for_each_window_piece(a.window, m.q_first + q.first, m.k_first + k.first, q, k, mask, fn);
  });
}

// Does the call run as pieces (packed documents or a window), some of whose rows may be
// left out?
template <class Args>
bool in_pieces(const Args& a) {
  return a.documents.active() || a.window > 0;
}

template <class Args>
Args rows_of(const Args& a, const sdpa_piece& p) {
  Args sub = a;
  sub.q = a.q.token_block(p.q.first, p.q.count);
  sub.k = a.k.token_block(p.k.first, p.k.count);
  sub.v = a.v.token_block(p.k.first, p.k.count);
  sub.out = a.out.token_block(p.q.first, p.q.count);
  sub.lse = a.lse.token_block(p.q.first, p.q.count);
  sub.mask = p.mask;
  sub.documents = {};
  sub.window = 0;
  return sub;
}

}  // namespace

void run(const sdpa_forward_args& args, const context& ctx) { ctx.sdpa->forward(args); }

void run(const sdpa_backward_args& args, const context& ctx) { ctx.sdpa->backward(args); }

void sdpa_engine::forward(const sdpa_forward_args& a) {
  if (empty(a.q)) return;
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

}  // namespace upipe::cuda
