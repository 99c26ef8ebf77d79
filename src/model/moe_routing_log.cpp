#include "model/moe_routing_log.hpp"

#include <algorithm>
#include <string>

#include "core/error.hpp"

namespace upipe {

namespace {

std::string describe(const moe_routing_log::key& at) {
  return "rank " + std::to_string(at.rank) + ", layer " + std::to_string(at.layer) + ", the tile at local token " +
         std::to_string(at.first);
}

}  // namespace

moe_routing_log::mode moe_routing_log::how() const {
  const std::lock_guard lock(mutex_);
  return mode_;
}

void moe_routing_log::set_mode(mode m) {
  const std::lock_guard lock(mutex_);
  mode_ = m;
}

void moe_routing_log::put(const key& at, choices c) {
  UPIPE_CHECK(static_cast<std::int64_t>(c.experts.size()) == c.rows * c.k,
              "routing log: " + std::to_string(c.experts.size()) + " choices for " + std::to_string(c.rows) + " x " +
                  std::to_string(c.k));
  const std::lock_guard lock(mutex_);
  tiles_[at] = std::move(c);
}

moe_routing_log::choices moe_routing_log::get(const key& at, std::int64_t rows, std::int64_t k) const {
  const std::lock_guard lock(mutex_);
  const auto it = tiles_.find(at);
  UPIPE_CHECK(it != tiles_.end(), "routing log: no choices recorded for " + describe(at) +
                                      ": replay a run of the same model, strategy, C and --mlp-tile as the recorded one");
  UPIPE_CHECK(it->second.rows == rows && it->second.k == k,
              "routing log: " + describe(at) + " recorded " + std::to_string(it->second.rows) + " x " +
                  std::to_string(it->second.k) + " choices, the replay asks for " + std::to_string(rows) + " x " +
                  std::to_string(k));
  return it->second;
}

std::size_t moe_routing_log::tiles() const {
  const std::lock_guard lock(mutex_);
  return tiles_.size();
}

moe_routing_log::difference moe_routing_log::compare(const moe_routing_log& other) const {
  const std::scoped_lock lock(mutex_, other.mutex_);
  difference d;
  for (const auto& [at, mine] : tiles_) {
    const auto it = other.tiles_.find(at);
    UPIPE_CHECK(it != other.tiles_.end() && it->second.rows == mine.rows && it->second.k == mine.k,
                "routing log: the other log has no tile like " + describe(at));
    for (std::int64_t t = 0; t < mine.rows; ++t) {
      const auto row = [&](const choices& c) {
        std::vector<std::int32_t> r(c.experts.begin() + t * c.k, c.experts.begin() + (t + 1) * c.k);
        std::sort(r.begin(), r.end());
        return r;
      };
      const std::vector<std::int32_t> a = row(mine), b = row(it->second);
      std::int64_t missing = 0;
      for (std::int32_t e : a) missing += std::binary_search(b.begin(), b.end(), e) ? 0 : 1;
      d.rows += 1;
      d.rows_differing += missing > 0 ? 1 : 0;
      d.slots += mine.k;
      d.slots_differing += missing;
    }
  }
  return d;
}

}  // namespace upipe
