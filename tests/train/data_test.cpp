#include "train/data.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "core/error.hpp"

namespace upipe {
namespace {

namespace fs = std::filesystem;

// A scratch folder per test, removed afterwards.
class token_file_test : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("upipe_data_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write_bytes(const std::string& name, const std::string& bytes) {
    const fs::path path = dir_ / name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    EXPECT_TRUE(out.good()) << path;
    return path.string();
  }

  // Little-endian uint32 ids, written byte by byte so the test does not assume the host.
  std::string write_tokens(const std::string& name, const std::vector<std::uint32_t>& ids) {
    std::string bytes;
    for (auto id : ids)
      for (int i = 0; i < 4; ++i) bytes += static_cast<char>((id >> (8 * i)) & 0xff);
    return write_bytes(name, bytes);
  }

  fs::path dir_;
};

// The message of the io_error that `f` throws (fails the test when it throws none).
template <class F>
std::string io_error_message(F&& f) {
  try {
    f();
  } catch (const io_error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no io_error thrown";
  return "";
}

std::vector<std::uint32_t> iota_ids(std::uint32_t n) {
  std::vector<std::uint32_t> ids(n);
  for (std::uint32_t i = 0; i < n; ++i) ids[i] = i;
  return ids;
}

TEST_F(token_file_test, reads_exact_sequences) {
  const auto path = write_tokens("ten.bin", {5, 300, 65535, 70000, 1, 2, 3, 4, 9, 0});
  token_file file(path, 4, 100000);
  EXPECT_EQ(file.size(), 10);
  EXPECT_EQ(file.sequence(0), (std::vector<std::int32_t>{5, 300, 65535, 70000}));
  EXPECT_EQ(file.sequence(3), (std::vector<std::int32_t>{70000, 1, 2, 3}));
  EXPECT_EQ(file.sequence(6), (std::vector<std::int32_t>{3, 4, 9, 0}));
}

TEST_F(token_file_test, wraps_around) {
  token_file file(write_tokens("ten.bin", iota_ids(10)), 4, 10);
  EXPECT_EQ(file.sequence(8), (std::vector<std::int32_t>{8, 9, 0, 1}));
  EXPECT_EQ(file.sequence(13), (std::vector<std::int32_t>{3, 4, 5, 6}));  // position mod size
  token_file whole(write_tokens("ten_whole.bin", iota_ids(10)), 10, 10);
  EXPECT_EQ(whole.sequence(7), (std::vector<std::int32_t>{7, 8, 9, 0, 1, 2, 3, 4, 5, 6}));
}

TEST_F(token_file_test, next_position_walks_the_file) {
  token_file file(write_tokens("ten.bin", iota_ids(10)), 4, 10);
  std::int64_t position = 0;
  std::vector<std::int32_t> read;
  for (int i = 0; i < 5; ++i) {
    const auto seq = file.sequence(position);
    read.insert(read.end(), seq.begin(), seq.end());
    position = file.next_position(position);
  }
  EXPECT_EQ(position, 0);  // 5 * 4 = 20 tokens: twice through the file
  for (std::size_t i = 0; i < read.size(); ++i) EXPECT_EQ(read[i], static_cast<std::int32_t>(i % 10)) << i;
}

TEST_F(token_file_test, id_outside_the_vocabulary_throws) {
  auto ids = iota_ids(200);
  ids[123] = 70000;
  const auto path = write_tokens("big_id.bin", ids);
  token_file file(path, 16, 256);
  EXPECT_NO_THROW(file.sequence(0));  // the bad id is checked only when read
  const auto message = io_error_message([&] { file.sequence(120); });
  EXPECT_NE(message.find("token 70000 at index 123 of " + path + " is not below the vocabulary size 256"),
            std::string::npos)
      << message;
  // A wrapped read reports the absolute index in the file.
  const auto wrapped = io_error_message([&] { file.sequence(123 + 200 * 3); });
  EXPECT_NE(wrapped.find("at index 123 of"), std::string::npos) << wrapped;
  // The vocabulary bound is exclusive.
  token_file exact(write_tokens("edge.bin", {0, 255, 256}), 2, 256);
  EXPECT_NO_THROW(exact.sequence(0));
  EXPECT_THROW(exact.sequence(1), io_error);
}

TEST_F(token_file_test, file_shorter_than_the_sequence_throws) {
  const auto path = write_tokens("short.bin", iota_ids(100));
  const auto message = io_error_message([&] { token_file(path, 128, 256); });
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("100 tokens"), std::string::npos) << message;
  EXPECT_NE(message.find("128"), std::string::npos) << message;
  EXPECT_NE(message.find("--seq-len 100"), std::string::npos) << message;
  EXPECT_NO_THROW(token_file(path, 100, 256));
}

TEST_F(token_file_test, size_not_a_multiple_of_four_throws) {
  const auto path = write_bytes("odd.bin", std::string(10, '\0'));
  const auto message = io_error_message([&] { token_file(path, 1, 256); });
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("10 bytes"), std::string::npos) << message;
  EXPECT_NE(message.find("multiple of 4"), std::string::npos) << message;
}

