#include "cp/strategy_table.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "cp/ring.hpp"
#include "cp/stage_plan_builders.hpp"
#include "cp/staged_all_to_all.hpp"

namespace upipe {

namespace {

std::unique_ptr<attention_strategy> make_staged(const attention_config& config, backend& be, const cp_groups& groups) {
  UPIPE_CHECK(groups.all_to_all != nullptr, std::string(strategy_name(config.strategy)) + " needs an all-to-all group");
  return std::make_unique<staged_all_to_all>(config, be, *groups.all_to_all);
}

std::unique_ptr<attention_strategy> make_ring(const attention_config& config, backend& be, const cp_groups& groups) {
  UPIPE_CHECK(groups.ring != nullptr, "ring needs a ring group");
  return std::make_unique<ring_attention>(config, be, *groups.ring);
}

// The CP group splits into the mesh: all-to-all inside each group of A, a ring of R.
std::unique_ptr<attention_strategy> make_mesh(const attention_config& config, backend& be, const cp_groups& groups) {
  UPIPE_CHECK(groups.all_to_all != nullptr && groups.all_to_all->size() == config.cp,
              "hybrid needs the whole CP group to split");
  communicator& world = *groups.all_to_all;
  return std::make_unique<staged_all_to_all>(config, be, split_mesh(world, be, config.ring), world.rank());
}

constexpr strategy_row rows[] = {
    {strategy_kind::ulysses, "ulysses", "all heads in one all-to-all stage", sequence_layout::contiguous,
     head_stages::all, head_chunk_default::all_heads, sequence_chunking::optional, false, true, make_staged,
     plan_building::plan_staged},
    {strategy_kind::upipe, "upipe", "U query heads a stage, the buffers reused", sequence_layout::contiguous,
     head_stages::chosen, head_chunk_default::group, sequence_chunking::optional, false, true, make_staged,
     plan_building::plan_staged},
    {strategy_kind::ring, "ring", "zigzag ring attention, K/V exchanged between ranks", sequence_layout::zigzag,
     head_stages::none, head_chunk_default::group, sequence_chunking::none, false, true, make_ring,
     plan_building::plan_ring},
    {strategy_kind::hybrid, "hybrid", "ulysses or upipe inside groups of C / R ranks, a ring of R groups",
     sequence_layout::zigzag, head_stages::chosen, head_chunk_default::all_heads, sequence_chunking::none, true,
     false, make_mesh, plan_building::plan_staged},
    {strategy_kind::fpdt, "fpdt", "ulysses over sequence chunks, earlier chunks' K/V in host memory",
     sequence_layout::contiguous, head_stages::all, head_chunk_default::all_heads, sequence_chunking::required, false,
     true, make_staged, plan_building::plan_staged},
};

}  // namespace

std::span<const strategy_row> strategy_rows() { return rows; }

const strategy_row& row_of(strategy_kind kind) {
  for (const strategy_row& r : rows)
    if (r.kind == kind) return r;
  throw internal_error("a strategy kind without a row in the strategy table");
}

std::string strategy_names() {
  std::string out;
  for (const strategy_row& r : rows) out += (out.empty() ? "" : ", ") + std::string(r.name);
  return out;
}

const strategy_row& row_named(std::string_view name) {
  for (const strategy_row& r : rows)
    if (r.name == name) return r;
  throw config_error("unknown attention strategy '" + std::string(name) + "': the strategy must be one of " +
                     strategy_names() + " (for example --attention upipe)");
}

std::string strategy_help() {
  std::string out;
  for (const strategy_row& r : rows)
    out += (out.empty() ? "" : "; ") + std::string(r.name) + " (" + std::string(r.summary) + ")";
  return out;
}

std::vector<int> head_chunk_choices(const strategy_row& row, int heads, int group) {
  switch (row.heads) {
    case head_stages::none: return {0};
    case head_stages::all: return {heads};
    case head_stages::chosen: return valid_head_chunks(heads, group);
  }
  return {};
}

}  // namespace upipe
