// Analytic accounting of the attention phase's working set per rank (docs/design.md section
// 4), in bytes: excludes `out`, the log-sum-exp and library workspaces. The ledger's
// measured attention peak is held to it by tests; the planner uses it.
#pragma once

#include <cstddef>

#include "core/dtype.hpp"
#include "cp/attention_config.hpp"

namespace upipe {

struct attention_peak_model {
  std::size_t forward = 0;   // F
  std::size_t backward = 0;  // B
  std::size_t peak() const { return forward > backward ? forward : backward; }
};

// `work` is the storage dtype (bf16 on the GPU and meta; f32 on the cpu backend);
// accumulators are always f32. For ulysses and upipe this is docs/design.md's F and B:
// F = s d (2U + 2Kr) working elements; B = 4sdU + 2sdKr + 2sdKr working elements plus
// sdU (+ 2sdKr when kv heads span stages) f32 elements, Kr = C x resident kv heads.
// For ring it is this engine's buffer plan (documented in ring.cpp).
attention_peak_model attention_peak_formula(const attention_config& config, dtype work);

}  // namespace upipe
