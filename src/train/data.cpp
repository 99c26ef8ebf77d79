#include "train/data.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <cmath>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <system_error>

#include <nlohmann/json.hpp>

#include "core/digest.hpp"
#include "core/error.hpp"
#include "core/files.hpp"
#include "core/random.hpp"

namespace upipe {
namespace {

// Token files hold little-endian uint32 ids and are read in place from the mapping.
static_assert(std::endian::native == std::endian::little, "token files are read as little-endian uint32");

[[noreturn]] void token_file_failure(const std::string& path, const std::string& problem) {
  throw io_error("cannot read token file " + path + ": " + problem);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// token_file

token_file::token_file(const std::string& path, std::int64_t seq_len, std::int64_t vocab_size)
    : path_(path), seq_len_(seq_len), vocab_(vocab_size) {
  UPIPE_CHECK(seq_len >= 1, "token_file needs a positive sequence length, got " + std::to_string(seq_len));
  UPIPE_CHECK(vocab_size >= 1, "token_file needs a positive vocabulary size, got " + std::to_string(vocab_size));
  map_ = std::make_unique<mapped_file>(path, "token file");
  const std::uint64_t bytes = map_->size();
  if (bytes == 0) token_file_failure(path, "it is empty; a token file holds little-endian uint32 ids, 4 bytes each");
  if (bytes % 4 != 0)
    token_file_failure(path, "its size " + std::to_string(bytes) +
                                 " bytes is not a multiple of 4; a token file holds little-endian uint32 ids, "
                                 "4 bytes each (was it truncated, or written with another id width?)");
  const auto count = static_cast<std::int64_t>(bytes / 4);
  if (count < seq_len)
    token_file_failure(path, "it holds " + std::to_string(count) + " tokens, fewer than the sequence length " +
                                 std::to_string(seq_len) + "; use --seq-len " + std::to_string(count) +
                                 " or less, or a longer file");
  tokens_ = static_cast<const std::uint32_t*>(map_->data());
  count_ = count;
}

token_file::~token_file() = default;

std::vector<std::int32_t> token_file::sequence(std::int64_t position) const {
  std::int64_t at = position % count_;
  if (at < 0) at += count_;
  std::vector<std::int32_t> out(static_cast<std::size_t>(seq_len_));
  for (std::int64_t i = 0; i < seq_len_; ++i) {
    const std::uint32_t id = tokens_[at];
    if (static_cast<std::int64_t>(id) >= vocab_)
      throw io_error("token " + std::to_string(id) + " at index " + std::to_string(at) + " of " + path_ +
                     " is not below the vocabulary size " + std::to_string(vocab_) +
                     ": the file was made with another tokenizer; retokenize it or use a model whose "
                     "vocabulary covers it");
    out[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(id);
    if (++at == count_) at = 0;
  }
  return out;
}

void token_file::check_ids() const {
  bool odd_words_zero = count_ >= 4 && count_ % 2 == 0, even_word_set = false;
  for (std::int64_t at = 0; at < count_; ++at) {
    const std::uint32_t id = tokens_[at];
    if (at % 2 == 1 && id != 0) odd_words_zero = false;
    if (at % 2 == 0 && id != 0) even_word_set = true;
    if (static_cast<std::int64_t>(id) >= vocab_)
      throw io_error("token " + std::to_string(id) + " at index " + std::to_string(at) + " of " + path_ +
                     " is not below the vocabulary size " + std::to_string(vocab_) +
                     ": the file was made with another tokenizer or another id width; a token file holds "
                     "little-endian uint32 ids (numpy: ids.astype('<u4').tofile(path))");
  }
  if (odd_words_zero && even_word_set)
    throw io_error(path_ + " looks like int64 ids: every second 32-bit word is zero. A token file holds "
                   "little-endian uint32 ids; convert it (numpy: np.fromfile(path, '<i8').astype('<u4').tofile(new))");
}

// ---------------------------------------------------------------------------------------
// document_corpus

// One epoch's document order and where each document begins in that epoch's stream.
struct document_corpus::order {
  std::int64_t epoch = -1;
  std::vector<std::int64_t> docs;   // indices into the corpus, shuffled
  std::vector<std::int64_t> begin;  // stream offset of docs[i] within the epoch (docs.size() + 1)
};

namespace {

std::int64_t doc_length(const std::uint64_t* offsets, std::int64_t d) {
  return static_cast<std::int64_t>(offsets[d + 1] - offsets[d]);
}

// The loss mask a manifest names ("loss_mask"), mapped and its size checked (its bytes are
// checked with the ids, once before training): one byte per token, 0 or 1. Null where the
// manifest names none (every token is a target).
std::unique_ptr<mapped_file> open_loss_mask(const std::string& prefix, const std::string& manifest_path,
                                             const nlohmann::json& m, std::uint64_t tokens) {
  if (!m.contains("loss_mask") || m["loss_mask"].is_null()) return nullptr;
  const nlohmann::json& mask = m["loss_mask"];
  const auto is = [&](const char* key, const nlohmann::json& want) { return mask.contains(key) && mask[key] == want; };
  if (!mask.is_object() || !is("format", "upipe-loss-mask") || !is("version", 1) || !is("dtype", "uint8"))
    throw io_error(manifest_path + ": loss_mask " + mask.dump().substr(0, 120) + " is not a loss mask this upipe reads "
                   "(format upipe-loss-mask, version 1, dtype uint8); prepare the data again with this upipe");
  auto file = std::make_unique<mapped_file>(prefix + ".mask", "loss mask");
  if (file->size() != tokens)
    throw io_error(prefix + ".mask holds " + std::to_string(file->size()) + " bytes, but the corpus has " +
                   std::to_string(tokens) + " tokens, one mask byte each: the files are of different runs or "
                   "truncated; prepare the data again");
  return file;
}

}  // namespace

bool document_corpus::exists(const std::string& prefix) {
  std::error_code ec;
  return std::filesystem::is_regular_file(prefix + ".index", ec) && std::filesystem::exists(prefix + ".tokens", ec);
}

corpus_manifest read_corpus_manifest(const std::string& prefix, std::int64_t vocab_size) {
  const std::string manifest_path = prefix + ".json";
  const std::string text = read_text_file(manifest_path, "the manifest of " + prefix + " (upipe prepare-data writes it)");
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw io_error(manifest_path + " is not valid JSON: " + e.what());
  }
  const auto field = [&](const char* key) -> const nlohmann::json& {
    if (!m.is_object() || !m.contains(key)) throw io_error(manifest_path + " has no \"" + std::string(key) + "\"");
    return m[key];
  };
  if (field("format") != corpus_format || field("version") != corpus_version)
    throw io_error(manifest_path + " is not an upipe corpus manifest of version " + std::to_string(corpus_version) +
                   " (format " + field("format").dump().substr(0, 40) + ", version " +
                   field("version").dump().substr(0, 40) + "): prepare the data with upipe prepare-data");
  if (!field("dtype").is_string() || field("dtype") != "uint32")
    throw io_error(manifest_path + ": dtype " + field("dtype").dump() + " is not supported; upipe reads uint32 tokens");
  if (!field("vocab_size").is_number_unsigned() || field("vocab_size").get<std::uint64_t>() > static_cast<std::uint64_t>(vocab_size))
    throw config_error(prefix + " was tokenized with a vocabulary of " + field("vocab_size").dump() +
                       " ids, more than the model's " + std::to_string(vocab_size) +
                       ": it belongs to another model; prepare the data with this model's tokenizer");
  for (const char* key : {"documents", "tokens"})
    if (!field(key).is_number_unsigned())
      throw io_error(manifest_path + ": " + key + " = " + field(key).dump().substr(0, 40) +
                     " is not a whole number of 0 or more; prepare the data again");
  return {field("documents").get<std::uint64_t>(), field("tokens").get<std::uint64_t>(), manifest_path, m};
}

void check_data_tokenizer(const std::string& model_dir, const std::string& prefix, const std::string& flag, bool allow) {
  std::error_code ec;
  const std::string model_tokenizer = (std::filesystem::path(model_dir) / "tokenizer.json").string();
  if (model_dir.empty() || !document_corpus::exists(prefix) || !std::filesystem::is_regular_file(model_tokenizer, ec))
    return;
  nlohmann::json manifest;
  try {
    manifest = nlohmann::json::parse(read_text_file(prefix + ".json", "the corpus manifest"));
  } catch (const nlohmann::json::exception&) {
    return;  // the corpus's own reader names a damaged manifest
  }
  if (!manifest.is_object() || !manifest.contains("tokenizer_sha256") || !manifest["tokenizer_sha256"].is_string())
    return;
  const std::string made_by = manifest["tokenizer_sha256"].get<std::string>();
  if (made_by == file_sha256(model_tokenizer, "the model's tokenizer")) return;
  const std::string source = manifest.contains("tokenizer") && manifest["tokenizer"].is_string()
                                 ? manifest["tokenizer"].get<std::string>()
                                 : std::string("another tokenizer");
  const std::string text = flag + " " + prefix + " was tokenized with " + source + ", whose tokenizer.json differs from " +
                           model_tokenizer + " (SHA-256 " + made_by.substr(0, 12) + "... against the model's)";
  if (allow) {
    std::fprintf(stderr, "upipe: warning: %s; reading it as --allow-tokenizer-mismatch says\n", text.c_str());
    return;
  }
  throw config_error(text + ": prepare the data with this model's tokenizer (upipe prepare-data --tokenizer " +
                     model_dir + "), or pass --allow-tokenizer-mismatch if the ids mean the same");
}

std::unique_ptr<token_file> open_token_stream(const std::string& data, std::int64_t seq_len, std::int64_t vocab_size) {
  if (!document_corpus::exists(data)) return std::make_unique<token_file>(data, seq_len, vocab_size);
  const corpus_manifest manifest = read_corpus_manifest(data, vocab_size);
  auto file = std::make_unique<token_file>(data + ".tokens", seq_len, vocab_size);
  if (static_cast<std::uint64_t>(file->size()) != manifest.tokens)
    throw io_error(data + ".tokens holds " + std::to_string(file->size()) + " tokens, but the manifest counts " +
                   std::to_string(manifest.tokens) + ": the files are of different runs or truncated; prepare the "
                   "data again");
  return file;
}

document_corpus::document_corpus(const std::string& prefix, std::int64_t vocab_size, std::int64_t min_doc_tokens,
                                 std::uint64_t seed)
    : prefix_(prefix), vocab_(vocab_size), seed_(seed) {
  const corpus_manifest manifest = read_corpus_manifest(prefix, vocab_size);
  tokens_ = std::make_unique<mapped_file>(prefix + ".tokens", "token file");
  index_ = std::make_unique<mapped_file>(prefix + ".index", "document index");
  const std::uint64_t documents = manifest.documents, tokens = manifest.tokens;
  // Compared by division: the manifest's counts come from a file, and tokens * 4 or
  // (documents + 1) * 8 could wrap around to a size that matches.
  if (tokens_->size() % 4 != 0 || tokens_->size() / 4 != tokens)
    throw io_error(prefix + ".tokens holds " + std::to_string(tokens_->size()) + " bytes, but the manifest counts " +
                   std::to_string(tokens) + " uint32 tokens of 4 bytes: the files are of different runs or "
                   "truncated; prepare the data again");
  if (index_->size() % 8 != 0 || index_->size() / 8 == 0 || index_->size() / 8 - 1 != documents)
    throw io_error(prefix + ".index holds " + std::to_string(index_->size()) + " bytes, but the manifest counts " +
                   std::to_string(documents) + " documents, whose index holds documents + 1 uint64 offsets; "
                   "prepare the data again");
  ids_ = static_cast<const std::uint32_t*>(tokens_->data());
  offsets_ = static_cast<const std::uint64_t*>(index_->data());
  mask_ = open_loss_mask(prefix, manifest.path, manifest.fields, tokens);
  if (mask_) target_bytes_ = static_cast<const std::uint8_t*>(mask_->data());
  if (offsets_[0] != 0 || offsets_[documents] != tokens)
    throw io_error(prefix + ".index runs from " + std::to_string(offsets_[0]) + " to " +
                   std::to_string(offsets_[documents]) + ", not from 0 to the " + std::to_string(tokens) +
                   " tokens; prepare the data again");
  for (std::uint64_t d = 0; d < documents; ++d) {
    if (offsets_[d + 1] < offsets_[d] || offsets_[d + 1] > tokens)
      throw io_error(prefix + ".index: document " + std::to_string(d) + " runs from offset " +
                     std::to_string(offsets_[d]) + " to " + std::to_string(offsets_[d + 1]) +
                     ", not forward within the " + std::to_string(tokens) + " tokens; prepare the data again");
    const std::int64_t n = doc_length(offsets_, static_cast<std::int64_t>(d));
    if (n >= std::max<std::int64_t>(1, min_doc_tokens)) {
      kept_.push_back(static_cast<std::int64_t>(d));
      epoch_tokens_ += n;
    }
  }
  if (kept_.empty())
    throw config_error(prefix + " has no document of at least --min-doc-tokens " + std::to_string(min_doc_tokens) +
                       " tokens (" + std::to_string(documents) + " documents); lower --min-doc-tokens");

}

document_corpus::~document_corpus() = default;

// Fisher-Yates over the kept documents, drawn from a counter-based hash of (seed, epoch).
const document_corpus::order& document_corpus::epoch_order(std::int64_t epoch) const {
  if (cached_ && cached_->epoch == epoch) return *cached_;
  auto o = std::make_unique<order>();
  o->epoch = epoch;
  o->docs = kept_;
  const std::uint64_t stream = mix64(seed_ ^ mix64(static_cast<std::uint64_t>(epoch) + 0x6a09e667f3bcc909ull));
  for (std::size_t i = o->docs.size(); i > 1; --i) {
    const std::uint64_t r = mix64(stream + i) % i;
    std::swap(o->docs[i - 1], o->docs[r]);
  }
  o->begin.resize(o->docs.size() + 1, 0);
  for (std::size_t i = 0; i < o->docs.size(); ++i) o->begin[i + 1] = o->begin[i] + doc_length(offsets_, o->docs[i]);
  cached_ = std::move(o);
  return *cached_;
}

packed_sequence document_corpus::window(std::int64_t position, std::int64_t length) const {
  packed_sequence out;
  out.tokens.reserve(static_cast<std::size_t>(length));
  std::int64_t epoch = position / epoch_tokens_, offset = position % epoch_tokens_;
  out.epoch = epoch;
  while (static_cast<std::int64_t>(out.tokens.size()) < length) {
    const order& o = epoch_order(epoch);
    // The document that holds `offset`, and how far into it.
    const auto it = std::upper_bound(o.begin.begin(), o.begin.end(), offset) - 1;
    const auto i = static_cast<std::size_t>(it - o.begin.begin());
    const std::int64_t doc = o.docs[i], into = offset - *it;
    const std::int64_t take =
        std::min(doc_length(offsets_, doc) - into, length - static_cast<std::int64_t>(out.tokens.size()));
    out.documents.push_back(static_cast<std::int64_t>(out.tokens.size()));
    out.sources.push_back(doc);
    if (target_bytes_ != nullptr) {
      const std::uint8_t* mask = target_bytes_ + offsets_[doc] + into;
      out.targets.insert(out.targets.end(), mask, mask + take);
    }
    const std::uint32_t* first = ids_ + offsets_[doc] + into;
    for (std::int64_t t = 0; t < take; ++t) {
      if (static_cast<std::int64_t>(first[t]) >= vocab_)
        throw io_error("token " + std::to_string(first[t]) + " of document " + std::to_string(doc) + " in " + prefix_ +
                       ".tokens is not below the vocabulary size " + std::to_string(vocab_));
      out.tokens.push_back(static_cast<std::int32_t>(first[t]));
    }
    offset += take;
    if (offset == epoch_tokens_) {
      ++epoch;
      offset = 0;
    }
  }
  return out;
}

void document_corpus::check_documents_predict() const {
  // Attention and the loss stay within a document: one of a single token predicts nothing.
  if (std::none_of(kept_.begin(), kept_.end(), [&](std::int64_t d) { return doc_length(offsets_, d) >= 2; }))
    throw config_error(prefix_ + " has no document of two tokens or more (" + std::to_string(kept_.size()) +
                       " documents of one token): within a document there is then nothing to predict; prepare "
                       "documents of several tokens, or read it as one stream with --packing stream");
}

void document_corpus::check_ids() const {
  const std::uint64_t n = tokens_->size() / 4;
  for (std::uint64_t at = 0; at < n; ++at)
    if (static_cast<std::int64_t>(ids_[at]) >= vocab_)
      throw io_error("token " + std::to_string(ids_[at]) + " at index " + std::to_string(at) + " of " + prefix_ +
                     ".tokens is not below the vocabulary size " + std::to_string(vocab_) +
                     ": prepare the data with this model's tokenizer");
  for (std::uint64_t at = 0; target_bytes_ != nullptr && at < n; ++at)
    if (target_bytes_[at] > 1)
      throw io_error(prefix_ + ".mask: byte " + std::to_string(at) + " is " + std::to_string(target_bytes_[at]) +
                     ", not 0 (masked) or 1 (a target); prepare the data again");
}

// ---------------------------------------------------------------------------------------
// passkey_task

namespace {

// Filler words are ids 54..91. Every sentence ends with the shared period; every other
// word occurs in one sentence only, so each word but the period has a single successor
// and the filler is predictable after a sentence's first word.
constexpr std::int32_t period = passkey_task::first_word;  // "."

constexpr std::int32_t w = passkey_task::first_word;  // the other words are w + 1, w + 2, ...
constexpr std::int32_t sentence0[] = {w + 1, w + 2, w + 3, w + 4, period};            // the grass is green .
constexpr std::int32_t sentence1[] = {w + 5, w + 6, w + 7, w + 8, w + 9, period};     // a sky looks blue today .
constexpr std::int32_t sentence2[] = {w + 10, w + 11, w + 12, w + 13, w + 14, w + 15, period}; // birds sing in tall old trees .
constexpr std::int32_t sentence3[] = {w + 16, w + 17, w + 18, w + 19, period};        // rivers flow to seas .
constexpr std::int32_t sentence4[] = {w + 20, w + 21, w + 22, w + 23, w + 24, period}; // we walk home after dark .
constexpr std::int32_t sentence5[] = {w + 25, w + 26, w + 27, period};                // cold snow falls .
constexpr std::int32_t sentence6[] = {w + 28, w + 29, w + 30, w + 31, w + 32, w + 33, period}; // kids play with small red balls .
constexpr std::int32_t sentence7[] = {w + 34, w + 35, w + 36, w + 37, period};        // stars shine at night .

constexpr std::span<const std::int32_t> sentences[] = {sentence0, sentence1, sentence2, sentence3,
                                                        sentence4, sentence5, sentence6, sentence7};
constexpr std::uint64_t sentence_count = std::size(sentences);

constexpr std::int64_t shortest_sentence() {
  std::size_t shortest = sentences[0].size();
  for (const auto& s : sentences) shortest = s.size() < shortest ? s.size() : shortest;
  return static_cast<std::int64_t>(shortest);
}

constexpr std::int64_t key_block = 1 + passkey_task::key_digits;        // KEY d d d d d
constexpr std::int64_t query_block = 2 + passkey_task::key_digits;      // QUERY KEY d d d d d

// A value uniform in [0, n) by rejection, straight from the engine's output: mt19937_64's
// sequence is fixed by the standard, whereas uniform_int_distribution's mapping is not.
std::uint64_t uniform_below(std::mt19937_64& rng, std::uint64_t n) {
  const std::uint64_t limit = UINT64_MAX - UINT64_MAX % n;  // a multiple of n
  std::uint64_t draw;
  do draw = rng(); while (draw >= limit);
  return draw % n;
}

}  // namespace

passkey_task::passkey_task(std::int64_t seq_len) : seq_len_(seq_len) {
  if (seq_len < min_seq_len())
    throw config_error("sequence length " + std::to_string(seq_len) +
                       " is too short for the passkey task: it needs at least " + std::to_string(min_seq_len()) +
                       " tokens (for example --seq-len 128)");
}

std::int64_t passkey_task::min_seq_len() { return 1 + key_block + query_block + shortest_sentence(); }

passkey_sample passkey_task::sample(std::uint64_t seed, std::uint64_t index, std::optional<double> depth_fraction) const {
  std::mt19937_64 rng(mix64(mix64(seed) ^ index));

  passkey_sample s;
  for (std::int64_t i = 0; i < key_digits; ++i)
    s.digits.push_back(digit_id(i, static_cast<std::int32_t>(uniform_below(rng, 10))));

  // The filler is a stream of random sentences cut at exactly the space left; the key may
  // go before any full sentence or after the last one (never inside the cut-off tail).
  const std::int64_t filler_len = seq_len_ - 1 - key_block - query_block;
  std::vector<std::int32_t> filler;
  filler.reserve(static_cast<std::size_t>(filler_len));
  std::vector<std::size_t> boundaries = {0};
  // The sentences follow each other in a fixed cycle from a random first one, so that
  // once the filler is learned the only thing left to learn is the retrieval.
  for (std::uint64_t next = uniform_below(rng, sentence_count); static_cast<std::int64_t>(filler.size()) < filler_len;
       next = (next + 1) % sentence_count) {
    const auto& sentence = sentences[next];
    const auto room = static_cast<std::size_t>(filler_len) - filler.size();
    const std::size_t take = sentence.size() < room ? sentence.size() : room;
    filler.insert(filler.end(), sentence.begin(), sentence.begin() + static_cast<std::ptrdiff_t>(take));
    if (take == sentence.size()) boundaries.push_back(filler.size());
  }
  std::size_t depth = 0;
  if (depth_fraction) {
    UPIPE_CHECK(*depth_fraction >= 0 && *depth_fraction <= 1, "needle depth must be in [0, 1]");
    const double target = *depth_fraction * static_cast<double>(filler_len);
    for (const std::size_t b : boundaries)
      if (std::abs(static_cast<double>(b) - target) < std::abs(static_cast<double>(depth) - target)) depth = b;
  } else {
    depth = boundaries[uniform_below(rng, boundaries.size())];
  }

  s.tokens.reserve(static_cast<std::size_t>(seq_len_));
  s.tokens.push_back(bos);
  s.tokens.insert(s.tokens.end(), filler.begin(), filler.begin() + static_cast<std::ptrdiff_t>(depth));
  s.tokens.push_back(key);
  s.tokens.insert(s.tokens.end(), s.digits.begin(), s.digits.end());
  s.tokens.insert(s.tokens.end(), filler.begin() + static_cast<std::ptrdiff_t>(depth), filler.end());
  s.tokens.push_back(query);
  s.tokens.push_back(key);
  s.tokens.insert(s.tokens.end(), s.digits.begin(), s.digits.end());
  UPIPE_CHECK(static_cast<std::int64_t>(s.tokens.size()) == seq_len_,
              "passkey sample has " + std::to_string(s.tokens.size()) + " tokens, not " + std::to_string(seq_len_));
  s.answer_start = seq_len_ - key_digits;
  return s;
}

double passkey_task::digits_right(const passkey_sample& s, const std::vector<std::int32_t>& predicted) {
  UPIPE_CHECK(static_cast<std::int64_t>(predicted.size()) == key_digits,
              "digits_right needs " + std::to_string(key_digits) + " predicted digits, got " +
                  std::to_string(predicted.size()));
  UPIPE_CHECK(static_cast<std::int64_t>(s.digits.size()) == key_digits,
              "passkey sample holds " + std::to_string(s.digits.size()) + " digits, not " + std::to_string(key_digits));
  int right = 0;
  for (std::size_t i = 0; i < predicted.size(); ++i) right += predicted[i] == s.digits[i] ? 1 : 0;
  return right / static_cast<double>(key_digits);
}

}  // namespace upipe
