// The attention layer's shape under context parallelism, and its validation.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ops/op_args.hpp"

namespace upipe {

// hybrid: a 2-D mesh of C = R x A ranks, Ulysses or UPipe inside each group of A ranks
// (a node's GPUs) and zigzag ring attention across the R groups (USP). fpdt: Ulysses over
// N sequence chunks, earlier chunks' K/V in host memory (DeepSpeed's FPDT); upipe with
// seq_chunks > 1 is the same with U heads a stage.
enum class strategy_kind : std::uint8_t { ulysses, upipe, ring, hybrid, fpdt };
std::string_view strategy_name(strategy_kind kind);
// Parses "ulysses", "upipe", "ring", "hybrid" or "fpdt"; throws config_error naming the valid values.
strategy_kind parse_strategy_kind(std::string_view name);

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
  rope_config rope;
  bool qk_norm = false;     // Qwen3: RMSNorm over d on every q and k head, before RoPE
  float norm_eps = 1e-6f;   // epsilon of that RMSNorm
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
  int all_to_all_size() const { return cp / ring; }            // A: the ranks of one all-to-all group
  bool chunked() const { return seq_chunks > 1; }
  bool staged() const { return strategy != strategy_kind::ring; }  // all-to-all stages (and hybrid's)
  // Does the backward norm its input in tiles (a shard longer than input_tile)?
  bool tiled_backward() const { return input_tile > 0 && local_tokens() > input_tile; }
  // The sequence's unit: C for ulysses and upipe, 2C for ring's and hybrid's zigzag halves.
  std::int64_t layout_unit() const {
    return strategy == strategy_kind::ring || strategy == strategy_kind::hybrid ? 2 * std::int64_t{cp} : cp;
  }
};

// Throws config_error naming the offending value, the rule and a valid alternative.
// Fills in head_chunk when it is 0 (C for upipe, H for ulysses and fpdt) and seq_chunks.
void validate(attention_config& config);

// The head chunks U that upipe accepts for this shape (C | U, U | H), ascending (for
// hybrid, pass its all-to-all group's A as cp).
std::vector<int> valid_head_chunks(int heads, int cp);

}  // namespace upipe
