// The CP flags every model command shares: --attention, --cp, --head-chunk, --ring and
// --seq-chunks.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

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

struct cp_flags {
  std::string attention = "upipe";
  int cp = 1, head_chunk = 0, ring = 1, seq_chunks = 0;

  // Checked before anything sizes a buffer by them.
  cp_settings settings() const {
    if (cp < 1) throw config_error("--cp " + std::to_string(cp) + " must be at least 1 (ranks in the CP group, e.g. --cp 4)");
    if (ring < 1)
      throw config_error("--ring " + std::to_string(ring) + " must be at least 1 (hybrid's ring of all-to-all groups, "
                         "e.g. --ring 2)");
    if (seq_chunks < 0)
      throw config_error("--seq-chunks " + std::to_string(seq_chunks) + " must be at least 1 (sequence chunks, e.g. "
                         "--seq-chunks 4), or 0 for the strategy's default");
    return {parse_strategy_kind(attention), cp, head_chunk, ring, seq_chunks};
  }
  // "upipe", "upipe N=4", or "hybrid 2x4" (R x A).
  std::string describe() const {
    if (row_named(attention).mesh && ring > 0) return attention + " " + std::to_string(ring) + "x" + std::to_string(cp / ring);
    return seq_chunks > 1 ? attention + " N=" + std::to_string(seq_chunks) : attention;
  }
};

inline void add_cp_flags(CLI::App& app, cp_flags& f, const char* cp_help = "ranks in the CP group") {
  app.add_option("--attention", f.attention, "the CP strategy: " + strategy_help())->capture_default_str();
  app.add_option("--cp", f.cp, cp_help)->capture_default_str();
  app.add_option("--head-chunk", f.head_chunk,
                 "U, query heads per stage: upipe (default C), hybrid (a multiple of C / R; default H, Ulysses inside)");
  app.add_option("--ring", f.ring, "hybrid: R, the ring of all-to-all groups (R divides C)")->capture_default_str();
  app.add_option("--seq-chunks", f.seq_chunks,
                 "N sequence chunks for upipe, ulysses and fpdt: the attention holds S / N tokens at a time, earlier "
                 "chunks' K/V in host memory (0: 1, fpdt chunks of 64K tokens)")
      ->capture_default_str();
}

}  // namespace upipe::apps
