// Training data: flat little-endian uint32 token files (memory-mapped) and the built-in
// synthetic long-context task (a passkey hidden in low-entropy filler).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/files.hpp"

namespace upipe {

// A memory-mapped token file. Sequences are read consecutively from a position and
// wrap around at the end; every id is checked against the vocabulary as it is read.
class token_file {
 public:
  // Throws io_error when the file cannot be opened or mapped, is empty, has a size that
  // is not a multiple of 4, or holds fewer than `seq_len` tokens (the message names the
  // file, its token count and the sequence length, and suggests a shorter --seq-len).
  token_file(const std::string& path, std::int64_t seq_len, std::int64_t vocab_size);
  ~token_file();
  token_file(const token_file&) = delete;
  token_file& operator=(const token_file&) = delete;

  std::int64_t size() const { return count_; }  // tokens in the file
  // Reads every id once (before training starts): throws io_error naming the file, the
  // first id not below the vocabulary and its position, or a file whose every other
  // 32-bit word is zero (int64 ids written where uint32 belong).
  void check_ids() const;
  // The seq_len tokens starting at `position` (mod size). Throws io_error naming the
  // file, the position and the id when a token is not below the vocabulary size.
  std::vector<std::int32_t> sequence(std::int64_t position) const;
  // Where the sequence after the one at `position` starts.
  std::int64_t next_position(std::int64_t position) const { return (position + seq_len_) % count_; }

 private:
  std::string path_;
  std::int64_t seq_len_, vocab_, count_ = 0;
  std::unique_ptr<mapped_file> map_;
  const std::uint32_t* tokens_ = nullptr;
};

// A tokenized corpus of documents as `upipe prepare-data` writes it (docs/data.md):
// PREFIX.tokens (uint32 ids), PREFIX.index (uint64 offsets, documents + 1),
// PREFIX.json (the manifest) and, where its examples mask tokens out of the loss,
// PREFIX.mask (a byte per token, 1 for a target). Sequences are consecutive windows of S
// tokens over the documents in a shuffled order, epoch after epoch: short documents are
// concatenated and long ones continue into the next sequence. A window is a pure function
// of its position in that stream (the tokens before it), which is all a resume needs.
struct packed_sequence {
  std::vector<std::int32_t> tokens;
  std::vector<std::int64_t> documents;  // where each document (or continued part) begins; the first 0
  std::vector<std::int64_t> sources;    // each part's document in its corpus (messages name them)
  // Per token, 1 where it is a target of the loss (its prediction from the tokens before it
  // counts), 0 where masked (a prompt, a user turn); empty: every token is a target.
  std::vector<std::uint8_t> targets;
  std::int64_t epoch = 0;               // of the window's first token
  int source = 0;                       // which of a mixture's sources it comes from
  // The meta backend's sequences hold no tokens, only their length (the planner probes
  // lengths up to 2^30 without a host copy of them).
  std::int64_t shape_only = 0;
  std::int64_t length() const { return tokens.empty() ? shape_only : static_cast<std::int64_t>(tokens.size()); }
};

// A corpus's manifest (PREFIX.json, as upipe prepare-data writes it), checked: format
// "upipe-tokens" of version 1, uint32 ids, a vocabulary no larger than the model's
// (config_error: another model's data), and counts that are whole numbers. Every reader of
// a corpus reads it, also when the tokens are taken as one stream (--packing stream).
inline constexpr const char* corpus_format = "upipe-tokens";
inline constexpr int corpus_version = 1;
struct corpus_manifest {
  std::uint64_t documents = 0, tokens = 0;
  std::string path;       // PREFIX.json
  nlohmann::json fields;  // as read (the loss mask's entry among them)
};
corpus_manifest read_corpus_manifest(const std::string& prefix, std::int64_t vocab_size);

// The tokens of `data` as one stream: a flat token file, or a corpus's PREFIX.tokens once
// its manifest is read (read_corpus_manifest) and its count of tokens matches the file.
std::unique_ptr<token_file> open_token_stream(const std::string& data, std::int64_t seq_len, std::int64_t vocab_size);

// A corpus's manifest records the SHA-256 of the tokenizer.json that made it; data read with
// a model (`flag` PREFIX: train's --data and --eval-data, eval's --data) must have been made
// by the model directory's tokenizer. Throws config_error naming both and the way out
// (--allow-tokenizer-mismatch, or prepare-data with the model's tokenizer); with `allow`,
// warns instead. Nothing to compare (no model directory, a flat token file, a manifest
// without the field): nothing said.
void check_data_tokenizer(const std::string& model_dir, const std::string& prefix, const std::string& flag, bool allow);

class document_corpus {
 public:
  // Throws io_error for missing or inconsistent files (a size that is not the manifest's,
  // an index that does not end at the token count, a dtype other than uint32, a mask of
  // another format, size or values than 0 and 1) and config_error for a corpus of another
  // vocabulary (larger than the model's) or none of whose documents has min_doc_tokens
  // tokens.
  document_corpus(const std::string& prefix, std::int64_t vocab_size, std::int64_t min_doc_tokens, std::uint64_t seed);
  ~document_corpus();

