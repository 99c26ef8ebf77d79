// The data a run reads: one source, or a mixture of sources by weight, each a prepared corpus
// (PREFIX) or a flat uint32 token file; and the position in it, which is the whole data
// state of a resume. Every reader of training data (the trainer, the resume's check, a data
// parallel replica taking its share) moves through it here, so that its position logic lives
// in one place (docs/design.md section 8, "Documents" and "Mixtures").
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "train/data.hpp"

namespace upipe {

// How a corpus of documents becomes sequences: documents (attention masked and positions
// restarted at each document, the target across a boundary dropped), stream (one token
// stream, as a flat file), automatic (documents when there is an index).
enum class packing_mode : std::uint8_t { automatic, documents, stream };

struct data_source_spec {
  std::string path;   // as given: a corpus PREFIX or a token file
  double weight = 1;  // as given (the mixture normalizes them)
};

// `--data` as a user writes it: "PREFIX", or "A:0.7,B:0.3" (a missing weight is 1; weights
// need not sum to 1). A text that names an existing corpus or file whole is that one source,
// commas and colons included. Throws config_error naming `flag`, the part and a valid form
// for an empty part, a weight that is not a positive finite number, a source given twice.
std::vector<data_source_spec> parse_data_sources(const std::string& text, const std::string& flag);
// The text back, as a manifest records it: "A:0.7,B:0.3" ("A" for one source, whose weight
// means nothing).
std::string data_sources_text(const std::vector<data_source_spec>& sources);
// One source as written: "PATH" (weight 1) or "PATH:WEIGHT", the weight in its shortest exact form.
std::string data_source_text(const data_source_spec& source);

// How far a run has read: per source, the sequences it gave and its position (the tokens
// before the next window of a corpus; the tokens read of a token file, whose next one is at
// the position modulo the file's size: a file shorter than the run wraps around, and the
// position divided by its size counts the passes).
struct data_position {
  std::vector<std::int64_t> sequences, tokens;
  std::int64_t total_sequences() const;
  bool operator==(const data_position&) const = default;
};

// What moving through the data depends on, without its files: each source's weight (the
// shares of a mixture) and, for a token file, its size in tokens (a corpus has none: 0). The
// resume's check replays a saved run with it.
struct data_layout {
  std::vector<double> weights;     // normalized
  std::vector<std::int64_t> wrap;  // tokens of a token file, 0 for a corpus
  std::int64_t seq_len = 0;        // a token file moves by the run's --seq-len whatever the step's length

  data_position start() const;
  // The source of the next sequence: the one furthest behind its share, weight x (sequences
  // drawn + 1) - its sequences, the first of equals (as Megatron's blended datasets choose):
  // deterministic, every prefix of the run within one sequence of its weights.
  std::size_t next_source(const data_position& at) const;
  // Moves `at` past one sequence of `length` tokens of source `i`.
  void advance(data_position& at, std::size_t i, std::int64_t length) const;
};

class data_reader {
 public:
  struct options {
    std::int64_t vocab_size = 0, seq_len = 0, min_doc_tokens = 0;
    packing_mode packing = packing_mode::automatic;
    std::uint64_t seed = 0;
  };
  // Opens every source (throws io_error or config_error as document_corpus and token_file do).
  data_reader(const std::vector<data_source_spec>& sources, const options& o);
  ~data_reader();
  data_reader(data_reader&&) noexcept;

  std::size_t size() const { return specs_.size(); }
  const data_source_spec& spec(std::size_t i) const { return specs_[i]; }
  const std::vector<data_source_spec>& specs() const { return specs_; }
  const data_layout& layout() const { return layout_; }
  bool documents(std::size_t i) const;    // packed as documents (a corpus with --packing auto or documents)
  bool masked(std::size_t i) const;       // a corpus with a loss mask
  std::string tokens_file(std::size_t i) const;  // the file its tokens are in (PREFIX.tokens, or the file)
  // The next sequence of `length` tokens (at most --seq-len), from the source the mixture
  // chooses; `at` moves past it. The sequence's `source` says which.
  packed_sequence next(data_position& at, std::int64_t length) const;
  // Source i's sequence at its position `tokens`, without moving anything (evaluation).
  packed_sequence read(std::size_t i, std::int64_t tokens, std::int64_t length) const;
  // Passes over source i (its documents, or a token file's tokens) at `at`.
  double epoch(const data_position& at, std::size_t i) const;
  // Tokens in one pass over source i (a corpus's kept documents, a token file's tokens).
  std::int64_t epoch_tokens(std::size_t i) const;
  // The windows of `length` tokens an evaluation reads from source i: `wanted`, or fewer
  // where one pass holds fewer whole ones (read(i, w * length, length) for w below it), so
  // that no window wraps around to the data's start and each token is scored once.
  std::int64_t whole_windows(std::size_t i, std::int64_t length, std::int64_t wanted) const;
  // Reads every id (and mask byte) of every source once, before training.
  void check_ids() const;

 private:
  struct source;
  std::vector<data_source_spec> specs_;
  std::vector<std::unique_ptr<source>> sources_;
  data_layout layout_;
};

}  // namespace upipe
