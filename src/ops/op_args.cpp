#include "ops/op_args.hpp"

#include <algorithm>

namespace upipe {

std::int64_t document_mask::start_of(std::int64_t g) const {
  if (starts.empty()) return 0;
  const auto it = std::upper_bound(starts.begin(), starts.end(), g);
  return it == starts.begin() ? 0 : *(it - 1);
}

bool document_mask::shares_document(std::int64_t sq, std::int64_t skv, std::int64_t window) const {
  if (sq == 0 || skv == 0) return false;
  const std::int64_t q_last = q_first + sq - 1, k_last = k_first + skv - 1;
  // The keys some query of [first, last] sees: from the window's reach of the first query
  // (not before `start`) to the last query itself.
  const auto reaches = [&](std::int64_t start, std::int64_t first, std::int64_t last) {
    const std::int64_t lo = window > 0 ? std::max(start, first - window + 1) : start;
    return std::max(k_first, lo) <= std::min(k_last, last);
  };
  if (!active()) return reaches(k_first, q_first, q_last);
  // Per document holding queries: its queries in range see from the document's start up
  // to the last of them.
  auto it = std::upper_bound(starts.begin(), starts.end(), q_first) - 1;
  for (; it != starts.end() && *it <= q_last; ++it) {
    const std::int64_t doc_end = it + 1 == starts.end() ? q_last + 1 : std::min(*(it + 1), q_last + 1);
    if (reaches(*it, std::max(*it, q_first), doc_end - 1)) return true;
  }
  return false;
}

std::int64_t document_mask::first_key(std::int64_t i, std::int64_t window) const {
  const std::int64_t g = q_first + i;
  std::int64_t first = active() ? start_of(g) : k_first;
  if (window > 0) first = std::max(first, g - window + 1);
  return std::max<std::int64_t>(0, first - k_first);
}

}  // namespace upipe