  // Is there a corpus at PREFIX (PREFIX.index beside PREFIX.tokens)?
  static bool exists(const std::string& prefix);
  const std::string& prefix() const { return prefix_; }
  // Whether the corpus has a loss mask (PREFIX.mask, named by the manifest's "loss_mask").
  bool masked() const { return mask_ != nullptr; }
  std::int64_t documents() const { return static_cast<std::int64_t>(kept_.size()); }
  std::int64_t epoch_tokens() const { return epoch_tokens_; }
  std::string tokens_path() const { return prefix_ + ".tokens"; }
  // The window of `length` tokens at stream position `position`.
  packed_sequence window(std::int64_t position, std::int64_t length) const;
  // Every id below the vocabulary and every mask byte 0 or 1 (io_error naming the first that
  // is not); reads the whole corpus, once before training.
  void check_ids() const;
  // Some kept document has two tokens or more, so that sequences packed as documents have
  // targets (config_error otherwise).
  void check_documents_predict() const;

 private:
  struct order;
  const order& epoch_order(std::int64_t epoch) const;

  std::string prefix_;
  std::int64_t vocab_;
  std::uint64_t seed_;
  std::unique_ptr<mapped_file> tokens_, index_, mask_;
  const std::uint32_t* ids_ = nullptr;
  const std::uint8_t* target_bytes_ = nullptr;  // PREFIX.mask's bytes, where there is one
  const std::uint64_t* offsets_ = nullptr;
  std::vector<std::int64_t> kept_;  // documents with at least min_doc_tokens tokens
  std::int64_t epoch_tokens_ = 0;
  mutable std::unique_ptr<order> cached_;
};

// The synthetic passkey-retrieval task. Vocabulary (ids below 96, so any model with a
// vocabulary of at least 96 can learn it):
//   0 padding, 1 beginning of sequence, 2 "the pass key is", 3 "what is the pass key?",
//   4..53 the key's digits, 54..91 filler words.
// Digit i of the key (i = 0..4) is written with its own ten ids, 4 + 10 i + value, as a
// tokenizer that marks a digit's place would: the answer is then a lookup of "the
// digit in place i" anywhere in the context, which a 2-layer model learns within the
// default run's budget, whereas copying five shared digit ids in order needs an
// induction circuit that did not form within it (docs/benchmarks.md).
// A sample is: BOS, filler made of short sentences drawn from a small fixed set (each
// sentence a fixed word sequence, so the text is predictable), with "KEY d d d d d"
// inserted between two sentences at a random depth, and at the end the query
// "QUERY KEY d d d d d" (the same five digits), exactly seq_len tokens.
struct passkey_sample {
  std::vector<std::int32_t> tokens;  // seq_len ids
  std::int64_t answer_start = 0;     // index of the first answer digit (after the final KEY)
  std::vector<std::int32_t> digits;  // the five key digits, as ids
};

class passkey_task {
 public:
  static constexpr std::int32_t pad = 0, bos = 1, key = 2, query = 3, digit0 = 4, first_word = 54;
  static constexpr std::int64_t vocab_needed = 96, key_digits = 5;
  // The id of value (0..9) in place `place` (0..4) of the key.
  static constexpr std::int32_t digit_id(std::int64_t place, std::int32_t value) {
    return digit0 + static_cast<std::int32_t>(10 * place) + value;
  }

  // Throws config_error when seq_len is too short to hold one sentence, the key and the
  // query (the message gives the minimum).
  explicit passkey_task(std::int64_t seq_len);
  static std::int64_t min_seq_len();
  std::int64_t seq_len() const { return seq_len_; }

  // Sample number `index` of the stream `seed`: the same (seed, index) gives the same
  // sample on every rank and every run (training uses the step number as index;
  // held-out samples use another seed). The key goes at a random sentence boundary, or
  // with `depth` (0: first, 1: last) at the boundary nearest that fraction of the filler.
  passkey_sample sample(std::uint64_t seed, std::uint64_t index, std::optional<double> depth = {}) const;

  // The fraction of key digits right, where predicted[i] is the model's argmax for the
  // token at position answer_start + i (teacher forcing: the prediction made at position
  // answer_start + i - 1).
  static double digits_right(const passkey_sample& s, const std::vector<std::int32_t>& predicted);

 private:
  std::int64_t seq_len_;
};

}  // namespace upipe
