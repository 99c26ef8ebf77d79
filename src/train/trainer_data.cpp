#include "train/trainer_data.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "core/error.hpp"

namespace upipe {

namespace {

std::uint64_t file_bytes(const std::string& path) {
  std::error_code ec;
  const auto n = std::filesystem::file_size(path, ec);
  return ec ? 0 : static_cast<std::uint64_t>(n);
}

bool same_path(const std::string& a, const std::string& b) {
  return std::filesystem::weakly_canonical(a) == std::filesystem::weakly_canonical(b);
}

// How --packing packs the sources (the name a checkpoint records): documents, stream or mixed.
std::string packing_of(const std::vector<data_source_spec>& specs, packing_mode packing) {
  std::string out;
  for (const data_source_spec& s : specs) {
    const std::string p = packing != packing_mode::stream && document_corpus::exists(s.path) ? "documents" : "stream";
    out = out.empty() || out == p ? p : "mixed";
  }
  return out.empty() ? "stream" : out;
}

std::string run_text(const std::string& data) { return data == "passkey" ? "the passkey task" : "--data " + data; }

// The saved run's sources must be this run's: the same paths, weights, sizes and packing.
void check_same_sources(const train_options& o, const trainer_state& st, const std::vector<data_source_spec>& specs) {
  const std::string data = specs.empty() ? "passkey" : data_sources_text(specs);
  const auto refuse = [&] {
    throw config_error("cannot resume from " + o.resume_dir + ": it was trained on " + run_text(st.data) + ", not " +
                       run_text(data) + "; pass " + (st.data == "passkey" ? std::string("no --data") : "--data " + st.data));
  };
  if ((st.data == "passkey") != specs.empty()) refuse();
  if (specs.empty()) return;
  if (st.mixture.empty() != (specs.size() == 1)) refuse();
  std::vector<std::pair<std::string, std::uint64_t>> files;  // the saved path and size of each source
  if (st.mixture.empty()) {
    if (!same_path(st.data, specs[0].path)) refuse();
    files.push_back({st.data, st.data_bytes});
  } else {
    if (st.mixture.size() != specs.size()) refuse();
    for (std::size_t i = 0; i < specs.size(); ++i) {
      if (!same_path(st.mixture[i].data, specs[i].path) || st.mixture[i].weight != specs[i].weight) refuse();
      files.push_back({st.mixture[i].data, st.mixture[i].data_bytes});
    }
  }
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const std::string tokens = document_corpus::exists(specs[i].path) ? specs[i].path + ".tokens" : specs[i].path;
    const std::uint64_t bytes = file_bytes(tokens);
    if (files[i].second != 0 && bytes != files[i].second)
      throw config_error("cannot resume from " + o.resume_dir + ": the data file " + tokens + " holds " +
                         std::to_string(bytes) + " bytes but held " + std::to_string(files[i].second) +
                         " when the checkpoint was saved; resume on the same data, or start a new run with --init " +
                         o.resume_dir);
  }
  const std::string packing = packing_of(specs, o.packing);
  if (st.packing != packing || st.min_doc_tokens != o.min_doc_tokens)
    throw config_error("cannot resume from " + o.resume_dir + ": it packed the data as --packing " + st.packing +
                       " --min-doc-tokens " + std::to_string(st.min_doc_tokens) + ", not --packing " + packing +
                       " --min-doc-tokens " + std::to_string(o.min_doc_tokens) +
                       " (another order of sequences); pass those");
}

// The layout of the saved run's data, from its state alone: weights, and each token file's size.
data_layout saved_layout(const trainer_state& st) {
  data_layout layout;
  layout.seq_len = st.seq_len;
  const bool stream = st.packing != "documents";
  const auto wrap = [&](std::uint64_t bytes) { return stream ? std::max<std::int64_t>(1, static_cast<std::int64_t>(bytes / 4)) : 0; };
  if (st.mixture.empty()) {
    layout.weights = {1.0};
    layout.wrap = {wrap(st.data_bytes)};
    return layout;
  }
  double total = 0;
  for (const auto& m : st.mixture) total += m.weight;
  for (const auto& m : st.mixture) {
    layout.weights.push_back(m.weight / total);
    layout.wrap.push_back(wrap(m.data_bytes));
  }
  return layout;
}

// The data position a save records follows from the steps before it (their batch and
// lengths); one that does not is a damaged or edited state. A run of another shape
// continues from the saved position, and says so.
void check_resumed_position(const train_options& o, const saved_state& saved) {
  const trainer_state& st = saved.state();
  if (!saved.shape_recorded()) return;  // a save of an earlier upipe recorded no shape
  // The saved batch is the step's over every replica (--dp x --batch).
  if (st.batch != global_batch(o) || st.seq_len != o.seq_len)
    std::fprintf(stderr, "upipe: note: the checkpoint trained --batch %lld --seq-len %lld; this run takes --batch %lld "
                 "--seq-len %lld%s, continuing from its data position %lld\n", static_cast<long long>(st.batch),
                 static_cast<long long>(st.seq_len), static_cast<long long>(global_batch(o)),
                 static_cast<long long>(o.seq_len), o.dp > 1 ? " (over its replicas)" : "",
                 static_cast<long long>(st.data_position));
  const data_layout layout = saved_layout(st);
  data_position at = saved_position(st, true);
  for (std::int64_t step = st.shape_step + 1; step <= st.step && st.data != "passkey"; ++step) {
    const std::int64_t length = step <= st.seq_warmup ? st.warmup_seq_len : st.seq_len;
    for (std::int64_t b = 0; b < st.batch; ++b) layout.advance(at, layout.next_source(at), length);
  }
  data_position saved_at = saved_position(st, false);
  if (st.mixture.empty()) at.sequences = saved_at.sequences;  // one source records none
  // Saves before a token file's position counted its passes recorded it wrapped, below the
  // file's size: the same place in the file.
  for (std::size_t i = 0; i < at.tokens.size(); ++i)
    if (layout.wrap[i] > 0 && saved_at.tokens[i] < layout.wrap[i]) at.tokens[i] %= layout.wrap[i];
  if (st.data == "passkey") at.tokens = {0};                  // the task reads no file: its position stays 0
  if (!(at == saved_at))
    throw io_error("the trainer state in " + saved.dir() + " is damaged: its data position " +
                   std::to_string(st.data_position) + " does not follow from its " +
                   std::to_string(st.step - st.shape_step) + " steps of " + std::to_string(st.batch) + " x " +
                   std::to_string(st.seq_len) + " tokens; restore the checkpoint, or start a new run from its weights "
                   "with --init " + saved.dir());
}

}  // namespace

