// Needle in a haystack: where the needle goes, what the answer is, and how it is scored.
#include <gtest/gtest.h>

#include <algorithm>

#include "core/error.hpp"
#include "train/data.hpp"
#include "train/niah.hpp"

namespace upipe {
namespace {

// The key block (KEY d d d d d) of a passkey needle: where it starts.
std::int64_t key_position(const needle_case& c) {
  const auto it = std::find(c.tokens.begin(), c.tokens.end(), passkey_task::key);
  return it - c.tokens.begin();
}

TEST(niah, passkey_needles_sit_at_the_asked_depth_and_end_with_the_key) {
  const std::int64_t L = 512;
  const std::int64_t filler = L - 1 - 6 - 7;
  std::int64_t previous = -1;
  for (const double depth : {0.0, 0.25, 0.5, 0.75, 1.0}) {
    const needle_case c = passkey_needle(L, depth, 7, 3);
    ASSERT_EQ(static_cast<std::int64_t>(c.tokens.size()), L);
    ASSERT_EQ(c.answer.size(), 5u);
    EXPECT_EQ(c.answer.back(), L - 1);
    // The key is stated after depth of the filler (within a sentence, the longest is 7
    // tokens) and asked for at the end with the same digits.
    const std::int64_t at = key_position(c);
    EXPECT_NEAR(static_cast<double>(at - 1), depth * static_cast<double>(filler), 7.0) << depth;
    EXPECT_GT(at, previous);
    previous = at;
    for (std::int64_t k = 0; k < 5; ++k) EXPECT_EQ(c.tokens[at + 1 + k], c.tokens[c.answer[k]]);
    EXPECT_EQ(c.tokens[c.answer[0] - 1], passkey_task::key);
    EXPECT_EQ(c.tokens[c.answer[0] - 2], passkey_task::query);
  }
  EXPECT_EQ(key_position(passkey_needle(L, 0.0, 7, 3)), 1);  // right after BOS
  // The sample's index picks the key; the same (seed, index) the same sample.
  EXPECT_EQ(passkey_needle(L, 0.5, 7, 3).tokens, passkey_needle(L, 0.5, 7, 3).tokens);
  EXPECT_NE(passkey_needle(L, 0.5, 7, 3).tokens, passkey_needle(L, 0.5, 7, 4).tokens);
}

TEST(niah, training_samples_are_unchanged_by_the_depth_option) {
  // A sample without a depth draws it as before: the trainer's stream is the same.
  const passkey_task task(256);
  const passkey_sample a = task.sample(11, 5);
  const passkey_sample b = task.sample(11, 5, std::nullopt);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.digits, task.sample(11, 5, 0.5).digits);  // the depth moves the key, not its digits
}

TEST(niah, text_needles_are_laid_out_exactly) {
  const std::vector<std::int32_t> prefix = {1}, haystack = {10, 11, 12};
  const needle_text text{"42", {20, 21}, {30}, {40, 41}};
  const needle_case c = text_needle(prefix, haystack, text, 14, 0.5);
  // 1 + 2 + 1 + 2 fixed tokens, 8 of haystack (repeated), 4 of them before the needle.
  EXPECT_EQ(c.tokens, (std::vector<std::int32_t>{1, 10, 11, 12, 10, 20, 21, 11, 12, 10, 11, 30, 40, 41}));
  EXPECT_EQ(c.answer, (std::vector<std::int64_t>{12, 13}));
  EXPECT_EQ(text_needle(prefix, haystack, text, 14, 0.0).tokens[1], 20);
  EXPECT_EQ(text_needle(prefix, haystack, text, 14, 1.0).tokens[9], 20);
  EXPECT_THROW(text_needle(prefix, haystack, text, 6, 0.5), config_error);
}

TEST(niah, keys_are_seeded_digits) {
  const std::string k = needle_key(1, 0);
  EXPECT_EQ(k.size(), 7u);
  EXPECT_NE(k[0], '0');
  EXPECT_TRUE(std::all_of(k.begin(), k.end(), [](char c) { return c >= '0' && c <= '9'; }));
  EXPECT_EQ(k, needle_key(1, 0));
  EXPECT_NE(k, needle_key(1, 1));
  EXPECT_NE(k, needle_key(2, 0));
}

TEST(niah, depths_parse_and_bad_ones_are_named) {
  EXPECT_EQ(parse_depths("0,0.5,1"), (std::vector<double>{0, 0.5, 1}));
  for (const char* bad : {"", "0,,1", "1.5", "-0.1", "half", "nan"}) {
    try {
      parse_depths(bad);
      ADD_FAILURE() << bad;
    } catch (const config_error& e) {
      EXPECT_NE(std::string(e.what()).find("--depths"), std::string::npos) << e.what();
    }
  }
}

TEST(niah, scores_count_exact_matches_tokens_and_log_probabilities) {
  needle_case c;
  c.tokens = {5, 6, 7, 8};
  c.answer = {2, 3};
  const needle_score all = score_needle(c, std::vector<std::int32_t>{7, 8}, std::vector<float>{-0.5f, -1.5f});
  EXPECT_TRUE(all.exact);
  EXPECT_DOUBLE_EQ(all.token_accuracy, 1.0);
  EXPECT_DOUBLE_EQ(all.mean_log_prob, -1.0);
  const needle_score half = score_needle(c, std::vector<std::int32_t>{7, 9}, std::vector<float>{-0.5f, -1.5f});
  EXPECT_FALSE(half.exact);
  EXPECT_DOUBLE_EQ(half.token_accuracy, 0.5);
}

}  // namespace
}  // namespace upipe
