// A buffer's address `offset` bytes in, where a null buffer (a rank that sends or receives
// nothing, or the meta backend's) stays null.
#pragma once

#include <cstddef>

namespace upipe {

inline std::byte* at(void* base, std::size_t offset) {
  return base == nullptr ? nullptr : static_cast<std::byte*>(base) + offset;
}
inline const std::byte* at(const void* base, std::size_t offset) {
  return base == nullptr ? nullptr : static_cast<const std::byte*>(base) + offset;
}

}  // namespace upipe
