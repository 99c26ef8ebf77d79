#include "train/niah.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "core/error.hpp"
#include "core/random.hpp"
#include "train/data.hpp"

namespace upipe {

needle_case passkey_needle(std::int64_t length, double depth, std::uint64_t seed, std::uint64_t index) {
  const passkey_sample s = passkey_task(length).sample(seed, index, depth);
  needle_case c;
  c.tokens = s.tokens;
  for (std::int64_t k = 0; k < passkey_task::key_digits; ++k) c.answer.push_back(s.answer_start + k);
  return c;
}

needle_case text_needle(std::span<const std::int32_t> prefix, std::span<const std::int32_t> haystack,
                        const needle_text& text, std::int64_t length, double depth) {
  UPIPE_CHECK(depth >= 0 && depth <= 1, "needle depth must be in [0, 1]");
  UPIPE_CHECK(!text.answer.empty(), "a needle needs an answer");
  const auto fixed = static_cast<std::int64_t>(prefix.size() + text.needle.size() + text.question.size() + text.answer.size());
  if (length <= fixed)
    throw config_error("a needle-in-a-haystack length of " + std::to_string(length) + " tokens cannot hold the needle, " +
                       "the question and the answer (" + std::to_string(fixed) + " tokens): use at least " +
                       std::to_string(2 * fixed));
  if (haystack.empty()) throw config_error("the needle-in-a-haystack's haystack has no tokens");
  const std::int64_t filler = length - fixed;
  const auto before = static_cast<std::int64_t>(std::llround(depth * static_cast<double>(filler)));
  needle_case c;
  c.tokens.reserve(static_cast<std::size_t>(length));
  c.tokens.insert(c.tokens.end(), prefix.begin(), prefix.end());
  const auto hay = [&](std::int64_t i) { return haystack[static_cast<std::size_t>(i) % haystack.size()]; };
  for (std::int64_t i = 0; i < before; ++i) c.tokens.push_back(hay(i));
  c.tokens.insert(c.tokens.end(), text.needle.begin(), text.needle.end());
  for (std::int64_t i = before; i < filler; ++i) c.tokens.push_back(hay(i));
  c.tokens.insert(c.tokens.end(), text.question.begin(), text.question.end());
  for (const std::int32_t id : text.answer) {
    c.answer.push_back(static_cast<std::int64_t>(c.tokens.size()));
    c.tokens.push_back(id);
  }
  return c;
}

std::string needle_key(std::uint64_t seed, std::uint64_t index, int digits) {
  std::string key;
  std::uint64_t state = mix64(seed ^ mix64(index));
  for (int i = 0; i < digits; ++i) {
    state = mix64(state);
    const auto digit = static_cast<int>(state % (i == 0 ? 9 : 10)) + (i == 0 ? 1 : 0);
    key.push_back(static_cast<char>('0' + digit));
  }
  return key;
}

std::vector<double> parse_depths(const std::string& text) {
  std::vector<double> out;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    char* end = nullptr;
    const double d = item.empty() ? NAN : std::strtod(item.c_str(), &end);
    if (item.empty() || end != item.c_str() + item.size() || !(d >= 0 && d <= 1))
      throw config_error("--depths entry '" + item + "' is not a fraction in [0, 1]: give e.g. 0,0.25,0.5,0.75,1");
    out.push_back(d);
    start = comma + 1;
  }
  return out;
}

needle_score score_needle(const needle_case& c, std::span<const std::int32_t> predicted, std::span<const float> log_probs) {
  UPIPE_CHECK(predicted.size() == c.answer.size() && log_probs.size() == c.answer.size(),
              "a needle's score needs one prediction and log-probability per answer token");
  needle_score s;
  std::size_t right = 0;
  double sum = 0;
  for (std::size_t j = 0; j < c.answer.size(); ++j) {
    right += predicted[j] == c.tokens[static_cast<std::size_t>(c.answer[j])] ? 1 : 0;
    sum += log_probs[j];
  }
  s.exact = right == c.answer.size();
  s.token_accuracy = static_cast<double>(right) / static_cast<double>(c.answer.size());
  s.mean_log_prob = sum / static_cast<double>(c.answer.size());
  return s;
}

}  // namespace upipe
