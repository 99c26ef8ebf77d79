// The CP strategies, one row each: what a strategy is to the flags, the validation, the
// stage plans, the planner, the benchmarks and the tests, which iterate this table as the
// op harness iterates the op registry (docs/design.md section 4, "A strategy is a row").
// A new strategy is its kind, a row here, its executor and its plan builder.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cp/attention_config.hpp"

namespace upipe {

class attention_strategy;
class backend;
struct cp_groups;
struct stage_plan;

// How the sequence lies on the C ranks: contiguous shards (the layout's unit is C) or ring
// attention's zigzag halves, rank r holding halves r and 2C - 1 - r (unit 2C).
enum class sequence_layout : std::uint8_t { contiguous, zigzag };

// U, the query heads of a stage: none (no head stages: every rank attends every head of
// its own tokens), all (U = H, one stage), or chosen (a multiple of the all-to-all group's
// A that divides H).
enum class head_stages : std::uint8_t { none, all, chosen };
// U when the configuration leaves it 0 (head_stages::chosen): the group's A (the smallest
// working set) or all H (Ulysses inside the groups).
enum class head_chunk_default : std::uint8_t { group, all_heads };

// N, the sequence chunks (earlier chunks' K/V in host memory): none, optional (default 1),
// or required (at least 2; default chunks of fpdt_default_chunk_tokens).
enum class sequence_chunking : std::uint8_t { none, optional, required };

struct strategy_row {
  strategy_kind kind;
  std::string_view name;
  std::string_view summary;  // a clause for --attention's help
  sequence_layout layout;
  head_stages heads;
  head_chunk_default head_default;
  sequence_chunking chunks;  // host memory: with N > 1 the stage's K/V (and their gradients) live there
  bool mesh;                 // R: a ring of all-to-all groups (hybrid); else R = 1
  bool planned_by_default;   // in `upipe plan`'s default set
  // The executor of a validated configuration.
  std::unique_ptr<attention_strategy> (*make)(const attention_config& config, backend& be, const cp_groups& groups);
  // Fills a plan's stages and passes (its config, rank and chunks already set).
  void (*plan)(stage_plan& p);
};

// Every strategy, in the order the flags list them.
std::span<const strategy_row> strategy_rows();
const strategy_row& row_of(strategy_kind kind);
// The row named `name`; throws config_error naming the valid names.
const strategy_row& row_named(std::string_view name);
// "ulysses, upipe, ring, hybrid, fpdt".
std::string strategy_names();
// --attention's help: every row's name and summary.
std::string strategy_help();

// The head chunks U a row runs for H heads over an all-to-all group of A ranks: {0} for a
// row without head stages, {H} for all heads, else every valid U (valid_head_chunks).
std::vector<int> head_chunk_choices(const strategy_row& row, int heads, int group);

}  // namespace upipe
