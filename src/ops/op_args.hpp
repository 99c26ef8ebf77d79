// Arguments of the ops, shared by the op entries (backend/ops.hpp) and the backends that
// implement them. Views carry dtypes and strides; the entries check them. An op is its
// argument struct: `op` below holds any of them, and a backend runs one with run(op).
#pragma once

#include <cstdint>
#include <span>
#include <variant>
#include <vector>

#include "core/tensor.hpp"

namespace upipe {

enum class transpose : std::uint8_t { none, yes };

// c = alpha * op(a) * op(b) + beta * c. op(a) is m x k, op(b) is k x n, c is m x n.
struct gemm_args {
  mat_view a;
  transpose trans_a = transpose::none;
  mat_view b;
  transpose trans_b = transpose::none;
  mat_view c;
  float alpha = 1.0f;
  float beta = 0.0f;
};

// causal: query i sees keys j <= i (queries and keys cover the same positions);
// none: every query sees every key (a ring block strictly in the past).
enum class attn_mask : std::uint8_t { causal, none };

// Packed documents: a query sees only keys of its own document. Documents are
// contiguous ranges of the sequence, so with the causal order the keys a query sees are
// one range, from its document's start; no S x S mask exists. `starts` are the global
// indices where documents begin (sorted, the first 0; empty: one document), and row 0 of
// q and of k sit at global indices q_first and k_first.
struct document_mask {
  std::span<const std::int64_t> starts;
  std::int64_t q_first = 0, k_first = 0;

  bool active() const { return starts.size() > 1; }
  // The start of the document that holds global index g.
  std::int64_t start_of(std::int64_t g) const;
  // Does any pair of q rows [q_first, q_first + sq) and k rows [k_first, k_first + skv)
  // with the key not after the query share a document, and lie within `window` (0: any
  // distance; see sdpa_forward_args::window)?
  bool shares_document(std::int64_t sq, std::int64_t skv, std::int64_t window = 0) const;
  // The first key row that query row i may see under the documents and the window: the
  // later of its document's start and i's global index - window + 1, as a row of k (at
  // least 0; the caller caps it by the mask's last key).
  std::int64_t first_key(std::int64_t i, std::int64_t window) const;
};

// The arithmetic of attention's two matrix products: bf16, the backend's working dtype
// (the cpu backend's f32), or fp8, per-tensor scaled FP8 with fp32 softmax statistics:
// the inputs quantized to E4M3 (dO to E5M2), exact attention on the dequantized values,
// the outputs quantized as cuDNN's Hopper kernels write them (ops/fp8_attention.hpp).
enum class attention_dtype : std::uint8_t { bf16, fp8 };

// Grouped-query attention: query head h reads kv head h / (q.heads / k.heads).
struct sdpa_forward_args {
  head_view q, k, v;  // (sq, hq, d), (skv, hk, d), (skv, hk, d)
  head_view out;      // (sq, hq, d)
  head_view lse;      // (sq, hq, 1) f32, natural-log log-sum-exp of the scaled scores
  attn_mask mask = attn_mask::causal;
  float scale = 1.0f;
  document_mask documents;
  // Sliding window (0: global attention): a query at global index i sees key j only when
  // i - window < j <= i (window keys, itself included), transformers' sliding-window causal
  // mask. Global indices are documents.q_first + row and documents.k_first + row; it
  // composes with the documents (both must allow a pair).
  std::int64_t window = 0;
  attention_dtype arithmetic = attention_dtype::bf16;
};

struct sdpa_backward_args {
  head_view q, k, v, out, d_out;  // as in forward; out is the final output
  head_view lse;                  // (sq, hq, 1) f32, the final log-sum-exp
  head_view d_q;                  // (sq, hq, d) written
  head_view d_k, d_v;             // (skv, hk, d) written (group partials summed)
  attn_mask mask = attn_mask::causal;
  float scale = 1.0f;
  document_mask documents;
  std::int64_t window = 0;        // as in forward
  attention_dtype arithmetic = attention_dtype::bf16;  // as in forward
};

// How RoPE's frequencies are stretched for a longer context, as Hugging Face's
// rope_type names it: llama3 (frequency bands), linear (positions / factor) or yarn
// (NTK-by-parts bands and an attention factor on cos and sin).
enum class rope_kind : std::uint8_t { none, llama3, linear, yarn };

struct rope_scaling {
  rope_kind kind = rope_kind::none;
  double factor = 8.0;
  double low_freq_factor = 1.0;   // llama3
  double high_freq_factor = 4.0;  // llama3
  std::int64_t original_max_position = 8192;  // llama3, yarn
  double beta_fast = 32.0, beta_slow = 1.0;    // yarn: the band edges in rotations
  double mscale = 0.0, mscale_all_dim = 0.0;   // yarn: DeepSeek's variant of the attention factor (0: unset)
  double attention_factor = 0.0;               // yarn: given explicitly (0: derived from the factor)
  bool truncate = true;                        // yarn: band edges rounded to whole dimensions

