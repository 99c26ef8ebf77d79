// A sparse layer's expert choices taken from elsewhere (docs/design.md section 11): one
// run records each tile's choices, keyed by rank, layer and the tile's first token, and
// another run (another backend, the same layout) replays them in its dispatch, its routing
// weights computed from its own probabilities at those choices. The GPU's family test
// routes the GPU run with the cpu run's choices, so that a near tie that bf16 breaks the
// other way moves no gradient; comparing two recorded runs counts how often they differ.
// Ranks on threads share one log (its methods lock).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace upipe {

class moe_routing_log {
 public:
  enum class mode : std::uint8_t { record, replay };
  struct key {
    int rank = 0, layer = 0;
    std::int64_t first = 0;  // the tile's first local token
    auto operator<=>(const key&) const = default;
  };
  // A tile's choices: n rows of k experts, row-major.
  struct choices {
    std::int64_t rows = 0, k = 0;
    std::vector<std::int32_t> experts;
  };

  explicit moe_routing_log(mode m = mode::record) : mode_(m) {}
  mode how() const;
  void set_mode(mode m);
  // Recording: a tile's choices (a recomputation records the same again).
  void put(const key& at, choices c);
  // Replaying: the tile's recorded choices; throws when none were recorded for it or their
  // shape is not (rows, k), naming the tile.
  choices get(const key& at, std::int64_t rows, std::int64_t k) const;
  std::size_t tiles() const;

  // Two logs of the same tiles: the (token, layer) rows whose sets of experts differ, and
  // the chosen (token, layer, slot) pairs that the other log did not choose.
  struct difference {
    std::int64_t rows = 0, rows_differing = 0;
    std::int64_t slots = 0, slots_differing = 0;
  };
  difference compare(const moe_routing_log& other) const;

 private:
  mutable std::mutex mutex_;
  mode mode_;
  std::map<key, choices> tiles_;
};

}  // namespace upipe
