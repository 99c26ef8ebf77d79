#include "cp/attention_config.hpp"

#include <sstream>

#include "core/error.hpp"

namespace upipe {

std::string_view strategy_name(strategy_kind kind) {
  switch (kind) {
    case strategy_kind::ulysses: return "ulysses";
    case strategy_kind::upipe: return "upipe";
    case strategy_kind::ring: return "ring";
  }
  return "unknown";
}

strategy_kind parse_strategy_kind(std::string_view name) {
  if (name == "ulysses") return strategy_kind::ulysses;
  if (name == "upipe") return strategy_kind::upipe;
  if (name == "ring") return strategy_kind::ring;
  throw config_error("unknown attention strategy '" + std::string(name) +
                     "': the strategy must be one of ulysses, upipe, ring (for example --strategy upipe)");
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

void validate_heads(const attention_config& c) {
  if (c.heads % c.kv_heads != 0)
    throw config_error("kv heads K = " + std::to_string(c.kv_heads) + " must divide query heads H = " +
                       std::to_string(c.heads) + " (grouped-query attention); for example K = 1 or K = H");
  if (c.head_dim % 2 != 0)
    throw config_error("head dim d = " + std::to_string(c.head_dim) + " must be even (RoPE rotates pairs); for example " +
                       std::to_string(c.head_dim + 1));
  const int alt = suggest_cp(c.heads, c.kv_heads, c.cp);
  if (c.heads % c.cp != 0)
    throw config_error("cp C = " + std::to_string(c.cp) + " must divide query heads H = " + std::to_string(c.heads) +
                       " (each rank computes H/C heads); use C = " + std::to_string(alt));
  if (c.kv_heads % c.cp != 0 && c.cp % c.kv_heads != 0)
    throw config_error("cp C = " + std::to_string(c.cp) + " and kv heads K = " + std::to_string(c.kv_heads) +
                       " are not supported: C must divide K or K must divide C (kv heads are split or replicated "
                       "evenly); use C = " + std::to_string(alt));
}

void validate_sequence(const attention_config& c) {
  const std::int64_t unit = c.strategy == strategy_kind::ring ? 2 * std::int64_t{c.cp} : c.cp;
  if (c.seq_len % unit != 0) {
    const std::int64_t fixed = (c.seq_len / unit + 1) * unit;
    throw config_error("sequence length S = " + std::to_string(c.seq_len) + " must be divisible by " +
                       (c.strategy == strategy_kind::ring ? "2C = " : "C = ") + std::to_string(unit) + " for " +
                       std::string(strategy_name(c.strategy)) + " (equal shards" +
                       (c.strategy == strategy_kind::ring ? ", zigzag halves" : "") + "); use S = " +
                       std::to_string(fixed));
  }
}

void validate_head_chunk(attention_config& c) {
  switch (c.strategy) {
    case strategy_kind::ulysses:
      if (c.head_chunk == 0) c.head_chunk = c.heads;
      if (c.head_chunk != c.heads)
        throw config_error("head chunk U = " + std::to_string(c.head_chunk) +
                           " is not allowed for ulysses, which runs all H = " + std::to_string(c.heads) +
                           " heads in one stage; leave it out, or use --strategy upipe");
      return;
    case strategy_kind::ring:
      if (c.head_chunk != 0)
        throw config_error("head chunk U = " + std::to_string(c.head_chunk) +
                           " is not allowed for ring, which has no head stages; leave it out, or use --strategy upipe");
      return;
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

}  // namespace

void validate(attention_config& c) {
  require_positive(c.seq_len, "sequence length S");
  require_positive(c.heads, "query heads H");
  require_positive(c.kv_heads, "kv heads K");
  require_positive(c.head_dim, "head dim d");
  require_positive(c.model_dim, "model dim D");
  require_positive(c.cp, "cp C");
  if (c.head_chunk < 0) require_positive(c.head_chunk, "head chunk U");
  validate_heads(c);
  validate_sequence(c);
  validate_head_chunk(c);
}

}  // namespace upipe
