#include "model/checkpoint_store.hpp"

#include <charconv>

#include "core/error.hpp"

namespace upipe {

namespace {

constexpr const char* policy_help =
    "use what=input|input+attention, every=K (K >= 1), where=device|host-pinned|host-pageable, for example "
    "--checkpoint-policy what=input,every=1,where=host-pinned";

void parse_part(checkpoint_policy& p, std::string_view part) {
  const auto eq = part.find('=');
  const std::string_view key = part.substr(0, eq), value = eq == part.npos ? "" : part.substr(eq + 1);
  if (key == "what" && value == "input") {
    p.what = checkpoint_content::layer_input;
  } else if (key == "what" && value == "input+attention") {
    p.what = checkpoint_content::layer_input_and_attention;
  } else if (key == "every" && !value.empty()) {
    int k = 0;
    auto [end, err] = std::from_chars(value.data(), value.data() + value.size(), k);
    if (err != std::errc() || end != value.data() + value.size() || k < 1)
      throw config_error("checkpoint policy: every=" + std::string(value) + " must be an integer >= 1; " + policy_help);
    p.every = k;
  } else if (key == "where" && (value == "device" || value == "host-pinned" || value == "host-pageable")) {
    p.where = value == "device"        ? checkpoint_location::device
              : value == "host-pinned" ? checkpoint_location::host_pinned
                                       : checkpoint_location::host_pageable;
  } else {
    throw config_error("checkpoint policy: '" + std::string(part) + "' is not understood; " + policy_help);
  }
}

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
  checkpoint_policy p;
  while (!text.empty()) {
    const auto comma = text.find(',');
    parse_part(p, text.substr(0, comma));
    text = comma == text.npos ? "" : text.substr(comma + 1);
  }
  return p;
}

checkpoint_store::checkpoint_store(backend& be, const checkpoint_policy& policy, int num_layers)
    : be_(be), policy_(policy), items_(static_cast<std::size_t>(num_layers) * slots) {
  UPIPE_CHECK(policy.every >= 1, "checkpoint interval must be >= 1");
}

void checkpoint_store::save(int layer, item which, tensor&& t) {
  tensor& slot = items_[index(layer, which)];
  if (policy_.where == checkpoint_location::device) {
    be_.retag(t, mem_tag::checkpoints_device);
    slot = std::move(t);
    return;
  }
  slot = be_.allocate(mem_tag::checkpoints_host, t.type(), t.dims(), "checkpoint");
  if (be_.has_data()) be_.copy_bytes(slot.data(), t.data(), t.bytes());
  t.reset();
}

tensor checkpoint_store::take(int layer, item which, mem_tag device_tag) {
  tensor& stored = items_[index(layer, which)];
  UPIPE_CHECK(!stored.empty(), "no checkpoint for layer " + std::to_string(layer));
  if (policy_.where == checkpoint_location::device) {
    tensor out = std::move(stored);
    be_.retag(out, device_tag);
    return out;
  }
  tensor out = be_.allocate(device_tag, stored.type(), stored.dims(), "restored");
  if (be_.has_data()) be_.copy_bytes(out.data(), stored.data(), stored.bytes());
  stored.reset();
  return out;
}

bool checkpoint_store::has(int layer, item which) const { return !items_[index(layer, which)].empty(); }

}  // namespace upipe
