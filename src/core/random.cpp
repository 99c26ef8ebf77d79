#include "core/random.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <thread>
#include <vector>

namespace upipe {

namespace {

// Runs fn(first, last) over [0, n) in one contiguous range per core.
template <typename Fn>
void parallel_ranges(std::size_t n, const Fn& fn) {
  const std::size_t workers = std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1, 64);
  const std::size_t per = std::max<std::size_t>((n + workers - 1) / workers, std::size_t{1} << 16);
  std::vector<std::thread> pool;
  for (std::size_t first = per; first < n; first += per)
    pool.emplace_back([&fn, first, last = std::min(n, first + per)] { fn(first, last); });
  fn(0, std::min(n, per));
  for (auto& t : pool) t.join();
}

// The stream's first word: streams of one seed start far apart.
std::uint64_t stream_base(std::uint64_t seed, std::uint64_t stream) { return mix64(seed ^ mix64(stream)); }

// [0, 1) from the top 53 bits of a word.
double unit(std::uint64_t word) { return static_cast<double>(word >> 11) * 0x1.0p-53; }

}  // namespace

void fill_normal(std::span<float> out, std::uint64_t seed, std::uint64_t stream, float scale) {
  const std::uint64_t base = stream_base(seed, stream);
  parallel_ranges(out.size(), [&](std::size_t first, std::size_t last) {
    for (std::size_t i = first; i < last; ++i) {
      // Two words per element (2i and 2i + 1); 1 - unit is in (0, 1], so the log is finite.
      const double radius = std::sqrt(-2.0 * std::log(1.0 - unit(mix64(base + 2 * i))));
      const double angle = 2.0 * std::numbers::pi * unit(mix64(base + 2 * i + 1));
      out[i] = scale * static_cast<float>(radius * std::cos(angle));
    }
  });
}

void fill_uniform(std::span<float> out, std::uint64_t seed, std::uint64_t stream, float bound) {
  const std::uint64_t base = stream_base(seed, stream);
  parallel_ranges(out.size(), [&](std::size_t first, std::size_t last) {
    for (std::size_t i = first; i < last; ++i)
      out[i] = static_cast<float>(bound * (2.0 * unit(mix64(base + i)) - 1.0));
  });
}

}  // namespace upipe
