#include "cp/head_schedule.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace upipe {

std::vector<head_run> consecutive_runs(std::span<const int> heads) {
  std::vector<head_run> runs;
  for (int slot = 0; slot < static_cast<int>(heads.size()); ++slot) {
    if (!runs.empty() && runs.back().first + runs.back().count == heads[slot])
      ++runs.back().count;
    else
      runs.push_back({heads[slot], slot, 1});
  }
  return runs;
}

head_schedule::head_schedule(int heads, int kv_heads, int cp, int head_chunk)
    : heads_(heads), kv_heads_(kv_heads), group_(heads / kv_heads), per_rank_(head_chunk / cp),
      stages_(heads / head_chunk) {
  UPIPE_CHECK(cp > 0 && head_chunk % cp == 0 && heads % head_chunk == 0, "invalid head chunk");
  UPIPE_CHECK(kv_heads % cp == 0 || cp % kv_heads == 0, "C must divide K or K divide C");
  build_owned(cp);
  build_blocks(cp);
}

void head_schedule::build_owned(int cp) {
  owned_.assign(cp, {});
  for (int r = 0; r < cp; ++r) {
    auto& list = owned_[r];
    if (kv_heads_ >= cp) {
      // Rank r owns kv heads r, r + C, ... and their whole query groups, in that order.
      for (int kv = r; kv < kv_heads_; kv += cp)
        for (int q = 0; q < group_; ++q) list.push_back(kv * group_ + q);
    } else {
      // Kv head r / R is replicated on R ranks; each takes one slice of its group.
      const int replicas = cp / kv_heads_, slice = group_ / replicas;
      const int kv = r / replicas, part = r % replicas;
      for (int q = 0; q < slice; ++q) list.push_back(kv * group_ + part * slice + q);
    }
    UPIPE_CHECK(static_cast<int>(list.size()) == heads_ / cp, "each rank owns H/C heads");
  }
}

void head_schedule::build_blocks(int cp) {
  blocks_.assign(cp, {});
  for (int r = 0; r < cp; ++r) {
    std::vector<int> first(kv_heads_, -1), last(kv_heads_, -1);
    for (int t = 0; t < stages_; ++t)
      for (int h : stage_heads(r, t)) {
        const int kv = kv_of(h);
        if (first[kv] < 0) first[kv] = t;
        last[kv] = t;
      }
    for (int t = 0; t < stages_; ++t) {
      kv_block block;
      block.first_stage = t;
      block.last_stage = t;
      for (int h : stage_heads(r, t)) {
        const int kv = kv_of(h);
        if (first[kv] != t || std::find(block.kv_heads.begin(), block.kv_heads.end(), kv) != block.kv_heads.end())
          continue;
        block.kv_heads.push_back(kv);
        block.last_stage = std::max(block.last_stage, last[kv]);
      }
      if (!block.kv_heads.empty()) blocks_[r].push_back(std::move(block));
    }
  }
  // The all-to-alls exchange equal chunks, so every rank must receive as many kv heads
  // at each stage as every other.
  for (int t = 0; t < stages_; ++t) {
    const int n = arriving_count(t);
    for (int r = 1; r < cp; ++r) {
      const kv_block* b = arriving(r, t);
      UPIPE_CHECK((b ? static_cast<int>(b->kv_heads.size()) : 0) == n, "unequal kv arrivals across ranks");
    }
  }
  for (int t = 0; t < stages_; ++t) {
    int resident = 0;
    for (const auto& b : blocks_[0])
      if (b.first_stage <= t && t <= b.last_stage) resident += static_cast<int>(b.kv_heads.size());
    max_resident_ = std::max(max_resident_, resident);
  }
}

const kv_block* head_schedule::arriving(int rank, int stage) const {
  for (const auto& b : blocks_[rank])
    if (b.first_stage == stage) return &b;
  return nullptr;
}

int head_schedule::arriving_count(int stage) const {
  const kv_block* b = arriving(0, stage);
  return b ? static_cast<int>(b->kv_heads.size()) : 0;
}

}  // namespace upipe
