// Needle in a haystack: a key planted at a chosen depth of a long context and asked for at
// its end. The model is scored on the key's tokens by teacher forcing: exact match (every
// key token is the argmax prediction), the fraction of key tokens right, and their mean
// log-probability. Two vocabularies: the passkey task's (the models the default run
// trains) and a model tokenizer's own text (python/upipe_tools/niah_text.py tokenizes it).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace upipe {

struct needle_case {
  std::vector<std::int32_t> tokens;  // exactly the asked length
  std::vector<std::int64_t> answer;  // positions in tokens of the key's tokens (the last ones)
};

// The passkey task's sample of `length` tokens with its key at the sentence boundary
// nearest `depth` (0 to 1) of the filler; the key is sample `index` of stream `seed`.
needle_case passkey_needle(std::int64_t length, double depth, std::uint64_t seed, std::uint64_t index);

// A needle in text: the needle sentence that states the key, the question asked at the
// end, and the key's tokens as the answer that follows the question.
struct needle_text {
  std::string key;
  std::vector<std::int32_t> needle, question, answer;
};

// prefix (the tokenizer's BOS, if any), then the haystack's first tokens with the needle
// inserted after a fraction `depth` of them, then the question and the answer: exactly
// `length` tokens. A haystack shorter than needed is repeated from its start. Throws
// config_error when `length` cannot hold the needle, the question and the answer.
needle_case text_needle(std::span<const std::int32_t> prefix, std::span<const std::int32_t> haystack,
                        const needle_text& text, std::int64_t length, double depth);

// The key of a needle: `digits` decimal digits (the first not 0), a pure function of
// (seed, index).
std::string needle_key(std::uint64_t seed, std::uint64_t index, int digits = 7);

// A list of depths: fractions in [0, 1], comma-separated ("0,0.25,0.5,0.75,1"). Throws
// config_error naming a bad entry.
std::vector<double> parse_depths(const std::string& text);

// The score of one needle: predicted[j] is the model's argmax for the token at
// answer[j], log_probs[j] that token's log-probability.
struct needle_score {
  bool exact = false;
  double token_accuracy = 0, mean_log_prob = 0;
};
needle_score score_needle(const needle_case& c, std::span<const std::int32_t> predicted, std::span<const float> log_probs);

}  // namespace upipe
