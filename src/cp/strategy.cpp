#include "cp/strategy.hpp"

#include "core/error.hpp"
#include "cp/ring.hpp"
#include "cp/staged_all_to_all.hpp"

namespace upipe {

std::vector<position_run> contiguous_positions(std::int64_t seq_len, int cp, int rank) {
  const std::int64_t s = seq_len / cp;
  return {{0, rank * s, s}};
}

std::vector<position_run> zigzag_positions(std::int64_t seq_len, int cp, int rank) {
  const std::int64_t c = seq_len / (2 * cp);
  return {{0, rank * c, c}, {c, (2 * cp - 1 - rank) * c, c}};
}

std::unique_ptr<attention_strategy> make_strategy(attention_config config, backend& be, const cp_groups& groups) {
  validate(config);
  switch (config.strategy) {
    case strategy_kind::ulysses:
    case strategy_kind::upipe:
      UPIPE_CHECK(groups.all_to_all != nullptr, "ulysses and upipe need an all-to-all group");
      return std::make_unique<staged_all_to_all>(config, be, *groups.all_to_all);
    case strategy_kind::ring:
      UPIPE_CHECK(groups.ring != nullptr, "ring needs a ring group");
      return std::make_unique<ring_attention>(config, be, *groups.ring);
  }
  throw internal_error("unknown strategy");
}

}  // namespace upipe
