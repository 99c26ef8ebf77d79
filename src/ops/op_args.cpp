#include "ops/op_args.hpp"

#include <algorithm>

namespace upipe {

std::int64_t document_mask::start_of(std::int64_t g) const {
  if (starts.empty()) return 0;
  const auto it = std::upper_bound(starts.begin(), starts.end(), g);
  return it == starts.begin() ? 0 : *(it - 1);
}

bool document_mask::shares_document(std::int64_t sq, std::int64_t skv) const {
  if (sq == 0 || skv == 0) return false;
  const std::int64_t q_last = q_first + sq - 1, k_last = k_first + skv - 1;
  if (!active()) return k_first <= q_last;
  // Per document holding queries: its last query in range sees the most keys, from the
  // document's start up to itself.
  auto it = std::upper_bound(starts.begin(), starts.end(), q_first) - 1;
  for (; it != starts.end() && *it <= q_last; ++it) {
    const std::int64_t doc_end = it + 1 == starts.end() ? q_last + 1 : std::min(*(it + 1), q_last + 1);
    if (std::max(k_first, *it) <= std::min(k_last, doc_end - 1)) return true;
  }
  return false;
}

}  // namespace upipe
