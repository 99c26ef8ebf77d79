#include "train/run_memory.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <numeric>

#include "comm/launch.hpp"
#include "comm/nccl.hpp"
#include "core/error.hpp"
#include "core/machine.hpp"
#include "model/hf_model.hpp"
#include "train/run_directory.hpp"
#include "train/step_sizes.hpp"

namespace upipe {

namespace fs = std::filesystem;

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

std::size_t sum(const std::vector<memory_part>& parts) {
  return std::accumulate(parts.begin(), parts.end(), std::size_t{0},
                         [](std::size_t total, const memory_part& p) { return total + p.bytes; });
}

// The bytes of a file, or of the files under a directory (`weights_only`: its
// .safetensors, the weights a model directory maps; else everything, recursively).
std::size_t bytes_under(const std::string& path, bool weights_only) {
  std::error_code ec;
  if (path.empty()) return 0;
  if (fs::is_regular_file(path, ec)) return static_cast<std::size_t>(fs::file_size(path, ec));
  if (!fs::is_directory(path, ec)) return 0;
  std::size_t total = 0;
  const auto add = [&](const fs::directory_entry& e) {
    if (!e.is_regular_file(ec)) return;
    if (weights_only && e.path().extension() != ".safetensors") return;
    total += static_cast<std::size_t>(e.file_size(ec));
  };
  if (weights_only) {
    for (const fs::directory_entry& e : fs::directory_iterator(path, ec)) add(e);
  } else {
    for (const fs::directory_entry& e : fs::recursive_directory_iterator(path, ec)) add(e);
  }
  return total;
}

// The checkpoint a --resume names (a run directory's latest), or "" where it names none
// that can be read: train's own checks name that later.
std::string resumed_checkpoint(const std::string& path) {
  if (path.empty()) return "";
  try {
    return resolve_checkpoint(path);
  } catch (const std::exception&) {
    return "";
  }
}

std::string offload_words(const offload_options& o) {
  const std::string what = o.optimizer ? "master weights, AdamW's moments and gradient shards" : "master weights";
  return "the offloaded " + what + (o.params ? " and working weights" : "");
}

// "the host pools' part for checkpoints (pinned)": how the CUDA backend takes it.
std::string pool_words(const train_options& o) {
  return std::string("the host pools' room for checkpoints and staging (") +
         (o.limits.host_pageable ? "pageable" : "pinned at start") + ")";
}

}  // namespace

std::string gib_text(std::size_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(bytes) / (1 << 30));
  return text;
}

std::size_t run_memory::host_bytes() const { return sum(host); }
std::size_t run_memory::gpu_bytes() const { return sum(gpu); }

std::size_t process_host_bytes(backend_kind kind) {
  return kind == backend_kind::cpu ? 256 * mib : 4096 * mib;
}

int process_ranks(const train_options& o) {
  const std::optional<launch_env> env = launcher_environment();
  return env && env->size > 1 ? 1 : o.dp * o.cp.cp;
}

std::vector<memory_part> host_beside_pools(const train_options& o) {
  std::vector<memory_part> parts;
  const bool lora = o.step.lora.enabled();
  const std::string resumed = resumed_checkpoint(o.resume_dir);
  if (!resumed.empty())
    parts.push_back({"the resumed checkpoint's files, mapped (" + resumed + ")", bytes_under(resumed, false)});
  if (resumed.empty() || lora) {  // a LoRA run's frozen base is never in its checkpoint
    const std::string path = !o.init_path.empty() ? o.init_path : o.model_dir;
    const std::size_t files = bytes_under(path, true);
    if (files > 0)
      parts.push_back({"the weight files, mapped for the run (" + path + ")", files});
    else
      parts.push_back({"the random first weights' f32 host copy",
                       static_cast<std::size_t>(o.model.parameter_count()) * sizeof(float)});
  }
  if (lora)
    parts.push_back({"the adapters' f32 host copy",
                     static_cast<std::size_t>(lora_parameter_count(o.model, o.step.lora)) * sizeof(float)});
  parts.push_back({"the step's sequences (tokens, ids, labels)",
                   static_cast<std::size_t>(o.batch) * static_cast<std::size_t>(o.seq_len) * 24});
  parts.push_back({"the process's own (code, libraries, the CUDA context's host side)", process_host_bytes(o.backend)});
  return parts;
}

