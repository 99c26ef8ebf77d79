// FP8 attention under every strategy of the table, hybrid's mesh included, at every U it
// takes, with and without sequence chunks: each strategy passes the arithmetic to all of its
// attention calls (stages, ring blocks, chunks), whose FP8 scales are per call, and merges
// partial results in fp32. The layer stays within FP8's tolerance of the exact float64
// reference, and FP8 is in effect (the layer is not the exact one).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cp/strategy_table.hpp"
#include "runtime/attention_experiment.hpp"

namespace upipe {
namespace {

attention_config fp8_config(strategy_kind kind, int chunk, int seq_chunks, int cp, int ring) {
  attention_config c;
  c.seq_len = 48;
  c.heads = 8;
  c.kv_heads = 2;
  c.head_dim = 16;
  c.model_dim = 24;
  c.cp = cp;
  c.ring = ring;
  c.head_chunk = chunk;
  c.seq_chunks = seq_chunks;
  c.strategy = kind;
  c.rope.theta = 10000;
  c.arithmetic = attention_dtype::fp8;
  return c;
}

TEST(fp8_strategies, every_strategy_and_u_stays_within_fp8_of_the_reference) {
  int runs = 0;
  for (const strategy_row& row : strategy_rows()) {
    const int cp = row.mesh ? 4 : 2, ring = row.mesh ? 2 : 1;
    for (const int u : head_chunk_choices(row, 8, cp / ring))
      for (const int n : {0, 2}) {
        if (n > 1 && row.chunks == sequence_chunking::none) continue;
        attention_config c = fp8_config(row.kind, row.heads == head_stages::chosen ? u : 0, n, cp, ring);
        experiment_options o;
        o.seed = 4242 + static_cast<std::uint64_t>(runs);
        o.limits = {std::size_t{64} << 20, std::size_t{1} << 20};
        const experiment_result r = run_attention_experiment(c, o);
        ASSERT_TRUE(r.max_rel_error.has_value());
        // One E5M2 step of a gradient at most (the op registry's FP8 tolerance); quantizing
        // shows (not the exact layer's 1e-5).
        EXPECT_LT(*r.max_rel_error, 0.35) << row.name << " U=" << c.head_chunk << " N=" << n;
        EXPECT_GT(*r.max_rel_error, 1e-4) << row.name << " U=" << c.head_chunk << " N=" << n;
        ++runs;
      }
  }
  EXPECT_GT(runs, 5);
}

}  // namespace
}  // namespace upipe
