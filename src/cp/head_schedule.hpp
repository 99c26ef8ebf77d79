// Which query heads each rank computes at each stage, and when each kv head becomes
// resident and is released (docs/design.md section 4). Pure arithmetic, no data.
#pragma once

#include <span>
#include <vector>

namespace upipe {

// A run of consecutive head indices [first, first + count) that sits at
// [slot, slot + count) of some ordered list: the unit of one gemm or one strided copy.
struct head_run {
  int first = 0;
  int slot = 0;
  int count = 0;
};
std::vector<head_run> consecutive_runs(std::span<const int> heads);

// The kv heads that become resident on a rank at one stage, received together in one
// all-to-all and released together after `last_stage`.
struct kv_block {
  std::vector<int> kv_heads;
  int first_stage = 0;
  int last_stage = 0;
  bool spans_stages() const { return last_stage > first_stage; }
};

class head_schedule {
 public:
  // H query heads, K kv heads, C ranks, U query heads per stage (C | U, U | H, and
  // C | K or K | C; validated by the caller).
  head_schedule(int heads, int kv_heads, int cp, int head_chunk);

  int stages() const { return stages_; }
  int heads_per_stage() const { return per_rank_; }  // u = U / C
  int kv_of(int query_head) const { return query_head / group_; }

  // L_r: the H/C query heads rank r computes, in schedule order.
  std::span<const int> owned(int rank) const { return owned_[rank]; }
  // L_r[t*u, (t+1)*u).
  std::span<const int> stage_heads(int rank, int stage) const {
    return std::span<const int>(owned_[rank]).subspan(static_cast<std::size_t>(stage) * per_rank_, per_rank_);
  }
  // kv blocks of rank r in order of arrival.
  std::span<const kv_block> blocks(int rank) const { return blocks_[rank]; }
  // The block of rank r that arrives at `stage`, or nullptr.
  const kv_block* arriving(int rank, int stage) const;
  // Kv heads that arrive per rank at `stage` (the same on every rank).
  int arriving_count(int stage) const;
  // Most kv heads resident on one rank at once (blocks overlap only at their ends).
  int max_resident() const { return max_resident_; }

 private:
  void build_owned(int cp);
  void build_blocks(int cp);

  int heads_, kv_heads_, group_, per_rank_, stages_;
  int max_resident_ = 0;
  std::vector<std::vector<int>> owned_;
  std::vector<std::vector<kv_block>> blocks_;
};

}  // namespace upipe
