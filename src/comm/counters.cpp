// Byte counters of the communicators and the names of the collectives.
#include <stdexcept>

#include "comm/communicator.hpp"
#include "core/error.hpp"

namespace upipe {

std::string_view collective_name(collective c) {
  switch (c) {
    case collective::all_to_all: return "all_to_all";
    case collective::all_reduce: return "all_reduce";
    case collective::reduce_scatter: return "reduce_scatter";
    case collective::all_gather: return "all_gather";
    case collective::send: return "send";
    case collective::recv: return "recv";
    case collective::barrier: return "barrier";
    case collective::all_to_all_v: return "all_to_all_v";
    case collective::count: break;
  }
  return "unknown";
}

void comm_counters::add(collective c, std::uint64_t n, std::string_view label) {
  const auto i = static_cast<std::size_t>(c);
  UPIPE_CHECK(i < collective_count, "collective::count is not a collective");
  bytes[i] += n;
  calls[i] += 1;
  // Labels count bytes put on the wire, so received bytes have no label row; nor has an
  // unlabelled call (a barrier).
  if (label.empty() || c == collective::recv) return;
  auto it = bytes_by_label.find(label);
  if (it == bytes_by_label.end()) it = bytes_by_label.emplace(std::string(label), 0).first;
  it->second += n;
}

std::uint64_t comm_counters::label_bytes(std::string_view label) const {
  const auto it = bytes_by_label.find(label);
  return it == bytes_by_label.end() ? 0 : it->second;
}

}  // namespace upipe
