#include "ops/gated_delta/recurrent.hpp"

namespace upipe::gated_delta {

std::vector<std::uint8_t> reset_rows(const sequence_documents& documents, std::int64_t rows) {
  std::vector<std::uint8_t> reset(static_cast<std::size_t>(rows), 0);
  for (const std::int64_t start : documents.starts) {
    const std::int64_t r = start - documents.first;
    if (r >= 0 && r < rows) reset[static_cast<std::size_t>(r)] = 1;
  }
  return reset;
}

}  // namespace upipe::gated_delta