TEST_F(token_file_test, empty_file_throws) {
  const auto path = write_bytes("empty.bin", "");
  const auto message = io_error_message([&] { token_file(path, 1, 256); });
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("empty"), std::string::npos) << message;
}

TEST_F(token_file_test, missing_file_throws) {
  const auto path = (dir_ / "missing.bin").string();
  const auto message = io_error_message([&] { token_file(path, 1, 256); });
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("no such file"), std::string::npos) << message;
  const auto folder = io_error_message([&] { token_file(dir_.string(), 1, 256); });
  EXPECT_NE(folder.find("not a regular file"), std::string::npos) << folder;
}

// ---------------------------------------------------------------------------------------
// passkey_task

constexpr std::int64_t digits = passkey_task::key_digits;
constexpr std::int32_t period = passkey_task::first_word;  // the word that ends every sentence

bool is_filler(std::int32_t id) { return id >= passkey_task::first_word && id < passkey_task::vocab_needed; }

// Where the inner key block starts, after checking that it occurs exactly once between
// BOS and the final query.
std::int64_t inner_key_at(const passkey_sample& s) {
  const auto n = static_cast<std::int64_t>(s.tokens.size());
  std::int64_t found = -1, count = 0;
  for (std::int64_t i = 1; i < n - (digits + 2); ++i)
    if (s.tokens[i] == passkey_task::key) found = i, ++count;
  EXPECT_EQ(count, 1);
  return found;
}

// Checks one sample's layout; returns the key block's position.
std::int64_t check_layout(const passkey_sample& s, std::int64_t seq_len) {
  const auto n = static_cast<std::int64_t>(s.tokens.size());
  EXPECT_EQ(n, seq_len);
  EXPECT_EQ(s.answer_start, seq_len - digits);
  EXPECT_EQ(s.tokens[0], passkey_task::bos);
  EXPECT_EQ(static_cast<std::int64_t>(s.digits.size()), digits);
  for (std::int64_t place = 0; place < digits; ++place) {
    // Digit i of the key is one of its place's ten ids.
    EXPECT_GE(s.digits[place], passkey_task::digit_id(place, 0));
    EXPECT_LE(s.digits[place], passkey_task::digit_id(place, 9));
  }
  // The end: QUERY KEY d d d d d.
  EXPECT_EQ(s.tokens[n - digits - 2], passkey_task::query);
  EXPECT_EQ(s.tokens[n - digits - 1], passkey_task::key);
  for (std::int64_t i = 0; i < digits; ++i) EXPECT_EQ(s.tokens[s.answer_start + i], s.digits[i]);
  // The inner key: after BOS or a sentence's period, followed by the same digits and then
  // a sentence (or the query).
  const std::int64_t at = inner_key_at(s);
  if (at < 0) return at;
  EXPECT_TRUE(s.tokens[at - 1] == passkey_task::bos || s.tokens[at - 1] == period) << at;
  for (std::int64_t i = 0; i < digits; ++i) EXPECT_EQ(s.tokens[at + 1 + i], s.digits[i]);
  const auto after = s.tokens[at + 1 + digits];
  EXPECT_TRUE(after == passkey_task::query || (is_filler(after) && after != period)) << after;
  // Everything else is filler.
  for (std::int64_t i = 1; i < n - digits - 2; ++i) {
    if (i >= at && i <= at + digits) continue;
    EXPECT_TRUE(is_filler(s.tokens[i])) << "index " << i << " id " << s.tokens[i];
  }
  for (auto id : s.tokens) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, passkey_task::vocab_needed);
  }
  return at;
}

