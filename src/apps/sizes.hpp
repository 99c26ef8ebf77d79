// Parsing of counts with binary suffixes (128K = 131072, 1M = 1048576) for flags.
#pragma once

#include <climits>
#include <cstdint>
#include <string>
#include <utility>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "core/limits.hpp"
#include "model/checkpoint_store.hpp"
#include "model/parameter_store.hpp"
#include "model/transformer.hpp"

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
    "host pool per rank, GiB: pinned, or pageable with where=host-pageable (0: 16 MiB, or --memory-gib when "
    "checkpoints go to the host)";

// The arenas for a run: `memory_gib` per rank (checked positive); nothing reserved on
// meta, which takes the GPU libraries' workspaces as the cuda backend would so that its
// peak is the GPU's; on the GPU a host pool of `host_gib` when given, else 16 MiB unless
// checkpoints go to the host (then `memory_gib`): only host checkpoints live there, and
// pinned memory is taken (and counted in the process's RSS) at start, so a pool nothing
// uses costs each rank its size; pageable (and only reserved) when checkpoints go to
// pageable host memory.
inline memory_limits run_limits(backend_kind kind, double memory_gib, checkpoint_location checkpoints,
                                double host_gib = 0) {
  if (!(memory_gib > 0 && memory_gib <= limits::max_memory_gib))
    throw config_error("--memory-gib " + real_text(memory_gib) +
                       " must be positive and at most 1048576 (a pebibyte) (for example 8)");
  if (!(host_gib >= 0 && host_gib <= limits::max_memory_gib))
    throw config_error("--host-memory-gib " + real_text(host_gib) +
                       " must lie between 0 (the default) and 1048576 (a pebibyte) (for example 16)");
  if (kind == backend_kind::meta) return {std::size_t{1} << 50, std::size_t{1} << 50, true};
  const auto bytes = [](double gib) { return static_cast<std::size_t>(gib * (1 << 30)); };
  const bool small_host = kind == backend_kind::cuda && checkpoints == checkpoint_location::device;
  memory_limits limits{bytes(memory_gib), host_gib > 0 ? bytes(host_gib)
                                                       : (small_host ? std::size_t{16} << 20 : bytes(memory_gib))};
  limits.host_pageable = kind == backend_kind::cuda && checkpoints == checkpoint_location::host_pageable;
  return limits;
}

// --offload none|optimizer|optimizer,params: what of the sharded training state lives in
// host memory.
inline constexpr const char* offload_help =
    "none; optimizer: the fp32 master weights, AdamW's moments and the gradient shards in host memory (pinned), "
    "AdamW on the host's cores; optimizer,params: the working-dtype weights there too, each unit brought to the GPU "
    "ahead of its use";
inline offload_options parse_offload(const std::string& text) {
  if (text == "none") return {};
  if (text == "optimizer") return {true, false};
  if (text == "optimizer,params" || text == "params,optimizer") return {true, true};
  if (text == "params")
    throw config_error("--offload params: the weights go to host memory only with the optimizer (AdamW writes them "
                       "there); use --offload optimizer,params");
  throw config_error("--offload " + text + " is not known: use none, optimizer or optimizer,params");
}

// --offload: the host pool grows by what the offload holds there for one rank
// (offloaded_bytes, with a margin for the arena's alignment), whatever the rest of the
// pool is for. Under LoRA the optimizer is the adapters' (a micro-batch's gradients fit in
// the margin).
inline memory_limits with_offload(memory_limits limits, const model_config& model, int ranks, backend_kind kind,
                                  zero_stage zero, offload_options offload, std::int64_t micro_batches,
                                  const lora_config& lora = {}) {
  if (!offload.optimizer) return limits;
  const dtype work = kind == backend_kind::cpu ? dtype::f32 : dtype::bf16;
  limits.host_bytes += (lora.enabled() ? lora_offloaded_optimizer_bytes(model, lora, ranks, work)
                                       : offloaded_bytes(model, ranks, work, zero, offload, micro_batches)) +
                       (std::size_t{64} << 20);
  return limits;
}

// Sequence chunks: the host pool grows by what the attention's plan keeps in host memory
// at the longest length (the earlier chunks' K/V and their gradients; and a margin for the
// arena's alignment).
inline memory_limits with_chunked_attention(memory_limits limits, const model_config& model, const cp_settings& cp,
                                            std::int64_t seq_len, backend_kind kind) {
  if (cp.strategy != strategy_kind::fpdt && cp.seq_chunks <= 1) return limits;
  const attention_config c = attention_config_for(model, cp, seq_len);
  if (!c.chunked() || kind == backend_kind::meta) return limits;
  const dtype work = kind == backend_kind::cpu ? dtype::f32 : dtype::bf16;
  limits.host_bytes += make_stage_plan(c, 0).host_peak(work) + (std::size_t{64} << 20);
  return limits;
}

// The MLP tile and loss chunk where `o` gives none, sized for a GPU arena of `memory_gib`
// whatever the backend, so that a meta or cpu run takes the sizes the GPU run would.
inline step_options sized_for_gpu(const step_options& o, const model_config& model, double memory_gib) {
  const memory_limits gpu = run_limits(backend_kind::cuda, memory_gib, checkpoint_location::device);
  return with_default_sizes(o, model, gpu.device_bytes);
}

}  // namespace upipe::apps
