// Unsupported configurations are refused with a message naming the value, the rule and a
// valid alternative.
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "cp/attention_config.hpp"

namespace upipe {
namespace {

attention_config base() {
  attention_config c;
  c.seq_len = 64;
  c.heads = 8;
  c.kv_heads = 2;
  c.head_dim = 16;
  c.model_dim = 32;
  c.cp = 4;
  c.strategy = strategy_kind::upipe;
  return c;
}

void expect_refused(attention_config c, const std::string& fragment) {
  try {
    validate(c);
    FAIL() << "accepted: " << fragment;
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(attention_config, defaults_fill_the_head_chunk) {
  attention_config c = base();
  validate(c);
  EXPECT_EQ(c.head_chunk, 4);
  c = base();
  c.strategy = strategy_kind::ulysses;
  validate(c);
  EXPECT_EQ(c.head_chunk, 8);
}

TEST(attention_config, refusals_name_rule_and_alternative) {
  attention_config c = base();
  c.head_chunk = 6;
  expect_refused(c, "U must be a multiple of C and divide H; valid: 4, 8");
  c = base();
  c.cp = 3;
  expect_refused(c, "must divide query heads H = 8");
  c = base();
  c.heads = 12;
  c.kv_heads = 4;
  c.cp = 3;
  c.seq_len = 48;
  expect_refused(c, "C must divide K or K must divide C");
  c = base();
  c.seq_len = 66;
  expect_refused(c, "use S = 68");
  c = base();
  c.strategy = strategy_kind::ring;
  c.seq_len = 36;
  expect_refused(c, "divisible by 2C = 8");
  c = base();
  c.heads = 0;
  expect_refused(c, "query heads H = 0 is invalid");
  c = base();
  c.seq_len = -5;
  expect_refused(c, "must be a positive integer");
  c = base();
  c.kv_heads = 3;
  expect_refused(c, "must divide query heads H");
  c = base();
  c.head_dim = 15;
  expect_refused(c, "must be even");
  c = base();
  c.strategy = strategy_kind::ulysses;
  c.head_chunk = 4;
  expect_refused(c, "not allowed for ulysses");
  c = base();
  c.strategy = strategy_kind::ring;
  c.head_chunk = 4;
  expect_refused(c, "not allowed for ring");
}

TEST(attention_config, sequence_chunk_refusals_name_rule_and_alternative) {
  attention_config c = base();  // S / C = 16 tokens a rank
  c.seq_chunks = 17;
  expect_refused(c, "N = 17 is more than the 16 tokens of a rank's shard (S / C = 64 / 4); use at most --seq-chunks 16");
  c.seq_chunks = 16;
  validate(c);
  c = base();
  c.seq_chunks = 0;
  validate(c);
  EXPECT_EQ(c.seq_chunks, 1);  // upipe: unchunked unless asked
  c = base();
  c.seq_chunks = -2;
  expect_refused(c, "N = -2 is invalid: it must be a positive integer (for example --seq-chunks 4)");
  c = base();
  c.strategy = strategy_kind::ring;
  c.seq_len = 64;
  c.head_chunk = 0;
  c.seq_chunks = 2;
  expect_refused(c, "apply to ulysses, upipe and fpdt, not ring; leave --seq-chunks out, or use --attention upipe");
  c = base();
  c.strategy = strategy_kind::fpdt;
  c.head_chunk = 0;
  c.seq_chunks = 1;
  expect_refused(c, "fpdt with N = 1 sequence chunk is Ulysses: give --seq-chunks 2");
  c.seq_chunks = 0;
  validate(c);
  EXPECT_GE(c.seq_chunks, 2);  // fpdt's default chunks the sequence
  c = base();
  c.seq_chunks = 2;
  c.overlap_comm = true;
  expect_refused(c, "--overlap-comm applies to unchunked stages; leave it out with --seq-chunks 2");
}

TEST(attention_config, a_window_is_zero_or_a_key_count) {
  attention_config c = base();
  c.window = -1;
  expect_refused(c, "sliding window W = -1 is invalid");
  expect_refused(c, "--window 4096");
  for (const std::int64_t w : {0, 1, 63, 64, 1000}) {
    c.window = w;
    validate(c);
    EXPECT_EQ(c.windowed(), w > 0 && w < c.seq_len) << w;
  }
}

TEST(attention_config, parse_names) {
  EXPECT_EQ(parse_strategy_kind("ring"), strategy_kind::ring);
  EXPECT_THROW(parse_strategy_kind("zigzag"), config_error);
  EXPECT_EQ(valid_head_chunks(16, 4), (std::vector<int>{4, 8, 16}));
}

}  // namespace
}  // namespace upipe