TEST(passkey_task, min_seq_len_is_bos_key_query_and_one_sentence) {
  // BOS, KEY + 5 digits, QUERY KEY + 5 digits, and the shortest sentence (4 words).
  EXPECT_EQ(passkey_task::min_seq_len(), 18);
}

TEST(passkey_task, too_short_sequence_throws_with_the_minimum) {
  const auto min = passkey_task::min_seq_len();
  try {
    passkey_task task(min - 1);
    FAIL() << "no config_error";
  } catch (const config_error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("sequence length " + std::to_string(min - 1) + " is too short for the passkey task"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("at least " + std::to_string(min) + " tokens"), std::string::npos) << message;
    EXPECT_NE(message.find("--seq-len"), std::string::npos) << message;
  }
  EXPECT_THROW(passkey_task(0), config_error);
  EXPECT_NO_THROW(passkey_task{min});
}

TEST(passkey_task, every_length_is_exact_and_well_formed) {
  for (std::int64_t seq_len = passkey_task::min_seq_len(); seq_len <= 2000; seq_len += seq_len < 100 ? 1 : 37) {
    passkey_task task(seq_len);
    for (std::uint64_t index = 0; index < 20; ++index) {
      SCOPED_TRACE("seq_len " + std::to_string(seq_len) + " index " + std::to_string(index));
      check_layout(task.sample(7, index), seq_len);
      if (::testing::Test::HasFailure()) return;
    }
  }
}

TEST(passkey_task, samples_are_deterministic) {
  passkey_task task(256);
  const auto a = task.sample(42, 9), b = task.sample(42, 9);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.digits, b.digits);
  EXPECT_EQ(a.answer_start, b.answer_start);
  // Another task object of the same length gives the same stream.
  EXPECT_EQ(passkey_task(256).sample(42, 9).tokens, a.tokens);

  int same_tokens = 0, same_digits = 0;
  std::set<std::vector<std::int32_t>> seen;
  for (std::uint64_t index = 0; index < 100; ++index) {
    const auto s = task.sample(42, index);
    seen.insert(s.tokens);
    if (index > 0) {
      const auto prev = task.sample(42, index - 1);
      same_tokens += s.tokens == prev.tokens;
      same_digits += s.digits == prev.digits;
    }
  }
  EXPECT_EQ(seen.size(), 100u);
  EXPECT_EQ(same_tokens, 0);
  EXPECT_LE(same_digits, 1);
  // Another seed is another stream.
  EXPECT_NE(task.sample(43, 9).tokens, a.tokens);
}

TEST(passkey_task, key_depth_varies_from_start_to_end) {
  const std::int64_t seq_len = 1000;
  passkey_task task(seq_len);
  std::set<std::int64_t> depths;
  bool early = false, late = false;
  for (std::uint64_t index = 0; index < 200; ++index) {
    const auto at = inner_key_at(task.sample(3, index));
    depths.insert(at);
    early |= at < seq_len / 10;
    late |= at > seq_len * 9 / 10;
  }
  EXPECT_GT(depths.size(), 50u);
  EXPECT_TRUE(early);
  EXPECT_TRUE(late);
  // Depth 0 (right after BOS) is one of the boundaries.
  bool right_after_bos = false;
  passkey_task small(40);
  for (std::uint64_t index = 0; index < 200 && !right_after_bos; ++index)
    right_after_bos = small.sample(3, index).tokens[1] == passkey_task::key;
  EXPECT_TRUE(right_after_bos);
}

