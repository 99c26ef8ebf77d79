// The one arena allocator every backend uses. It hands out offsets into a reserved
// range [0, capacity): fixed alignment and size rounding, best fit, coalescing on free.
// The backend maps offsets to addresses (a CPU mapping, a CUDA arena, or nothing on
// meta), so the meta backend's peak and fragmentation are exactly the GPU's.
// Frees are immediate: all users of a block run in one stream order (the compute
// stream), so a later allocation on that stream may reuse it at once.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <unordered_map>

namespace upipe {

class arena_allocator {
 public:
  static constexpr std::size_t granularity = 512;  // alignment and size rounding, bytes

  explicit arena_allocator(std::size_t capacity);

  static std::size_t round_up(std::size_t bytes) {
    return (bytes + granularity - 1) / granularity * granularity;
  }

  // The offset of a block of at least `bytes`, or nothing when no free range fits.
  std::optional<std::size_t> allocate(std::size_t bytes);
  void free(std::size_t offset);

  std::size_t capacity() const { return capacity_; }
  std::size_t in_use() const { return in_use_; }            // rounded bytes
  std::size_t high_water() const { return high_water_; }    // highest end offset ever used
  std::size_t largest_free() const;
  std::size_t block_size(std::size_t offset) const;

 private:
  void insert_free(std::size_t offset, std::size_t size);
  void erase_free(std::map<std::size_t, std::size_t>::iterator it);

  std::size_t capacity_;
  std::size_t in_use_ = 0;
  std::size_t high_water_ = 0;
  std::map<std::size_t, std::size_t> free_by_offset_;        // offset -> size
  std::multimap<std::size_t, std::size_t> free_by_size_;     // size -> offset
  std::unordered_map<std::size_t, std::size_t> used_;        // offset -> size
};

}  // namespace upipe
