// The CP group of a run configuration (--attention, --cp, --head-chunk, --ring,
// --seq-chunks: rows of apps/run_config, their ranges checked where they were read).
#pragma once

#include <string>

#include "apps/run_config.hpp"
#include "cp/strategy_table.hpp"
#include "model/transformer.hpp"

namespace upipe::apps {

inline cp_settings cp_of(const run_config& c) {
  return {parse_strategy_kind(c.attention), c.cp, c.head_chunk, c.ring, c.seq_chunks};
}

// "upipe", "upipe N=4", or "hybrid 2x4" (R x A).
inline std::string mesh_text(const run_config& c) {
  if (row_named(c.attention).mesh && c.ring > 0)
    return c.attention + " " + std::to_string(c.ring) + "x" + std::to_string(c.cp / c.ring);
  return c.seq_chunks > 1 ? c.attention + " N=" + std::to_string(c.seq_chunks) : c.attention;
}

}  // namespace upipe::apps
