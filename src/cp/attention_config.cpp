#include "cp/attention_config.hpp"

#include <algorithm>
#include <sstream>

#include "core/error.hpp"
#include "cp/strategy_table.hpp"

namespace upipe {

std::string_view strategy_name(strategy_kind kind) { return row_of(kind).name; }

strategy_kind parse_strategy_kind(std::string_view name) { return row_named(name).kind; }

std::string_view attention_dtype_name(attention_dtype arithmetic) {
  return arithmetic == attention_dtype::fp8 ? "fp8" : "bf16";
}

attention_dtype parse_attention_dtype(std::string_view name) {
  if (name == "bf16") return attention_dtype::bf16;
  if (name == "fp8") return attention_dtype::fp8;
  throw config_error("--attention-dtype '" + std::string(name) +
                     "' is not an attention arithmetic; use bf16 (the working dtype) or fp8 (cuDNN's FP8 attention)");
}

bool attention_config::staged() const { return row_of(strategy).heads != head_stages::none; }

bool attention_config::meshed() const { return row_of(strategy).mesh; }

std::int64_t attention_config::layout_unit() const {
  return row_of(strategy).layout == sequence_layout::zigzag ? 2 * std::int64_t{cp} : cp;
}

double attention_pairs(std::int64_t seq_len, std::int64_t window) {
  const double S = static_cast<double>(seq_len), W = static_cast<double>(window);
  return window > 0 && window < seq_len ? S * W - W * (W - 1) / 2 : S * S / 2;
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

// The names of the rows that `has`, "a, b and c".
template <class Pred>
std::string rows_that(Pred has) {
  std::vector<std::string_view> names;
  for (const strategy_row& r : strategy_rows())
    if (has(r)) names.push_back(r.name);
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i)
    out += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + std::string(names[i]);
  return out;
}

void require_positive(std::int64_t value, const char* name) {
  if (value <= 0)
    throw config_error(std::string(name) + " = " + std::to_string(value) +
                       " is invalid: it must be a positive integer (for example 8)");
}

// Every group size that splits the heads evenly (it divides H, and K or K divides it), up
// to H: the valid alternatives a refusal names.
std::string valid_group_sizes(int heads, int kv_heads) {
  std::string out;
  for (int c = 1; c <= heads; ++c)
    if (heads % c == 0 && (kv_heads % c == 0 || c % kv_heads == 0)) out += (out.empty() ? "" : ", ") + std::to_string(c);
  return out;
}

void validate_mesh(const attention_config& c) {
  if (!c.meshed()) {
    if (c.ring != 1)
      throw config_error("--ring " + std::to_string(c.ring) + " applies to " +
                         rows_that([](const strategy_row& r) { return r.mesh; }) +
                         " only (R rings of all-to-all groups); leave it out, or use --attention hybrid");
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
  // The heads split over the all-to-all group: all C ranks, or a mesh's A. A strategy
  // without head stages (ring) splits none: every rank attends all of them for its tokens.
  if (!c.staged()) return;
  const int group = c.all_to_all_size();
  const std::string name = c.meshed() ? "the all-to-all group A = C / R = " : "cp C = ";
  const std::string letter = c.meshed() ? "A" : "C";
  const std::string valid = "; valid " + letter + " for H = " + std::to_string(c.heads) + ", K = " +
                            std::to_string(c.kv_heads) + ": " + valid_group_sizes(c.heads, c.kv_heads) +
                            ", or ring attention, which runs any C";
  if (c.heads % group != 0)
    throw config_error(name + std::to_string(group) + " must divide query heads H = " + std::to_string(c.heads) +
                       " (each rank computes H/" + letter + " heads)" + valid);
  if (c.kv_heads % group != 0 && group % c.kv_heads != 0)
    throw config_error(name + std::to_string(group) + " and kv heads K = " + std::to_string(c.kv_heads) +
                       " are not supported: " + letter + " must divide K or K must divide " + letter +
                       " (kv heads are split or replicated evenly)" + valid);
}

void validate_sequence(const attention_config& c) {
  const std::int64_t unit = c.layout_unit();
  const bool zigzag = row_of(c.strategy).layout == sequence_layout::zigzag;
  if (c.seq_len % unit != 0) {
    const std::int64_t fixed = (c.seq_len / unit + 1) * unit;
    throw config_error("sequence length S = " + std::to_string(c.seq_len) + " must be divisible by " +
                       (zigzag ? "2C = " : "C = ") + std::to_string(unit) + " for " +
                       std::string(strategy_name(c.strategy)) + " (equal shards" + (zigzag ? ", zigzag halves" : "") +
                       "); use S = " + std::to_string(fixed));
  }
}

void validate_head_chunk(attention_config& c) {
  const strategy_row& row = row_of(c.strategy);
  const std::string name(row.name);
  switch (row.heads) {
    case head_stages::none:
      if (c.head_chunk != 0)
        throw config_error("head chunk U = " + std::to_string(c.head_chunk) + " is not allowed for " + name +
                           ", which has no head stages; leave it out, or use --attention upipe");
      return;
    case head_stages::all:
      if (c.head_chunk == 0) c.head_chunk = c.heads;
      if (c.head_chunk != c.heads)
        throw config_error("head chunk U = " + std::to_string(c.head_chunk) + " is not allowed for " + name +
                           ", which runs all H = " + std::to_string(c.heads) +
                           " heads in one stage; leave it out, or use --attention upipe");
      return;
    case head_stages::chosen: {
      const int A = c.all_to_all_size();
      if (c.head_chunk == 0) c.head_chunk = row.head_default == head_chunk_default::group ? A : c.heads;
      if (c.head_chunk <= 0 || c.head_chunk % A != 0 || c.heads % c.head_chunk != 0) {
        const std::string letter = c.meshed() ? "A" : "C";
        throw config_error("head chunk U = " + std::to_string(c.head_chunk) + " is invalid for " +
                           (c.meshed() ? name + " with " : std::string()) + "H = " + std::to_string(c.heads) +
                           (c.meshed() ? " and all-to-all groups of A = " : ", C = ") + std::to_string(A) +
                           ": U must be a multiple of " + letter + " and divide H; valid: " +
                           join(valid_head_chunks(c.heads, A)));
      }
      return;
    }
  }
}

// Sequence chunks where the row takes them (at least 2 where it requires them), at most
// one per local row, and without the overlapped output exchange.
void validate_chunks(attention_config& c) {
  const strategy_row& row = row_of(c.strategy);
  const std::int64_t s = c.local_tokens();
  if (c.seq_chunks == 0) {
    const std::int64_t n = (c.seq_len + fpdt_default_chunk_tokens - 1) / fpdt_default_chunk_tokens;
    c.seq_chunks = row.chunks == sequence_chunking::required
                       ? static_cast<int>(std::clamp<std::int64_t>(n, 2, std::max<std::int64_t>(s, 2)))
                       : 1;
  }
  if (c.seq_chunks < 1)
    throw config_error("sequence chunks N = " + std::to_string(c.seq_chunks) +
                       " is invalid: it must be a positive integer (for example --seq-chunks 4)");
  if (c.seq_chunks > 1 && row.chunks == sequence_chunking::none)
    throw config_error("sequence chunks N = " + std::to_string(c.seq_chunks) + " apply to " +
                       rows_that([](const strategy_row& r) { return r.chunks != sequence_chunking::none; }) +
                       ", not " + std::string(row.name) + "; leave --seq-chunks out, or use --attention upipe");
  if (row.chunks == sequence_chunking::required && c.seq_chunks < 2)
    throw config_error(std::string(row.name) + " with N = " + std::to_string(c.seq_chunks) +
                       " sequence chunk is Ulysses: give --seq-chunks 2 or more, or use --attention ulysses");
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
  if (c.window < 0)
    throw config_error("sliding window W = " + std::to_string(c.window) + " is invalid: it must be 0 (global "
                       "attention) or the number of keys a token attends to (for example --window 4096)");
  validate_mesh(c);
  validate_heads(c);
  validate_sequence(c);
  validate_head_chunk(c);
  validate_chunks(c);
  if (c.input_tile < 0) require_positive(c.input_tile, "attention input tile");
}

}  // namespace upipe
