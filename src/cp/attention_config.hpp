// The attention layer's shape under context parallelism, and its validation.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ops/op_args.hpp"

namespace upipe {

// The CP strategies; what each is (its layout, which of U, N and R it takes, its executor
// and stage plan) is its row in cp/strategy_table.hpp. hybrid: a 2-D mesh of C = R x A
// ranks, Ulysses or UPipe inside each group of A ranks (a node's GPUs) and zigzag ring
// attention across the R groups (USP). fpdt: Ulysses over N sequence chunks, earlier
// chunks' K/V in host memory (DeepSpeed's FPDT); upipe with seq_chunks > 1 is the same
// with U heads a stage.
enum class strategy_kind : std::uint8_t { ulysses, upipe, ring, hybrid, fpdt };
std::string_view strategy_name(strategy_kind kind);
// Parses a row's name; throws config_error naming the valid values.
strategy_kind parse_strategy_kind(std::string_view name);

// --attention-dtype: "bf16" or "fp8"; parse throws config_error naming the valid values.
std::string_view attention_dtype_name(attention_dtype arithmetic);
attention_dtype parse_attention_dtype(std::string_view name);

// The longest sequence anything here is asked to size or run (the planner searches up to it).
constexpr std::int64_t max_seq_len = std::int64_t{1} << 30;

// FPDT's chunk when --seq-chunks is left out: 64K tokens of the sequence (DeepSpeed's default).
constexpr std::int64_t fpdt_default_chunk_tokens = 65536;

// Rows [first, first + count) of a rank's shard: one sequence chunk.
struct row_chunk {
  std::int64_t first = 0, count = 0;
};
// A shard of s rows in N chunks, the first s mod N one row longer.
std::vector<row_chunk> sequence_chunks(std::int64_t s, int n);

struct attention_config {
  std::int64_t seq_len = 0;  // S, global tokens
  int heads = 0;             // H, query heads
  int kv_heads = 0;          // K
  int head_dim = 0;          // d
  int model_dim = 0;         // D, width of the layer input
  int cp = 1;                // C, ranks in the CP group
  int head_chunk = 0;        // U, query heads per stage (upipe, hybrid); H for ulysses; unused by ring
  int ring = 1;              // R, hybrid's ring of all-to-all groups (1 for every other strategy)
  // N, sequence chunks (fpdt; upipe and ulysses too): chunk i of every rank forms the
  // sequence's i-th part, attended chunk by chunk with the earlier chunks' K/V in host
  // memory. 0: 1, or for fpdt chunks of fpdt_default_chunk_tokens (at least 2).
  int seq_chunks = 0;
  strategy_kind strategy = strategy_kind::upipe;
  // W, a sliding window (0: global attention): a token at global position i attends to the
  // keys j with i - W < j <= i (W keys, itself included), as transformers' sliding-window
  // causal mask; with packed documents both must allow a pair.
  std::int64_t window = 0;
  // The arithmetic of every attention call's matrix products (--attention-dtype): bf16
  // (the working dtype) or fp8 (ops/fp8_attention.hpp); the merges of partial results
  // (ring blocks, sequence chunks) stay fp32 log-sum-exp arithmetic either way.
  attention_dtype arithmetic = attention_dtype::bf16;
  rope_config rope;
  bool qk_norm = false;     // Qwen3, Gemma 3: RMSNorm over d on every q and k head, before RoPE
  float norm_eps = 1e-6f;   // epsilon of that RMSNorm
  float norm_offset = 0.0f;  // that RMSNorm scales by (norm_offset + weight): Gemma 3's 1
  // The softmax scale of the scores: 0 for 1/sqrt(d); Gemma 3 gives 1/sqrt(query_pre_attn_scalar).
  double score_scale = 0.0;
  // Ulysses/UPipe: a stage's output all-to-all stays in flight while the next stage
  // projects its K/V and Q (holding one more stage buffer meanwhile).
  bool overlap_comm = false;
  // Backward only: the attention's input is normed this many rows at a time where the
  // projections read it (normed_input::of_tiles), when the shard is longer (0: whole).
  std::int64_t input_tile = 0;
  // Projections that train nothing (LoRA: a frozen weight without an adapter): their
  // backward makes no weight gradient, so it norms no input tiles for one.
  bool frozen_q = false, frozen_k = false, frozen_v = false;

  std::int64_t local_tokens() const { return seq_len / cp; }  // s
  float softmax_scale() const {
    return static_cast<float>(score_scale > 0 ? score_scale : 1.0 / std::sqrt(static_cast<double>(head_dim)));
  }
  // The q/k norm's epsilon and offset (cp/head_norm.hpp).
  struct head_norm_params {
    float eps = 1e-6f, weight_offset = 0.0f;
  };
  head_norm_params head_norm() const { return {norm_eps, norm_offset}; }
  int all_to_all_size() const { return cp / ring; }            // A: the ranks of one all-to-all group
  bool chunked() const { return seq_chunks > 1; }
  // Does the window limit any query (W > 0 and shorter than the sequence)?
  bool windowed() const { return window > 0 && window < seq_len; }
  bool staged() const;  // all-to-all stages (the row has head stages)
  bool meshed() const;  // a ring of all-to-all groups (hybrid)
  // Does the backward norm its input in tiles (a shard longer than input_tile)?
  bool tiled_backward() const { return input_tile > 0 && local_tokens() > input_tile; }
  // The sequence's unit: C for contiguous shards (ulysses, upipe), 2C for zigzag halves
  // (ring, hybrid).
  std::int64_t layout_unit() const;
};

// The (query, key) pairs causal attention scores over S tokens: S^2 / 2 (the model-FLOPs
// convention of docs/design.md section 7), or under a window W < S, S W - W (W - 1) / 2
// (each query sees at most W keys).
double attention_pairs(std::int64_t seq_len, std::int64_t window);

// Throws config_error naming the offending value, the rule and a valid alternative.
// Fills in head_chunk when it is 0 (C for upipe, H for ulysses and fpdt) and seq_chunks.
void validate(attention_config& config);

// The head chunks U that upipe accepts for this shape (C | U, U | H), ascending (for
// hybrid, pass its all-to-all group's A as cp).
std::vector<int> valid_head_chunks(int heads, int cp);

}  // namespace upipe
