// Activation checkpoints between forward and backward (docs/design.md section 5): what is
// kept (the layer input, or also the attention output and log-sum-exp so backward skips
// the attention forward), how often (every k-th layer; the block between is recomputed)
// and where (GPU, pinned host, pageable host memory).
//
// Host locations move through the backend's side copies (on a GPU a copy stream beside
// the compute): start_offload() copies a layer input out while its layer computes and
// save() only joins that copy before the device bytes are freed; prefetch() brings an
// item back early and take() joins it. No copy in the step waits on the host.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.hpp"

namespace upipe {

enum class checkpoint_content : std::uint8_t { layer_input, layer_input_and_attention };
enum class checkpoint_location : std::uint8_t { device, host_pinned, host_pageable };

struct checkpoint_policy {
  checkpoint_content what = checkpoint_content::layer_input;
  int every = 1;  // a checkpoint at every k-th layer (0, k, 2k, ...)
  checkpoint_location where = checkpoint_location::device;

  std::string str() const;
};

// The names the policy text uses ("input", "input+attention"; "device", "host-pinned",
// "host-pageable").
std::string_view content_name(checkpoint_content what);
std::string_view location_name(checkpoint_location where);

// Parses "what=input|input+attention,every=K,where=device|host-pinned|host-pageable"
// (any subset, comma-separated; the rest keeps its default). Throws config_error naming
// the bad part and the valid values.
checkpoint_policy parse_checkpoint_policy(std::string_view text);

class checkpoint_store {
 public:
  checkpoint_store(backend& be, const checkpoint_policy& policy, int num_layers);

  const checkpoint_policy& policy() const { return policy_; }
  // Does layer `layer` start a recompute block (its input is checkpointed)?
  bool starts_block(int layer) const { return layer % policy_.every == 0; }
  // Is this layer's input kept? Every block's first layer's but layer 0's: its input is
  // the embedding of the token ids, looked up again in backward rather than stored.
  bool keeps_input(int layer) const { return layer > 0 && starts_block(layer); }
  bool keeps_attention(int layer) const {
    return starts_block(layer) && policy_.what == checkpoint_content::layer_input_and_attention;
  }
  // The first layer of the block that holds `layer`.
  int block_start(int layer) const { return layer - layer % policy_.every; }

  // Items of a layer's checkpoint.
  enum class item : std::uint8_t { input, attention_out, attention_lse };

  // Takes `t` (a device tensor) as layer `layer`'s item: on the device it is kept as it
  // is (retagged checkpoints_device); for host locations it is copied out and freed.
  void save(int layer, item which, tensor&& t);
  // Starts copying `t` to its host slot now (host locations only; a no-op on the device),
  // so that the copy overlaps the work issued next; save() of the same item finishes it.
  void start_offload(int layer, item which, const tensor& t);
  // Starts bringing a host item back into device memory under `device_tag` (a no-op on
  // the device); take() of the same item finishes it.
  void prefetch(int layer, item which, mem_tag device_tag);
  // The item back in device memory under `device_tag`; the store lets go of it.
  tensor take(int layer, item which, mem_tag device_tag);
  bool has(int layer, item which) const;
 private:
  static constexpr int slots = 3;
  std::size_t index(int layer, item which) const {
    return static_cast<std::size_t>(layer) * slots + static_cast<std::size_t>(which);
  }

  bool on_host() const { return policy_.where != checkpoint_location::device; }

  backend& be_;
  checkpoint_policy policy_;
  std::vector<tensor> items_;
  std::vector<tensor> prefetched_;  // device copies of host items, in flight or done
  std::vector<bool> offloading_;    // the item's copy to the host was started early
};

}  // namespace upipe