run_memory run_memory_of(const train_options& o, int ranks_run) {
  run_memory m;
  m.host = host_beside_pools(o);
  const std::size_t ranks = static_cast<std::size_t>(ranks_run > 0 ? ranks_run : process_ranks(o));
  const pool_parts parts = pool_parts_of(sizes_of(o, 1, 0));
  if (parts.offload > 0) m.host.push_back({offload_words(offload_of(o)), parts.offload * ranks});
  if (parts.chunks > 0) m.host.push_back({"the sequence chunks' K/V and gradients", parts.chunks * ranks});
  if (o.backend == backend_kind::cuda) {
    const std::size_t held = parts.offload + parts.chunks;
    m.host.push_back({pool_words(o), (o.limits.host_bytes > held ? o.limits.host_bytes - held : 0) * ranks});
    // A GPU each where every rank can have one (NCCL), else every rank on GPU 0.
    const int size = o.dp * o.cp.cp;
    const std::size_t on_gpu = ranks > 1 && (o.comm.kind == comm_kind::threads || visible_gpus() < size) ? ranks : 1;
    m.gpu.push_back({"the arena (--memory-gib) of " + std::to_string(on_gpu) + " rank(s)", o.limits.device_bytes * on_gpu});
    m.gpu.push_back({"the CUDA context and libraries", cuda_context_bytes});
  }
  // A budget the run was given is what it may take: counted whole where the parts fall short
  // (the whole group's, so not where rank 0 alone runs).
  const auto budget = static_cast<std::size_t>(o.host_memory_gib * (1 << 30));
  if (ranks == static_cast<std::size_t>(process_ranks(o)) && budget > m.host_bytes())
    m.host.push_back({"the rest of --host-memory-gib (the run may take it)", budget - m.host_bytes()});
  return m;
}

std::size_t run_host_bytes(const train_options& o, std::size_t pool_high_water) {
  const std::size_t ranks = static_cast<std::size_t>(process_ranks(o));
  const std::size_t pool = o.backend == backend_kind::cuda ? o.limits.host_bytes : pool_high_water;
  return sum(host_beside_pools(o)) + pool * ranks;
}

namespace {

std::string parts_text(const std::vector<memory_part>& parts) {
  std::string text;
  for (const memory_part& p : parts)
    if (p.bytes > 0) text += (text.empty() ? "" : "; ") + p.what + " " + gib_text(p.bytes);
  return text;
}

}  // namespace

void require_run_memory(const run_memory& need, backend_kind kind) {
  if (kind == backend_kind::meta) return;
  const host_offer offer = available_host_memory();
  const auto usable = static_cast<std::size_t>(static_cast<double>(offer.bytes) * (1 - host_margin_fraction));
  if (offer.bytes > 0 && need.host_bytes() > usable)
    throw out_of_memory_error(
        "this run needs " + gib_text(need.host_bytes()) + " of host memory and the machine offers " +
        gib_text(usable) + " (" + offer.source + " " + gib_text(offer.bytes) + " less " +
        std::to_string(static_cast<int>(host_margin_fraction * 100)) + "% kept for the system): " +
        parts_text(need.host) + ". Ways out: a smaller --host-memory-gib (everything the run may hold in host "
        "memory; the pools get what remains), --offload with less on the host, a shorter --seq-len, --lora, "
        "or the command `upipe plan --host-memory " + gib_text(usable).substr(0, gib_text(usable).size() - 4) +
        "GiB` prints for this machine");
  if (need.gpu.empty()) return;
  const std::optional<launch_env> env = launcher_environment();
  const std::size_t free = gpu_free_bytes(env && env->size > 1 ? env->local_rank : 0);
  if (free > 0 && need.gpu_bytes() > free)
    throw out_of_memory_error("this run needs " + gib_text(need.gpu_bytes()) + " of GPU memory and the GPU has " +
                              gib_text(free) + " free: " + parts_text(need.gpu) +
                              ". Ways out: a smaller --memory-gib, --offload, a shorter --seq-len, --lora, or the "
                              "command `upipe plan` prints for this GPU");
}

}  // namespace upipe
