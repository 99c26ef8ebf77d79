// Parsing of counts with binary suffixes (128K = 131072, 1M = 1048576), sizes and --offload
// for flags; the step's sizes themselves are resolved in train/step_sizes.hpp.
#pragma once

#include <climits>
#include <cstdint>
#include <string>
#include <utility>

#include "core/error.hpp"
#include "core/limits.hpp"
#include "model/parameter_store.hpp"
#include "train/step_sizes.hpp"

namespace upipe::apps {

// Throws config_error naming the flag, the value and an example.
inline std::int64_t parse_count(const std::string& text, const char* flag) {
  std::size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::int64_t unit = 1;
  const std::string suffix = used == 0 ? text : text.substr(used);
  if (suffix == "K" || suffix == "k") unit = 1024;
  else if (suffix == "M" || suffix == "m") unit = 1024 * 1024;
  else if (!suffix.empty() || used == 0)
    throw config_error(std::string(flag) + " '" + text + "' is not a count: use an integer, optionally with K or M "
                       "(for example 4096, 128K or 1M)");
  if (value > INT64_MAX / unit || value < INT64_MIN / unit)
    throw config_error(std::string(flag) + " '" + text + "' is too large to count (for example 4096, 128K or 1M)");
  return value * unit;
}

// A sequence length: a count no longer than the engine runs (checked before anything is
// sized by it); 0 only where `allow_zero` (a length that turns something off).
inline std::int64_t parse_seq_len(const std::string& text, const char* flag = "--seq-len", bool allow_zero = false) {
  const std::int64_t s = parse_count(text, flag);
  if (s < (allow_zero ? 0 : 1))
    throw config_error(std::string(flag) + " " + text + " must be " + (allow_zero ? "0 or more" : "at least 1") +
                       " tokens (for example 4096, 128K or 1M)");
  if (s > max_seq_len)
    throw config_error(std::string(flag) + " " + text + " is beyond the longest this engine plans and runs, 2^30 = " +
                       std::to_string(max_seq_len) + " tokens (1024M); use at most 1024M");
  return s;
}

// The length of sequences whose next-token predictions are scored (a loss, an evaluation):
// at least 2, since one token predicts nothing and a loss over no targets means nothing.
inline std::int64_t parse_scored_seq_len(const std::string& text, const char* flag = "--seq-len") {
  const std::int64_t s = parse_seq_len(text, flag);
  if (s < 2)
    throw config_error(std::string(flag) + " " + text + " must be at least 2 tokens: a loss needs a token to predict "
                       "from the one before it (for example 4096)");
  return s;
}

// A count that sizes a loop or a group (a head chunk): a whole number in [1, 2^31 - 1],
// never truncated into an int (4294967300 would otherwise run as 4).
inline int parse_int_count(const std::string& text, const char* flag) {
  const std::int64_t v = parse_count(text, flag);
  if (v < 1 || v > INT_MAX)
    throw config_error(std::string(flag) + " " + text + " must lie between 1 and 2147483647 (for example 4)");
  return static_cast<int>(v);
}

// Bytes with a unit: 80GiB, 1.9TiB, 512MiB (binary) or 80GB (decimal); a bare number
// is bytes. Throws config_error naming the flag, the value and an example.
inline std::size_t parse_bytes(const std::string& text, const char* flag) {
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = used == 0 ? text : text.substr(used);
  const std::pair<const char*, double> units[] = {
      {"", 1.0},           {"B", 1.0},           {"KiB", 0x1p10},      {"MiB", 0x1p20}, {"GiB", 0x1p30},
      {"TiB", 0x1p40},     {"KB", 1e3},          {"MB", 1e6},          {"GB", 1e9},     {"TB", 1e12}};
  for (const auto& [name, scale] : units)
    if (used > 0 && unit == name && value > 0) {
      if (!(value * scale <= 0x1p60))
        throw config_error(std::string(flag) + " '" + text + "' is beyond 2^60 bytes (an exbibyte), more than any "
                           "machine holds; for example 80GiB");
      return static_cast<std::size_t>(value * scale);
    }
  throw config_error(std::string(flag) + " '" + text + "' is not a positive size: use a number with KiB, MiB, GiB or "
                     "TiB (or KB, MB, GB, TB), for example 80GiB or 1.9TiB");
}

inline constexpr const char* mlp_tile_help =
    "tokens per MLP/RMSNorm tile (0: up to 8192, its buffers at most 1/64 of the GPU memory, 256 at least)";
inline constexpr const char* loss_chunk_help =
    "tokens per cross-entropy chunk (0: f32 logits of up to 2 GiB, at most 1/64 of the GPU memory)";

inline constexpr const char* host_memory_gib_help =
    "everything the process may hold in host memory, GiB (a node's ranks in one process: the node's budget): the "
    "ranks' pools (pinned, or pageable with where=host-pageable) with the offloaded state, the mapped weight files, "
    "the sequences and the process's own; each pool is what remains, checked against the machine before anything "
    "is pinned (0: pools of 16 MiB, or --memory-gib when checkpoints go to the host, plus the offload)";

// --offload none|optimizer|master[,params]: what of the sharded training state lives in
// host memory.
inline constexpr const char* offload_help =
    "none; optimizer: the master weights, AdamW's moments and the gradient shards in host memory (pinned), AdamW "
    "on the host's cores; master: the master weights alone (the moments on the GPU, which sends each step to the "
    "host); ,params (optimizer,params or master,params): the working-dtype weights there too, each unit brought to "
    "the GPU ahead of its use";
inline offload_options parse_offload(const std::string& text) {
  if (text == "none") return {};
  if (text == "optimizer") return {true, false};
  if (text == "optimizer,params" || text == "params,optimizer") return {true, true};
  if (text == "master") return {false, false, true};
  if (text == "master,params" || text == "params,master") return {false, true, true};
  if (text == "params")
    throw config_error("--offload params: the weights go to host memory only with the master weights (AdamW writes "
                       "them there); use --offload optimizer,params or master,params");
  throw config_error("--offload " + text + " is not known: use none, optimizer, optimizer,params, master or "
                     "master,params");
}

}  // namespace upipe::apps