  bool enabled() const { return kind != rope_kind::none; }
  bool operator==(const rope_scaling&) const = default;
};

struct rope_config {
  double theta = 500000.0;
  rope_scaling scaling;
  // Partial RoPE (transformers' partial_rotary_factor): only the first rotary_dim dimensions
  // of each head rotate, pairs (i, i + rotary_dim / 2), at the frequencies of a head of
  // rotary_dim; the rest pass unchanged. 0: every dimension.
  int rotary_dim = 0;
  bool operator==(const rope_config&) const = default;
};

// Tokens [token_begin, token_begin + count) of a view sit at global positions
// [position_begin, position_begin + count).
struct position_run {
  std::int64_t token_begin = 0;
  std::int64_t position_begin = 0;
  std::int64_t count = 0;
};

enum class rope_direction : std::uint8_t { forward, inverse };

// Rotate-half RoPE (the Hugging Face Llama convention): dims i and i + d/2 form a pair.
struct rope_args {
  head_view x;  // rotated in place
  std::span<const position_run> positions;
  rope_config config;
  rope_direction direction = rope_direction::forward;
};

// y = x / rms(x) * (weight_offset + weight), per row; rstd (rows x 1, f32) is saved for
// backward. weight_offset is 0 (Llama's convention) or 1 (Gemma's, whose norm weights
// start at 0).
struct rmsnorm_forward_args {
  mat_view x, weight, y, rstd;
  float eps = 1e-5f;
  float weight_offset = 0.0f;
};

// d_x written; d_weight (1 x cols, f32) accumulated, or not computed when it has no rows
// (a frozen weight's). The gradient by the stored weight is the same whatever the offset.
struct rmsnorm_backward_args {
  mat_view x, weight, rstd, d_y, d_x, d_weight;
  float weight_offset = 0.0f;
};

// dst = src elementwise (pack/unpack of the all-to-all layouts, dtype conversion).
struct copy_heads_args {
  head_view dst, src;
};

// dst += src elementwise; dst is f32 or the working dtype.
struct add_heads_args {
  head_view dst, src;
};

struct fill_heads_args {
  head_view dst;
  float value = 0.0f;
};

// Merges a partial attention result into fp32 accumulators (ring attention):
// lse = log(exp(lse) + exp(lse_part)); out = out * exp(old - lse) + part * exp(lse_part - lse).
struct lse_merge_args {
  head_view out, lse;            // f32 accumulators; lse starts at -inf
  head_view out_part, lse_part;  // a block's result
};

// out (n, D) = table rows at ids, times `scale` (Gemma multiplies by sqrt(D) rounded to
// the working dtype); ids (n x 1, i32) live in backend memory.
struct embedding_forward_args {
  mat_view table;  // (V, D)
  mat_view ids;    // (n, 1) i32
  mat_view out;    // (n, D)
  float scale = 1.0f;
};

// d_table (V, D, f32) += scale * d_out rows scattered to their ids (repeated ids add up).
// Rows whose id is padding_id add nothing (nn.Embedding's padding_idx: that row is never
// trained by the lookup); -1: none.
struct embedding_backward_args {
  mat_view d_out;    // (n, D)
  mat_view ids;      // (n, 1) i32
  mat_view d_table;  // (V, D) f32
  float scale = 1.0f;
  std::int32_t padding_id = -1;
};

// The activation of a gated MLP unit, out = act(gate) * up: silu(x) = x / (1 + exp(-x))
// (SwiGLU: Llama, Qwen, Mistral, Phi-3) or GELU's tanh approximation
// gelu(x) = x / 2 (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) (GeGLU: Gemma's
// gelu_pytorch_tanh), or sigmoid (the hybrids' attention output gate: out = sigmoid(gate) * o).
enum class gate_activation : std::uint8_t { silu, gelu_tanh, sigmoid };

// A gated linear unit: out = act(gate) * up. All (n, F).
struct swiglu_forward_args {
  mat_view gate, up, out;
  gate_activation activation = gate_activation::silu;
};

// d_gate and d_up written (they may alias gate and up: each element is read before it
// is written).
struct swiglu_backward_args {
  mat_view gate, up, d_out, d_gate, d_up;
  gate_activation activation = gate_activation::silu;
};

// y (n, m) += bias (1, m), the bias broadcast over the rows (a projection's bias: Qwen2's
// q, k and v). y is f32 or the working dtype, bias the working dtype.
struct bias_add_args {
  mat_view y, bias;
};

// d_bias (1, m, f32) += the column sums of d_y (n, m): a bias's gradient.
struct bias_grad_args {
  mat_view d_y, d_bias;
};

// Fused softmax cross-entropy on one chunk of f32 logits, in place: each row with a
// label >= 0 becomes (softmax - onehot(label)) * grad_scale and its loss
// (logsumexp - logit[label]) goes to row_loss; rows with a negative label (masked) get
// zero gradient and zero loss.
struct cross_entropy_args {
  mat_view logits;    // (n, V) f32, replaced by d_logits
  mat_view labels;    // (n, 1) i32
  mat_view row_loss;  // (n, 1) f32, written
  float grad_scale = 1.0f;
};

// AdamW's state formats (docs/design.md section 5, "Lean optimizer state"). The moments:
// f32; bf16 (each value rounded to nearest even when stored); q8, 8-bit block-wise
// quantized (bitsandbytes' AdamW8bit: a code per element into the dynamic map of
// Dettmers et al., the signed map for exp_avg and the unsigned one for exp_avg_sq, and an
// f32 absmax per block of q8_block elements). The master weights: f32, or bf16 with a
// bf16 compensation carrying what rounding to bf16 lost (Kahan summation), so that the
// working bf16 weights themselves serve as the master.
enum class moment_format : std::uint8_t { f32, bf16, q8 };
enum class master_format : std::uint8_t { f32, bf16_kahan };
struct adamw_state_format {
  moment_format moments = moment_format::f32;
  master_format master = master_format::f32;
  bool operator==(const adamw_state_format&) const = default;
};
inline constexpr std::int64_t q8_block = 256;

// What one AdamW call updates: the whole element (moments and master), or one half of it.
// `moments` updates the moments from the gradient and writes each element's step
// (lr / (1 - b1^t) * m / denom, f32) to `direction`; `master` applies a direction to the
// master weights (the decay, then the step). The halves of one element give the bits of
// the whole, wherever each runs, so the moments and the master may live apart (one on the
// GPU, the other in host memory) with the direction crossing between them.
enum class adamw_part : std::uint8_t { whole, moments, master };

// Consecutive runs of a call's elements and whether weight decay applies to each (a
// parameter's part of a shard: matrices decay, norms do not). A call with q8 moments
// covers whole blocks, which may span parameters, so it says where each run ends.
struct adamw_run {
  std::int64_t end = 0;  // one past the run's last element; runs start where the previous ended
  bool decay = true;
};
inline constexpr std::size_t adamw_max_runs = 32;

// One AdamW step on a flat shard (PyTorch's order, ops/adamw_formula.hpp):
//   g = grad * grad_scale (clipping); m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
//   master = master (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// `weights` is the working-dtype copy that forward reads, written from the updated
// master (bf16-kahan on a bf16 backend: the master is the working copy and weights is
// empty). Every view is (1, n); q8 calls cover whole blocks (n a multiple of q8_block,
// the absmax views (1, n / q8_block)).
struct adamw_args {
  mat_view master;               // f32 or bf16 (bf16-kahan)
  mat_view exp_avg, exp_avg_sq;  // f32, bf16 or u8 (q8), both alike
  mat_view grad;                 // f32 or bf16
  mat_view weights;              // working dtype; may be empty (data nullptr, n 0)
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0, grad_scale = 1;
  std::int64_t step = 1;  // t, from 1, for the bias corrections
  adamw_part part = adamw_part::whole;
  mat_view master_comp;                        // bf16-kahan: the compensation, bf16
  mat_view exp_avg_absmax, exp_avg_sq_absmax;  // q8: f32 per block
  mat_view direction;                          // the halves: f32, written by moments, read by master
  std::span<const adamw_run> runs;             // empty: weight_decay on every element
};

// *result (host memory) = the sum of squares of an f32 matrix, accumulated in fp64
// (gradient norms). The backend has written it when run() returns; meta leaves it.
struct sum_squares_args {
  mat_view x;
  double* result = nullptr;
};

// One op, as its arguments. A backend runs it with one std::visit over overloads of its
// implementations, one per alternative.
// Mixture of experts (docs/design.md section 11). The router's top-k as transformers
// computes it: probs = softmax(logits) in fp32, the k largest per row in descending order
// (ties to the lower expert, as torch.topk), divided by their sum where `normalize`. With
// `given`, `experts` is an input (choices made elsewhere, e.g. by another backend's run):
// the probabilities are this call's, and the weights are this call's probabilities at the
// given experts (renormalized likewise).
struct moe_route_args {
  mat_view logits;   // (n, E) f32
  mat_view probs;    // (n, E) f32, out
  mat_view weights;  // (n, k) f32, out
  mat_view experts;  // (n, k) i32, out (in with `given`)
  bool normalize = false;
  bool given = false;
};
// The routing's backward: d_weights back through the normalization and the top-k's gather,
// plus aux_grad (1, E) on the probabilities of the rows marked in `counted` (a byte a row;
// no rows: every row) (the load-balancing loss's gradient; no rows: none), back through
// the softmax into d_logits (overwritten).
struct moe_route_backward_args {
  mat_view probs;      // (n, E) f32
  mat_view experts;    // (n, k) i32
  mat_view d_weights;  // (n, k) f32
  mat_view aux_grad;   // (1, E) f32, or no rows
  mat_view counted;    // (n, 1) u8, or no rows: every row takes aux_grad
  mat_view d_logits;   // (n, E) f32, out
  bool normalize = false;
};
// The dispatch of a tile's (token, slot) pairs to their experts, on the device: expert e
// keeps at most `capacity` of the tokens that chose it (0: all, dropless), the first in
// token order; the kept rows are laid out expert by expert, each expert's tokens in order,
// expert e's at [offsets[e], offsets[e + 1]). position[t][j] is the row of token t's j-th
// choice, -1 where it was dropped. `scratch` holds per-chunk counts
// (moe_dispatch_scratch_rows(n) rows of E).
struct moe_dispatch_args {
  mat_view experts;   // (n, k) i32, each in [0, E)
  mat_view position;  // (n, k) i32, out
  mat_view offsets;   // (1, E + 1) i32, out
  mat_view scratch;   // (moe_dispatch_scratch_rows(n), E) i32
  std::int64_t capacity = 0;
};
// Tokens per chunk of the dispatch's device scan, and the scratch rows it needs for n tokens.
inline constexpr std::int64_t moe_dispatch_chunk = 256;
inline std::int64_t moe_dispatch_scratch_rows(std::int64_t n) {
  return (n + moe_dispatch_chunk - 1) / moe_dispatch_chunk;
}
// The rows a dispatch lays out at most: n k, or E capacity where that is fewer.
inline std::int64_t moe_dispatch_rows(std::int64_t n, std::int64_t k, std::int64_t experts, std::int64_t capacity) {
  return capacity > 0 && experts * capacity < n * k ? experts * capacity : n * k;
}
// Permute: dst[position[t][j]] = src[t] for every kept (token, slot).
struct moe_permute_args {
  mat_view src;       // (n, D)
  mat_view position;  // (n, k) i32
  mat_view dst;       // (m, D): the rows no position names are left as they are
};
// Combine (unpermute): dst[t] += sum_j weights[t][j] src[position[t][j]] over the kept
// slots (weights no rows: 1), plus sigmoid(shared_gate[t]) shared[t] where a shared expert
// is given (Qwen2-MoE), summed in fp32 and added to dst once.
struct moe_combine_args {
  mat_view src;          // (m, D)
  mat_view position;     // (n, k) i32
  mat_view weights;      // (n, k) f32, or no rows
  mat_view shared;       // (n, D), or no rows
  mat_view shared_gate;  // (n, 1) f32 logits, with shared
  mat_view dst;          // (n, D), accumulated
};
// The weighted combine's backward: d_src[position[t][j]] = weights[t][j] d_dst[t] and
// d_weights[t][j] = src[position[t][j]] . d_dst[t] (0 where the slot was dropped).
struct moe_combine_backward_args {
  mat_view d_dst;      // (n, D)
  mat_view position;   // (n, k) i32
  mat_view weights;    // (n, k) f32
  mat_view src;        // (m, D): the forward's src
  mat_view d_src;      // (m, D), out at the kept rows
  mat_view d_weights;  // (n, k) f32, out
};
// The load-balancing statistics of a tile, accumulated over the rows marked in `counted`
// (no rows: every row): per expert the top-k assignments (exact, u64) and the summed
// probabilities (fp64), in `sums`: 4E i32 words, read as E u64 then E f64.
struct moe_balance_args {
  mat_view probs;    // (n, E) f32
  mat_view experts;  // (n, k) i32
  mat_view counted;  // (n, 1) u8, or no rows
  mat_view sums;     // (1, 4E) i32 words, accumulated
};
// Grouped GEMMs over a dispatched tile: group g is rows [offsets[g], offsets[g + 1]) of
// the row matrices (offsets on the device), and weights[g] its own matrix.
//   rows_by_weight_t: out_g = alpha rows_g weights[g]^T + beta out_g  (an expert's projection)
//   rows_by_weight:   out_g = alpha rows_g weights[g] + beta out_g    (its input gradient)
//   weight_gradient:  weights[g] = alpha rows_g^T other_g + beta weights[g]
// `engine` picks the CUDA library (the cpu and meta backends have one definition each):
// CUTLASS's grouped GEMM reads the groups' sizes on the device; cuBLAS's grouped batched
// GEMM needs them on the host (a download: a comparison point, not the default).
enum class grouped_form : std::uint8_t { rows_by_weight_t, rows_by_weight, weight_gradient };
enum class grouped_engine : std::uint8_t { cutlass, cublas };
struct moe_grouped_gemm_args {
  grouped_form form = grouped_form::rows_by_weight_t;
  mat_view rows;                  // (m, K) the working dtype
  mat_view other;                 // weight_gradient: (m, N) the working dtype
  std::vector<mat_view> weights;  // one per group, of one shape and ld; f32 and out for weight_gradient
  mat_view offsets;               // (1, G + 1) i32
  mat_view out;                   // the row forms: (m, N), working dtype or f32
  float alpha = 1.0f, beta = 0.0f;
  grouped_engine engine = grouped_engine::cutlass;
};
// Qwen2-MoE's shared expert's gate backward (its forward is moe_combine's shared term):
// d_s = sigmoid(z) d_y (written); d_z = sigmoid(z) (1 - sigmoid(z)) (s . d_y) (written).
struct sigmoid_gate_backward_args {
  mat_view z, s, d_y;  // (n, 1) f32, (n, D), (n, D)
  mat_view d_s;        // (n, D), out
  mat_view d_z;        // (n, 1) f32, out
};

// ---------------------------------------------------------------------------------------
// Gated DeltaNet (Qwen3-Next, Qwen3.5): the gated delta rule, its causal conv and its gates,
// as transformers 5.25 defines them (torch_recurrent_gated_delta_rule, causal_conv1d_fn,
// Qwen3NextGatedDeltaNet.forward). docs/design.md "Gated DeltaNet ops" has the math.

// Packed documents of a recurrence over one segment of the sequence: `starts` as in
// document_mask (global indices where documents begin, sorted, the first 0; empty: one
// document), and row 0 of the segment at global index `first`. The state resets to zero at
// every document start inside the segment, row 0 included: what enters row 0 from before
// (an initial state, a conv's halo) is read only where row 0 continues a document (no
// start at `first`; with no starts at all, always).
struct sequence_documents {
  std::span<const std::int64_t> starts;
  std::int64_t first = 0;
};

// q and k L2-normalized over d_k inside the op (transformers' use_qk_l2norm_in_kernel, on
// in both families), x / sqrt(sum x^2 + eps), or taken as they are.
enum class qk_norm : std::uint8_t { none, l2 };

// What every gated-delta-rule op shares. The state is fp32 (its views are f32; nothing
// else is allowed), the chunk size 64 (the chunked algorithm's; nothing else is allowed).
struct gated_delta_options {
  float scale = 0.0f;  // q's scale; 0: d_k^-0.5, transformers' (which no config changes)
  qk_norm norm = qk_norm::l2;
  float l2_eps = 1e-6f;  // transformers' l2norm eps
  std::int64_t chunk_size = 64;
};
inline constexpr std::int64_t gated_delta_chunk = 64;

// The gated delta rule over one segment (docs/design.md): per value head h, with
// q_t, k_t the (normalized) rows of query/key head h / (H_v / H_k) (transformers'
// repeat_interleave) and S the (d_k, d_v) state of transformers' layout,
//   S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale q_t).
// Views of states are stacks of matrices: (H_v, d_k, d_v) as head_view (tokens = matrices,
// heads = rows, dim = columns). `workspace` is f32 device memory for the chunk buffers,
// at least gated_delta_workspace_floats(...) (ops/gated_delta/workspace.hpp) for one chunk
// a pass; a larger one lets a pass hold more chunks. The caller allocates it (the arena,
// so the meta backend counts it) and may free it once the op returns.
struct gated_delta_forward_args {
  head_view q, k;              // (s, H_k, d_k)
  head_view v;                 // (s, H_v, d_v)
  mat_view g, beta;            // (s, H_v) f32: log-decay (<= 0) and beta (sigmoid's, in (0, 1))
  head_view initial_state;     // (H_v, d_k, d_v) f32, or empty (data null): zero
  head_view out;               // (s, H_v, d_v), written
  head_view final_state;       // (H_v, d_k, d_v) f32, written (the state after row s - 1), or empty
  sequence_documents documents;
  gated_delta_options options;
  mat_view workspace;          // (1, n) f32
};

// The gradients of the forward's inputs from d_out and d_final_state; the forward's
// states are recomputed (nothing but its inputs is kept between the two).
struct gated_delta_backward_args {
  head_view q, k, v;           // as in forward
  mat_view g, beta;            // as in forward
  head_view initial_state;     // as in forward (empty: zero)
  head_view d_out;             // (s, H_v, d_v)
  head_view d_final_state;     // (H_v, d_k, d_v) f32, or empty: zero
  head_view d_q, d_k;          // (s, H_k, d_k), written (a key head's value heads summed)
  head_view d_v;               // (s, H_v, d_v), written
  mat_view d_g, d_beta;        // (s, H_v) f32, written
  head_view d_initial_state;   // (H_v, d_k, d_v) f32, written, or empty: not wanted
  sequence_documents documents;
  gated_delta_options options;
  mat_view workspace;          // (1, n) f32
};

// Context parallelism (docs/design.md): a segment's summary. The final state is linear in
// the initial one, final = transition · initial + local_state per head (transition (d_k,
// d_k), applied on the left of transformers' (d_k, d_v) state); local_state is the final
// state from a zero initial state. A document start in the segment (row 0 included) makes
// the transition zero.
struct gated_delta_summary_args {
  head_view q, k, v;           // as in forward
  mat_view g, beta;            // as in forward
  head_view transition;        // (H_v, d_k, d_k) f32, written
  head_view local_state;       // (H_v, d_k, d_v) f32, written
  sequence_documents documents;
  gated_delta_options options;
  mat_view workspace;          // (1, n) f32
};

// The backward's summary: d_initial_state is linear in d_final_state,
// d_initial = transition^T · d_final + local_d_initial, where local_d_initial is the
// gradient by the initial state from d_out alone (a zero d_final_state). It reads neither
// v nor any state. A document start at row 0 makes both zero.
struct gated_delta_summary_backward_args {
  head_view q, k;              // as in forward
  mat_view g, beta;            // as in forward
  head_view d_out;             // (s, H_v, d_v)
  head_view local_d_initial;   // (H_v, d_k, d_v) f32, written
  sequence_documents documents;
  gated_delta_options options;
  mat_view workspace;          // (1, n) f32
};

// Combines the R segments' summaries, in fp32 and in segment order (every rank computes
// the same bits). forward: states[r] is the state entering segment r, from locals = each
// segment's local_state:
//   states[0] = 0; states[r + 1] = transitions[r] states[r] + locals[r].
// backward: states[r] is the d_final_state segment r receives, from locals = each
// segment's local_d_initial:
//   states[R - 1] = 0; states[r] = transitions[r + 1]^T states[r + 1] + locals[r + 1].
// A segment that begins a document has a zero transition and local_d_initial and ignores
// the state it is given, so no flags are needed. Segment r's head h is matrix r * heads + h.
enum class scan_direction : std::uint8_t { forward, backward };
struct gated_delta_scan_args {
  head_view transitions;       // (R * H_v, d_k, d_k) f32
  head_view locals;            // (R * H_v, d_k, d_v) f32
  head_view states;            // (R * H_v, d_k, d_v) f32, written
  std::int64_t heads = 0;      // H_v
  scan_direction direction = scan_direction::forward;
};

// The depthwise causal conv over the mixed q/k/v channels, then SiLU (transformers'
// causal_conv1d_fn with activation "silu"):
//   y[t, c] = silu(sum_j weight[c, j] x[t - (K - 1) + j, c]),
// rows before row 0 read `halo` (the previous K - 1 rows, a neighbour rank's last ones;
// no rows: zero), and a row never reads a row of an earlier document (zero instead; the
// halo is of an earlier document where one starts at row 0).
struct causal_conv_forward_args {
  mat_view x;       // (s, C)
  mat_view halo;    // (K - 1, C), or no rows: zeros
  mat_view weight;  // (C, K): conv1d.weight (C, 1, K) squeezed
  mat_view y;       // (s, C), written
  sequence_documents documents;
};

// d_x and d_halo written (d_halo: the gradient the neighbour's rows receive, to be sent
// back to it; no rows: not wanted); d_weight (C, K) f32 accumulated, or no rows: frozen.
struct causal_conv_backward_args {
  mat_view x, halo, weight;  // as in forward
  mat_view d_y;              // (s, C)
  mat_view d_x;              // (s, C), written
  mat_view d_halo;           // (K - 1, C), written, or no rows
  mat_view d_weight;         // (C, K) f32, accumulated, or no rows
  sequence_documents documents;
};

// The per-head decay and beta of a Gated DeltaNet layer (fp32 math, as transformers'):
//   g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b),
// softplus as torch's (x above 20 taken as it is).
struct gated_delta_gates_forward_args {
  mat_view a, b;             // (s, H_v): in_proj_a's and in_proj_b's outputs
  mat_view a_log, dt_bias;   // (1, H_v)
  mat_view g, beta;          // (s, H_v) f32, written
};

// d_a and d_b written; d_a_log and d_dt_bias (1, H_v) f32 accumulated (summed over rows),
// or no rows: frozen.
struct gated_delta_gates_backward_args {
  mat_view a, b, a_log, dt_bias;  // as in forward
  mat_view d_g, d_beta;           // (s, H_v) f32
  mat_view d_a, d_b;              // (s, H_v), written
  mat_view d_a_log, d_dt_bias;    // (1, H_v) f32, accumulated, or no rows
};

using op = std::variant<gemm_args, sdpa_forward_args, sdpa_backward_args, rope_args, rmsnorm_forward_args,
                        rmsnorm_backward_args, copy_heads_args, add_heads_args, fill_heads_args, lse_merge_args,
                        embedding_forward_args, embedding_backward_args, swiglu_forward_args, swiglu_backward_args,
                        bias_add_args, bias_grad_args, cross_entropy_args, adamw_args, sum_squares_args,
                        moe_route_args, moe_route_backward_args, moe_dispatch_args, moe_permute_args,
                        moe_combine_args, moe_combine_backward_args, moe_balance_args, moe_grouped_gemm_args,
                        sigmoid_gate_backward_args, gated_delta_forward_args, gated_delta_backward_args,
                        gated_delta_summary_args, gated_delta_summary_backward_args, gated_delta_scan_args,
                        causal_conv_forward_args, causal_conv_backward_args, gated_delta_gates_forward_args,
                        gated_delta_gates_backward_args>;

// Does the CUDA implementation of an op hold device memory of its own beside its
// arguments (a library's workspace)? The meta backend must then model that memory: an op
// marked here without a model there does not compile (backend/meta/meta_backend.cpp).
template <class args_type>
inline constexpr bool holds_device_workspace = false;
template <>
inline constexpr bool holds_device_workspace<gemm_args> = true;  // cuBLASLt's, reserved with the backend
template <>
inline constexpr bool holds_device_workspace<sdpa_forward_args> = true;  // cuDNN's, grown per plan
template <>
inline constexpr bool holds_device_workspace<sdpa_backward_args> = true;
template <>
inline constexpr bool holds_device_workspace<moe_grouped_gemm_args> = true;  // the groups' arrays, reserved with the backend

}  // namespace upipe