TEST(passkey_task, filler_is_predictable_within_a_sentence) {
  // Every word but the period has one successor across many long samples; the word
  // just before the final query may be a cut-off sentence's last word, so it is skipped.
  passkey_task task(2000);
  std::map<std::int32_t, std::int32_t> successor;
  std::set<std::int32_t> sentence_starts;
  for (std::uint64_t index = 0; index < 20; ++index) {
    const auto s = task.sample(11, index);
    const auto end = static_cast<std::int64_t>(s.tokens.size()) - digits - 3;  // last filler slot
    for (std::int64_t i = 1; i < end; ++i) {
      const auto word = s.tokens[i], next = s.tokens[i + 1];
      if (!is_filler(word)) continue;
      if (word == period) {
        if (is_filler(next)) sentence_starts.insert(next);
        continue;
      }
      ASSERT_TRUE(is_filler(next)) << "word " << word << " at " << i << " is followed by " << next;
      const auto [it, inserted] = successor.emplace(word, next);
      EXPECT_EQ(it->second, next) << "word " << word << " at " << i;
    }
  }
  // All eight sentences occur, and every first word has its fixed successor.
  EXPECT_EQ(sentence_starts.size(), 8u);
  for (auto first : sentence_starts) EXPECT_TRUE(successor.count(first)) << first;
  // Following the successors from a first word reaches the period within 7 words.
  for (auto first : sentence_starts) {
    std::int32_t word = first;
    int length = 1;
    while (word != period && length <= 7) word = successor.at(word), ++length;
    EXPECT_EQ(word, period) << "sentence starting " << first;
    EXPECT_GE(length, 4);
  }
}

TEST(passkey_task, each_place_draws_all_ten_values_from_its_own_ids) {
  passkey_task task(64);
  std::vector<std::set<std::int32_t>> seen(digits);
  for (std::uint64_t index = 0; index < 400; ++index) {
    const auto s = task.sample(9, index);
    for (std::int64_t place = 0; place < digits; ++place) seen[place].insert(s.digits[place]);
  }
  for (std::int64_t place = 0; place < digits; ++place) {
    EXPECT_EQ(seen[place].size(), 10u) << "place " << place;
    EXPECT_EQ(*seen[place].begin(), passkey_task::digit_id(place, 0));
    EXPECT_EQ(*seen[place].rbegin(), passkey_task::digit_id(place, 9));
  }
  // The places' ids do not overlap and end below the first filler word.
  EXPECT_EQ(passkey_task::digit_id(1, 0), passkey_task::digit_id(0, 9) + 1);
  EXPECT_LT(passkey_task::digit_id(digits - 1, 9), passkey_task::first_word);
}

TEST(passkey_task, digits_right_counts_matches) {
  passkey_task task(64);
  const auto s = task.sample(5, 1);
  EXPECT_DOUBLE_EQ(passkey_task::digits_right(s, s.digits), 1.0);
  auto predicted = s.digits;
  const std::int32_t zero = passkey_task::digit_id(1, 0);
  predicted[1] = predicted[1] == zero ? zero + 1 : zero;
  EXPECT_DOUBLE_EQ(passkey_task::digits_right(s, predicted), 0.8);
  predicted[4] = passkey_task::pad;
  EXPECT_DOUBLE_EQ(passkey_task::digits_right(s, predicted), 0.6);
  EXPECT_DOUBLE_EQ(passkey_task::digits_right(s, std::vector<std::int32_t>(5, passkey_task::query)), 0.0);
  EXPECT_THROW(passkey_task::digits_right(s, {2, 3, 4, 5}), internal_error);
  EXPECT_THROW(passkey_task::digits_right(s, {2, 3, 4, 5, 6, 7}), internal_error);
}

}  // namespace
}  // namespace upipe
