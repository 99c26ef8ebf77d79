#include "core/allocator.hpp"

#include "core/error.hpp"

namespace upipe {

arena_allocator::arena_allocator(std::size_t capacity) : capacity_(capacity / granularity * granularity) {
  if (capacity_ > 0) insert_free(0, capacity_);
}

void arena_allocator::insert_free(std::size_t offset, std::size_t size) {
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

void arena_allocator::erase_free(std::map<std::size_t, std::size_t>::iterator it) {
  auto [lo, hi] = free_by_size_.equal_range(it->second);
  for (auto s = lo; s != hi; ++s)
    if (s->second == it->first) {
      free_by_size_.erase(s);
      break;
    }
  free_by_offset_.erase(it);
}

std::optional<std::size_t> arena_allocator::allocate(std::size_t bytes) {
  const std::size_t size = round_up(bytes == 0 ? 1 : bytes);
  // Best fit: the smallest free range that holds the block; ties go to the lowest offset
  // so that the arena packs towards its start.
  auto best = free_by_size_.lower_bound(size);
  if (best == free_by_size_.end()) return std::nullopt;
  std::size_t best_offset = best->second;
  for (auto it = best; it != free_by_size_.end() && it->first == best->first; ++it)
    if (it->second < best_offset) best_offset = it->second;
  auto range = free_by_offset_.find(best_offset);
  const std::size_t range_size = range->second;
  erase_free(range);
  if (range_size > size) insert_free(best_offset + size, range_size - size);
  used_.emplace(best_offset, size);
  in_use_ += size;
  if (best_offset + size > high_water_) high_water_ = best_offset + size;
  return best_offset;
}

void arena_allocator::free(std::size_t offset) {
  auto used = used_.find(offset);
  UPIPE_CHECK(used != used_.end(), "free of an offset the arena never handed out");
  std::size_t start = offset, size = used->second;
  used_.erase(used);
  in_use_ -= size;
  auto next = free_by_offset_.lower_bound(start);
  if (next != free_by_offset_.end() && next->first == start + size) {
    size += next->second;
    auto after = std::next(next);
    erase_free(next);
    next = after;
  }
  if (next != free_by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      erase_free(prev);
    }
  }
  insert_free(start, size);
}

std::size_t arena_allocator::largest_free() const {
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

std::size_t arena_allocator::block_size(std::size_t offset) const {
  auto it = used_.find(offset);
  UPIPE_CHECK(it != used_.end(), "unknown block");
  return it->second;
}

}  // namespace upipe
