// The CP group of a run configuration (--attention, --cp, --head-chunk, --ring,
// --seq-chunks: rows of apps/run_config, their ranges checked where they were read).
#pragma once

#include <string>

#include "apps/run_config.hpp"
#include "apps/sizes.hpp"
#include "core/error.hpp"
#include "cp/strategy_table.hpp"
#include "model/transformer.hpp"

namespace upipe::apps {

// "auto" or U: --head-chunk's text as cp_settings holds it (0 for auto or the strategy's
// default, which auto then replaces).
inline bool is_auto_head_chunk(const std::string& text) { return text == "auto"; }
inline int head_chunk_of(const std::string& text) {
  if (is_auto_head_chunk(text) || text == "0") return 0;  // "0": earlier runs' stored default
  try {
    return parse_int_count(text, "--head-chunk");
  } catch (const config_error& e) {
    throw config_error(std::string(e.what()) + "; or auto, the largest U whose step fits");
  }
}

inline cp_settings cp_of(const run_config& c) {
  return {parse_strategy_kind(c.attention), c.cp, head_chunk_of(c.head_chunk), c.ring, c.seq_chunks};
}

// "upipe", "upipe N=4", or "hybrid 2x4" (R x A).
inline std::string mesh_text(const run_config& c) {
  if (row_named(c.attention).mesh && c.ring > 0)
    return c.attention + " " + std::to_string(c.ring) + "x" + std::to_string(c.cp / c.ring);
  return c.seq_chunks > 1 ? c.attention + " N=" + std::to_string(c.seq_chunks) : c.attention;
}

}  // namespace upipe::apps
