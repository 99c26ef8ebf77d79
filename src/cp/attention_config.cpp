#include "cp/attention_config.hpp"

#include <algorithm>
#include <sstream>

#include "core/error.hpp"

namespace upipe {

std::string_view strategy_name(strategy_kind kind) {
  switch (kind) {
    case strategy_kind::ulysses: return "ulysses";
    case strategy_kind::upipe: return "upipe";
    case strategy_kind::ring: return "ring";
    case strategy_kind::hybrid: return "hybrid";
    case strategy_kind::fpdt: return "fpdt";
  }
  return "unknown";
}

strategy_kind parse_strategy_kind(std::string_view name) {
  if (name == "ulysses") return strategy_kind::ulysses;
  if (name == "upipe") return strategy_kind::upipe;
  if (name == "ring") return strategy_kind::ring;
  if (name == "hybrid") return strategy_kind::hybrid;
  if (name == "fpdt") return strategy_kind::fpdt;
  throw config_error("unknown attention strategy '" + std::string(name) +
                     "': the strategy must be one of ulysses, upipe, ring, hybrid, fpdt (for example --attention upipe)");
}

std::vector<row_chunk> sequence_chunks(std::int64_t s, int n) {
  std::vector<row_chunk> chunks;
  std::int64_t first = 0;
  for (int i = 0; i < n; ++i) {
    const std::int64_t count = s / n + (i < s % n ? 1 : 0);
    chunks.push_back({first, count});
    first += count;
  }
  return chunks;
}

std::vector<int> valid_head_chunks(int heads, int cp) {
  std::vector<int> chunks;
  for (int u = cp; cp > 0 && u <= heads; u += cp)
    if (heads % u == 0) chunks.push_back(u);
  return chunks;
}

namespace {

std::string join(const std::vector<int>& values) {
  std::ostringstream out;
  for (std::size_t i = 0; i < values.size(); ++i) out << (i ? ", " : "") << values[i];
  return out.str();
}

void require_positive(std::int64_t value, const char* name) {
  if (value <= 0)
    throw config_error(std::string(name) + " = " + std::to_string(value) +
                       " is invalid: it must be a positive integer (for example 8)");
}

// The largest divisor of `heads` that is at most `cp`, as a suggestion for C.
int suggest_cp(int heads, int kv_heads, int cp) {
  for (int c = cp; c > 1; --c)
    if (heads % c == 0 && (kv_heads % c == 0 || c % kv_heads == 0)) return c;
  return 1;
}

void validate_mesh(const attention_config& c) {
  if (c.strategy != strategy_kind::hybrid) {
    if (c.ring != 1)
      throw config_error("--ring " + std::to_string(c.ring) + " applies to hybrid only (R rings of all-to-all groups); "
                         "leave it out, or use --attention hybrid");
    return;
  }
  if (c.ring < 1 || c.cp % c.ring != 0) {
    int r = 1;
    for (int d = 2; d < c.cp; ++d)
      if (c.cp % d == 0) r = d;
    throw config_error("--ring " + std::to_string(c.ring) + " must divide cp C = " + std::to_string(c.cp) +
                       " (R rings of A = C / R ranks each); for example --ring " + std::to_string(r));
  }
}

void validate_heads(const attention_config& c) {
  if (c.heads % c.kv_heads != 0)
    throw config_error("kv heads K = " + std::to_string(c.kv_heads) + " must divide query heads H = " +
                       std::to_string(c.heads) + " (grouped-query attention); for example K = 1 or K = H");
  if (c.head_dim % 2 != 0)
    throw config_error("head dim d = " + std::to_string(c.head_dim) + " must be even (RoPE rotates pairs); for example " +
                       std::to_string(c.head_dim + 1));
  // The heads split over the all-to-all group: all C ranks, or hybrid's A. Ring splits no
  // heads: every rank attends all of them for its own tokens.
  if (c.strategy == strategy_kind::ring) return;
  const int group = c.all_to_all_size();
  const std::string name = c.strategy == strategy_kind::hybrid ? "the all-to-all group A = C / R = " : "cp C = ";
  const int alt = suggest_cp(c.heads, c.kv_heads, group);
  const std::string letter = c.strategy == strategy_kind::hybrid ? "A" : "C";
  if (c.heads % group != 0)
    throw config_error(name + std::to_string(group) + " must divide query heads H = " + std::to_string(c.heads) +
                       " (each rank computes H/" + letter + " heads); use " + letter + " = " + std::to_string(alt));
  if (c.kv_heads % group != 0 && group % c.kv_heads != 0)
    throw config_error(name + std::to_string(group) + " and kv heads K = " + std::to_string(c.kv_heads) +
                       " are not supported: " + letter + " must divide K or K must divide " + letter +
                       " (kv heads are split or replicated evenly); use " + letter + " = " + std::to_string(alt));
}

void validate_sequence(const attention_config& c) {
  const std::int64_t unit = c.layout_unit();
  const bool zigzag = unit != c.cp;
  if (c.seq_len % unit != 0) {
    const std::int64_t fixed = (c.seq_len / unit + 1) * unit;
    throw config_error("sequence length S = " + std::to_string(c.seq_len) + " must be divisible by " +
                       (zigzag ? "2C = " : "C = ") + std::to_string(unit) + " for " +
                       std::string(strategy_name(c.strategy)) + " (equal shards" + (zigzag ? ", zigzag halves" : "") +
                       "); use S = " + std::to_string(fixed));
  }
}

void validate_head_chunk(attention_config& c) {
  switch (c.strategy) {
    case strategy_kind::ulysses:
    case strategy_kind::fpdt:
      if (c.head_chunk == 0) c.head_chunk = c.heads;
      if (c.head_chunk != c.heads)
        throw config_error("head chunk U = " + std::to_string(c.head_chunk) + " is not allowed for " +
                           std::string(strategy_name(c.strategy)) + ", which runs all H = " + std::to_string(c.heads) +
                           " heads in one stage; leave it out, or use --attention upipe");
      return;
    case strategy_kind::ring:
      if (c.head_chunk != 0)
        throw config_error("head chunk U = " + std::to_string(c.head_chunk) +
                           " is not allowed for ring, which has no head stages; leave it out, or use --attention upipe");
      return;
    case strategy_kind::hybrid: {
      const int A = c.all_to_all_size();
      if (c.head_chunk == 0) c.head_chunk = c.heads;  // USP: Ulysses inside the groups
      if (c.head_chunk <= 0 || c.head_chunk % A != 0 || c.heads % c.head_chunk != 0)
        throw config_error("head chunk U = " + std::to_string(c.head_chunk) + " is invalid for hybrid with H = " +
                           std::to_string(c.heads) + " and all-to-all groups of A = " + std::to_string(A) +
                           ": U must be a multiple of A and divide H; valid: " + join(valid_head_chunks(c.heads, A)));
      return;
    }
    case strategy_kind::upipe:
      if (c.head_chunk == 0) c.head_chunk = c.cp;
      if (c.head_chunk <= 0 || c.head_chunk % c.cp != 0 || c.heads % c.head_chunk != 0)
        throw config_error("head chunk U = " + std::to_string(c.head_chunk) + " is invalid for H = " +
                           std::to_string(c.heads) + ", C = " + std::to_string(c.cp) +
                           ": U must be a multiple of C and divide H; valid: " +
                           join(valid_head_chunks(c.heads, c.cp)));
      return;
  }
}

// Sequence chunks: ulysses, upipe and fpdt (at least 2 for fpdt, whose point they are), at
// most one per local row, and without the overlapped output exchange.
void validate_chunks(attention_config& c) {
  const std::int64_t s = c.local_tokens();
  const bool can_chunk = c.strategy == strategy_kind::ulysses || c.strategy == strategy_kind::upipe ||
                         c.strategy == strategy_kind::fpdt;
  if (c.seq_chunks == 0) {
    const std::int64_t n = (c.seq_len + fpdt_default_chunk_tokens - 1) / fpdt_default_chunk_tokens;
    c.seq_chunks = c.strategy == strategy_kind::fpdt ? static_cast<int>(std::clamp<std::int64_t>(n, 2, std::max<std::int64_t>(s, 2))) : 1;
  }
  if (c.seq_chunks < 1)
    throw config_error("sequence chunks N = " + std::to_string(c.seq_chunks) +
                       " is invalid: it must be a positive integer (for example --seq-chunks 4)");
  if (c.seq_chunks > 1 && !can_chunk)
    throw config_error("sequence chunks N = " + std::to_string(c.seq_chunks) + " apply to ulysses, upipe and fpdt, not " +
                       std::string(strategy_name(c.strategy)) + "; leave --seq-chunks out, or use --attention upipe");
  if (c.strategy == strategy_kind::fpdt && c.seq_chunks < 2)
    throw config_error("fpdt with N = " + std::to_string(c.seq_chunks) + " sequence chunk is Ulysses: give --seq-chunks 2 "
                       "or more, or use --attention ulysses");
  if (c.seq_chunks > s)
    throw config_error("sequence chunks N = " + std::to_string(c.seq_chunks) + " is more than the " + std::to_string(s) +
                       " tokens of a rank's shard (S / C = " + std::to_string(c.seq_len) + " / " + std::to_string(c.cp) +
                       "); use at most --seq-chunks " + std::to_string(std::max<std::int64_t>(s, 1)));
  if (c.seq_chunks > 1 && c.overlap_comm)
    throw config_error("--overlap-comm applies to unchunked stages; leave it out with --seq-chunks " +
                       std::to_string(c.seq_chunks));
}

}  // namespace

void validate(attention_config& c) {
  require_positive(c.seq_len, "sequence length S");
  if (c.seq_len > max_seq_len)
    throw config_error("sequence length S = " + std::to_string(c.seq_len) + " is beyond the longest this engine " +
                       "plans and runs, 2^30 = " + std::to_string(max_seq_len) + " tokens (1024M); use at most --seq-len 1024M");
  require_positive(c.heads, "query heads H");
  require_positive(c.kv_heads, "kv heads K");
  require_positive(c.head_dim, "head dim d");
  require_positive(c.model_dim, "model dim D");
  require_positive(c.cp, "cp C");
  if (c.head_chunk < 0) require_positive(c.head_chunk, "head chunk U");
  validate_mesh(c);
  validate_heads(c);
  validate_sequence(c);
  validate_head_chunk(c);
  validate_chunks(c);
  if (c.input_tile < 0) require_positive(c.input_tile, "attention input tile");
}

}  // namespace upipe
