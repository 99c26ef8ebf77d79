#include "train/data_reader.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <charconv>

#include "core/error.hpp"

namespace upipe {

namespace {

bool names_a_file(const std::string& text) {
  std::error_code ec;
  return document_corpus::exists(text) || std::filesystem::is_regular_file(text, ec);
}

// "PATH:WEIGHT" (the weight after the last colon, where it reads as a number) or "PATH".
data_source_spec parse_part(const std::string& part, const std::string& flag) {
  data_source_spec spec{part, 1.0};
  const std::size_t colon = part.rfind(':');
  if (colon != std::string::npos && !names_a_file(part)) {
    const std::string weight = part.substr(colon + 1);
    char* end = nullptr;
    const double w = std::strtod(weight.c_str(), &end);
    if (weight.empty() || end != weight.c_str() + weight.size() || !std::isfinite(w) || !(w > 0))
      throw config_error(flag + " " + part + ": the weight '" + weight + "' is not a positive number; write "
                         "PREFIX:WEIGHT, e.g. " + flag + " chat:0.7,books:0.3");
    spec = {part.substr(0, colon), w};
  }
  if (spec.path.empty())
    throw config_error(flag + " has an empty source; write PREFIX or PREFIX:WEIGHT, e.g. " + flag + " chat:0.7,books:0.3");
  return spec;
}

}  // namespace

std::vector<data_source_spec> parse_data_sources(const std::string& text, const std::string& flag) {
  if (text.empty()) return {};
  if (names_a_file(text)) return {{text, 1.0}};
  std::vector<data_source_spec> out;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    out.push_back(parse_part(text.substr(start, comma - start), flag));
    for (std::size_t i = 0; i + 1 < out.size(); ++i)
      if (std::filesystem::weakly_canonical(out[i].path) == std::filesystem::weakly_canonical(out.back().path))
        throw config_error(flag + " names " + out.back().path + " twice; give each source once with its weight");
    start = comma + 1;
  }
  return out;
}

std::string data_source_text(const data_source_spec& source) {
  if (source.weight == 1.0) return source.path;
  char weight[32];
  const auto end = std::to_chars(weight, weight + sizeof weight, source.weight).ptr;  // shortest exact form
  return source.path + ":" + std::string(weight, end);
}

std::string data_sources_text(const std::vector<data_source_spec>& sources) {
  if (sources.size() == 1) return sources[0].path;
  std::string out;
  for (std::size_t i = 0; i < sources.size(); ++i) {
    const std::string one = data_source_text(sources[i]);
    out += (i ? "," : "") + (sources[i].weight == 1.0 ? one + ":1" : one);
  }
  return out;
}

std::int64_t data_position::total_sequences() const {
  return std::accumulate(sequences.begin(), sequences.end(), std::int64_t{0});
}

data_position data_layout::start() const {
  return {std::vector<std::int64_t>(weights.size(), 0), std::vector<std::int64_t>(weights.size(), 0)};
}

std::size_t data_layout::next_source(const data_position& at) const {
  const double drawn = static_cast<double>(at.total_sequences()) + 1;
  std::size_t best = 0;
  double behind = -INFINITY;
  for (std::size_t i = 0; i < weights.size(); ++i) {
    const double d = weights[i] * drawn - static_cast<double>(at.sequences[i]);
    if (d > behind) {
      behind = d;
      best = i;
    }
  }
  return best;
}

void data_layout::advance(data_position& at, std::size_t i, std::int64_t length) const {
  ++at.sequences[i];
  at.tokens[i] += wrap[i] > 0 ? seq_len : length;  // a token file's position counts on past its end (epochs)
}

// One source: a corpus of documents (packed as documents or as a stream) or a token file.
struct data_reader::source {
  std::unique_ptr<document_corpus> corpus;
  std::unique_ptr<token_file> file;
  bool documents = false;
};

data_reader::data_reader(const std::vector<data_source_spec>& specs, const options& o) : specs_(specs) {
  UPIPE_CHECK(!specs.empty(), "a data reader needs at least one source");
  double total = 0;
  for (const data_source_spec& s : specs) total += s.weight;
  layout_.seq_len = o.seq_len;
  for (const data_source_spec& s : specs) {
    auto src = std::make_unique<source>();
    const bool corpus = document_corpus::exists(s.path);
    if (o.packing == packing_mode::documents && !corpus)
      throw config_error("--packing documents needs a document index: " + s.path +
                         ".index is missing (upipe prepare-data writes PREFIX.tokens, PREFIX.index and PREFIX.json; "
                         "pass --data PREFIX), or use --packing stream for a flat token file");
    src->documents = corpus && o.packing != packing_mode::stream;
    if (corpus && !src->documents && document_corpus(s.path, o.vocab_size, 0, o.seed).masked())
      throw config_error("--packing stream reads " + s.path + " as one token stream, which would drop its loss mask "
                         "(PREFIX.mask): use --packing documents");
    if (src->documents)
      src->corpus = std::make_unique<document_corpus>(s.path, o.vocab_size, o.min_doc_tokens, o.seed);
    else
      src->file = open_token_stream(s.path, o.seq_len, o.vocab_size);  // a corpus's manifest read too
    layout_.weights.push_back(s.weight / total);
    layout_.wrap.push_back(src->file ? src->file->size() : 0);
    sources_.push_back(std::move(src));
  }
}

data_reader::~data_reader() = default;
data_reader::data_reader(data_reader&&) noexcept = default;

bool data_reader::documents(std::size_t i) const { return sources_[i]->documents; }
bool data_reader::masked(std::size_t i) const { return sources_[i]->corpus && sources_[i]->corpus->masked(); }

std::string data_reader::tokens_file(std::size_t i) const {
  return document_corpus::exists(specs_[i].path) ? specs_[i].path + ".tokens" : specs_[i].path;
}

packed_sequence data_reader::read(std::size_t i, std::int64_t tokens, std::int64_t length) const {
  const source& s = *sources_[i];
  packed_sequence out;
  if (s.corpus) {
    out = s.corpus->window(tokens, length);
  } else {
    out.tokens = s.file->sequence(tokens);
    out.tokens.resize(static_cast<std::size_t>(length));
  }
  out.source = static_cast<int>(i);
  return out;
}

packed_sequence data_reader::next(data_position& at, std::int64_t length) const {
  const std::size_t i = layout_.next_source(at);
  packed_sequence out = read(i, at.tokens[i], length);
  layout_.advance(at, i, length);
  return out;
}

double data_reader::epoch(const data_position& at, std::size_t i) const {
  return static_cast<double>(at.tokens[i]) / static_cast<double>(epoch_tokens(i));
}

std::int64_t data_reader::epoch_tokens(std::size_t i) const {
  const source& s = *sources_[i];
  return s.corpus ? s.corpus->epoch_tokens() : s.file->size();
}

std::int64_t data_reader::whole_windows(std::size_t i, std::int64_t length, std::int64_t wanted) const {
  return std::min(wanted, epoch_tokens(i) / std::max<std::int64_t>(length, 1));
}

void data_reader::check_ids() const {
  for (const auto& s : sources_) {
    if (s->corpus) {
      s->corpus->check_ids();
      s->corpus->check_documents_predict();
    } else
      s->file->check_ids();
  }
}

}  // namespace upipe
