// The attention layer's shape under context parallelism, and its validation.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ops/op_args.hpp"

namespace upipe {

// hybrid: a 2-D mesh of C = R x A ranks, Ulysses or UPipe inside each group of A ranks
// (a node's GPUs) and zigzag ring attention across the R groups (USP).
enum class strategy_kind : std::uint8_t { ulysses, upipe, ring, hybrid };
std::string_view strategy_name(strategy_kind kind);
// Parses "ulysses", "upipe", "ring" or "hybrid"; throws config_error naming the valid values.
strategy_kind parse_strategy_kind(std::string_view name);

// The longest sequence anything here is asked to size or run (the planner searches up to it).
constexpr std::int64_t max_seq_len = std::int64_t{1} << 30;

struct attention_config {
  std::int64_t seq_len = 0;  // S, global tokens
  int heads = 0;             // H, query heads
  int kv_heads = 0;          // K
  int head_dim = 0;          // d
  int model_dim = 0;         // D, width of the layer input
  int cp = 1;                // C, ranks in the CP group
  int head_chunk = 0;        // U, query heads per stage (upipe, hybrid); H for ulysses; unused by ring
  int ring = 1;              // R, hybrid's ring of all-to-all groups (1 for every other strategy)
  strategy_kind strategy = strategy_kind::upipe;
  rope_config rope;
  bool qk_norm = false;     // Qwen3: RMSNorm over d on every q and k head, before RoPE
  float norm_eps = 1e-6f;   // epsilon of that RMSNorm
  // Ulysses/UPipe: a stage's output all-to-all stays in flight while the next stage
  // projects its K/V and Q (holding one more stage buffer meanwhile).
  bool overlap_comm = false;

  std::int64_t local_tokens() const { return seq_len / cp; }  // s
  int group_size() const { return heads / kv_heads; }          // G
  int all_to_all_size() const { return cp / ring; }            // A: the ranks of one all-to-all group
  // The sequence's unit: C for ulysses and upipe, 2C for ring's and hybrid's zigzag halves.
  std::int64_t layout_unit() const {
    return strategy == strategy_kind::ring || strategy == strategy_kind::hybrid ? 2 * std::int64_t{cp} : cp;
  }
};

// Throws config_error naming the offending value, the rule and a valid alternative.
// Fills in head_chunk when it is 0 (C for upipe, H for ulysses).
void validate(attention_config& config);

// The head chunks U that upipe accepts for this shape (C | U, U | H), ascending (for
// hybrid, pass its all-to-all group's A as cp).
std::vector<int> valid_head_chunks(int heads, int cp);

}  // namespace upipe
