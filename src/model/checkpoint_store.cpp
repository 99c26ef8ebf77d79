#include "model/checkpoint_store.hpp"

#include <climits>

#include "core/error.hpp"
#include "core/key_values.hpp"

namespace upipe {

namespace {

constexpr const char* policy_help =
    "use what=input|input+attention, every=K (K >= 1), where=device|host-pinned|host-pageable, for example "
    "--checkpoint-policy what=input,every=1,where=host-pinned";

}  // namespace

std::string_view content_name(checkpoint_content what) {
  return what == checkpoint_content::layer_input ? "input" : "input+attention";
}

std::string_view location_name(checkpoint_location where) {
  switch (where) {
    case checkpoint_location::device: return "device";
    case checkpoint_location::host_pinned: return "host-pinned";
    case checkpoint_location::host_pageable: return "host-pageable";
  }
  return "unknown";
}

std::string checkpoint_policy::str() const {
  return "what=" + std::string(content_name(what)) + ",every=" + std::to_string(every) +
         ",where=" + std::string(location_name(where));
}

checkpoint_policy parse_checkpoint_policy(std::string_view text) {
  const key_values items(text, "--checkpoint-policy", {{"what"}, {"every"}, {"where"}},
                         "what=input,every=1,where=host-pinned");
  const auto refuse = [&](const char* key) {
    throw config_error("checkpoint policy: '" + std::string(key) + "=" + items.find(key).value_or("") +
                       "' is not understood; " + policy_help);
  };
  checkpoint_policy p;
  if (const auto what = items.find("what")) {
    if (*what == "input") p.what = checkpoint_content::layer_input;
    else if (*what == "input+attention") p.what = checkpoint_content::layer_input_and_attention;
    else refuse("what");
  }
  if (items.has("every")) p.every = static_cast<int>(items.whole_number("every", 1, INT_MAX, "1"));
  if (const auto where = items.find("where")) {
    if (*where == "device") p.where = checkpoint_location::device;
    else if (*where == "host-pinned") p.where = checkpoint_location::host_pinned;
    else if (*where == "host-pageable") p.where = checkpoint_location::host_pageable;
    else refuse("where");
  }
  return p;
}

checkpoint_store::checkpoint_store(backend& be, const checkpoint_policy& policy, int num_layers)
    : be_(be),
      policy_(policy),
      items_(static_cast<std::size_t>(num_layers) * slots),
      prefetched_(items_.size()),
      offloading_(items_.size(), false) {
  UPIPE_CHECK(policy.every >= 1, "checkpoint interval must be >= 1");
}

void checkpoint_store::start_offload(int layer, item which, const tensor& t) {
  if (!on_host()) return;
  const std::size_t i = index(layer, which);
  UPIPE_CHECK(items_[i].empty(), "checkpoint of layer " + std::to_string(layer) + " saved twice");
  items_[i] = be_.allocate(mem_tag::checkpoints_host, t.type(), t.dims(), "checkpoint");
  if (be_.has_data()) be_.copy_bytes_side(items_[i].data(), t.data(), t.bytes(), "checkpoint_out");
  offloading_[i] = true;
}

void checkpoint_store::save(int layer, item which, tensor&& t) {
  const std::size_t i = index(layer, which);
  if (!on_host()) {
    be_.retag(t, mem_tag::checkpoints_device);
    items_[i] = std::move(t);
    return;
  }
  if (!offloading_[i]) start_offload(layer, which, t);
  // The device bytes may be reused by the next op only once the copy has read them.
  be_.join_side_copies();
  offloading_[i] = false;
  t.reset();
}

void checkpoint_store::prefetch(int layer, item which, mem_tag device_tag) {
  if (!on_host()) return;
  const std::size_t i = index(layer, which);
  const tensor& stored = items_[i];
  UPIPE_CHECK(!stored.empty(), "no checkpoint for layer " + std::to_string(layer) + " to prefetch");
  if (!prefetched_[i].empty()) return;
  prefetched_[i] = be_.allocate(device_tag, stored.type(), stored.dims(), "restored");
  if (be_.has_data()) be_.copy_bytes_side(prefetched_[i].data(), stored.data(), stored.bytes(), "checkpoint_in");
}

tensor checkpoint_store::take(int layer, item which, mem_tag device_tag) {
  const std::size_t i = index(layer, which);
  tensor& stored = items_[i];
  UPIPE_CHECK(!stored.empty(), "no checkpoint for layer " + std::to_string(layer));
  if (!on_host()) {
    tensor out = std::move(stored);
    be_.retag(out, device_tag);
    return out;
  }
  if (prefetched_[i].empty()) prefetch(layer, which, device_tag);
  be_.join_side_copies();  // the next op reads the restored bytes
  tensor out = std::move(prefetched_[i]);
  if (out.tag() != device_tag) be_.retag(out, device_tag);
  // Later side copies into this host block run after this one on the same stream.
  stored.reset();
  return out;
}

bool checkpoint_store::has(int layer, item which) const { return !items_[index(layer, which)].empty(); }

}  // namespace upipe