data_reader::options reader_options(const train_options& o, std::int64_t min_doc_tokens) {
  return {o.model.vocab_size, o.seq_len, min_doc_tokens, o.packing, o.seed};
}

std::string packing_name(const data_reader* reader) {
  if (reader == nullptr) return "stream";
  std::string out;
  for (std::size_t i = 0; i < reader->size(); ++i) {
    const std::string p = reader->documents(i) ? "documents" : "stream";
    out = out.empty() || out == p ? p : "mixed";
  }
  return out;
}

run_data::run_data(const train_options& o) : seed_(o.seed) {
  if (o.data_path.empty())
    task_ = std::make_unique<passkey_task>(o.seq_len);
  else
    reader_ = std::make_unique<data_reader>(parse_data_sources(o.data_path, "--data"), reader_options(o, o.min_doc_tokens));
}

data_position run_data::start() const { return reader_ ? reader_->layout().start() : data_position{{0}, {0}}; }

packed_sequence run_data::next(std::int64_t index, data_position& at, std::int64_t length) const {
  if (reader_) return reader_->next(at, length);
  packed_sequence out;
  out.tokens = length == task_->seq_len() ? task_->sample(seed_, static_cast<std::uint64_t>(index)).tokens
                                          : passkey_task(length).sample(seed_, static_cast<std::uint64_t>(index)).tokens;
  return out;
}

int run_data::skip(data_position& at, std::int64_t length) const {
  if (!reader_) return 0;
  const int source = static_cast<int>(reader_->layout().next_source(at));
  reader_->layout().advance(at, static_cast<std::size_t>(source), length);
  return source;
}

void record_data(const train_options& o, const run_data& data, const data_position& at, const data_position& shape_at,
                 trainer_state& st) {
  const data_reader* r = data.reader();
  st.packing = packing_name(r);
  st.min_doc_tokens = o.min_doc_tokens;
  st.mixture.clear();
  if (r == nullptr) {
    st.data = "passkey";
    st.data_bytes = 0;
    st.data_position = st.shape_position = 0;
    return;
  }
  if (r->size() == 1) {
    st.data = r->spec(0).path;
    st.data_bytes = file_bytes(r->tokens_file(0));
    st.data_position = at.tokens[0];
    st.shape_position = shape_at.tokens[0];
    return;
  }
  st.data = data_sources_text(r->specs());
  st.data_bytes = st.data_position = st.shape_position = 0;
  for (std::size_t i = 0; i < r->size(); ++i) {
    const std::uint64_t bytes = file_bytes(r->tokens_file(i));
    st.mixture.push_back({r->spec(i).path, r->spec(i).weight, bytes, at.sequences[i], at.tokens[i],
                          shape_at.sequences[i], shape_at.tokens[i]});
    st.data_bytes += bytes;
    st.data_position += at.tokens[i];
    st.shape_position += shape_at.tokens[i];
  }
}

data_position saved_position(const trainer_state& st, bool shape) {
  if (st.mixture.empty()) return {{0}, {shape ? st.shape_position : st.data_position}};
  data_position at;
  for (const auto& m : st.mixture) {
    at.sequences.push_back(shape ? m.shape_sequences : m.sequences);
    at.tokens.push_back(shape ? m.shape_position : m.position);
  }
  return at;
}

void check_resumed_data(const train_options& o, const saved_state& saved) {
  check_same_sources(o, saved.state(), parse_data_sources(o.data_path, "--data"));
  check_resumed_position(o, saved);
}

}  // namespace upipe
