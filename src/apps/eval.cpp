// `upipe eval`: a model's long-context evaluation under CP, forward only (the weights and
// nothing of training's state).
//   held-out loss: at one or more lengths, on each of a user's data sources, mean loss,
//     perplexity and the loss by position in the context in power-of-two buckets (with the
//     targets in each), on the targets of the loss mask only where a corpus has one;
//   --niah: needle in a haystack, a key planted at each depth of a context of each length
//     and asked for at the end, scored by teacher forcing (exact match, the key's tokens
//     right, their mean log-probability) over several samples per cell.
// Both print a table and write JSON (`upipe report` draws them). Progress and an ETA go to
// stderr; Ctrl-C stops at the next sequence and keeps what was scored.
#include <algorithm>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/moe_flags.hpp"
#include "apps/commands.hpp"
#include "apps/flag_checks.hpp"
#include "apps/cp_flags.hpp"
#include "apps/run_config.hpp"
#include "apps/json_file.hpp"
#include "apps/model_flags.hpp"
#include "apps/niah_text_script.hpp"
#include "apps/python.hpp"
#include "apps/sizes.hpp"
#include "core/error.hpp"
#include "train/run_directory.hpp"
#include "core/limits.hpp"
#include "model/adapter_files.hpp"
#include "model/hf_model.hpp"
#include "model/model_step.hpp"
#include "train/data.hpp"
#include "train/data_reader.hpp"
#include "train/niah.hpp"

namespace upipe::apps {

namespace {

// The options eval shares with train (model, data, CP group, sizes, seed) are rows of the
// run configuration; the rest are eval's own.
struct eval_flags {
  std::shared_ptr<run_options> options;
  std::string weights_path, adapter_path, json_path, seq_lens = "1K", depths = "0,0.25,0.5,0.75,1", niah_vocab = "auto";
  bool niah = false;
  int samples = 4;
  const run_config& cfg() const { return options->config(); }
};

// Ctrl-C: the first asks the ranks to stop at the next sequence; a second ends the process.
std::atomic<bool> interrupted{false};
extern "C" void on_interrupt(int) {
  interrupted.store(true);
  std::signal(SIGINT, SIG_DFL);
}

// Sum and count of the losses of targets at positions [2^k, 2^(k+1)) (a target at
// position p predicts the p-th token of its document, or of the window in a stream).
struct buckets {
  std::vector<double> sum;
  std::vector<std::int64_t> count;
  void add(std::int64_t position, double loss) {
    const auto k = static_cast<std::size_t>(std::bit_width(static_cast<std::uint64_t>(position)) - 1);
    if (sum.size() <= k) {
      sum.resize(k + 1, 0.0);
      count.resize(k + 1, 0);
    }
    sum[k] += loss;
    ++count[k];
  }
};

// The lengths, and the host memory a length's sequences take (the tokens, the padded ids
// and labels, each rank's shard: 24 bytes a token, `samples` sequences at a time) checked
// against the machine before any is built.
std::vector<std::int64_t> parse_lengths(const std::string& text, int samples) {
  std::vector<std::int64_t> out;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    out.push_back(parse_scored_seq_len(text.substr(start, comma - start)));
    require_host_memory(static_cast<std::size_t>(out.back()) * static_cast<std::size_t>(samples) * 24,
                        "the host copies of --samples " + std::to_string(samples) + " sequences of --seq-len " +
                            std::to_string(out.back()) + " tokens");
    start = comma + 1;
  }
  return out;
}

// Progress of one length's sequences on stderr: a line rewritten in place on a terminal,
// else a line every 10 seconds.
class progress_line {
 public:
  progress_line(std::string what, std::size_t total) : what_(std::move(what)), total_(total) {}
  void update(std::size_t done) {
    const auto now = std::chrono::steady_clock::now();
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    if (!tty_ && std::chrono::duration<double>(now - last_).count() < 10 && done < total_) return;
    last_ = now;
    const double eta = done > 0 ? elapsed / static_cast<double>(done) * static_cast<double>(total_ - done) : 0;
    std::fprintf(stderr, "%s  %s: %zu/%zu sequences  %.1f s  ETA %.0f s%s", tty_ ? "\r" : "", what_.c_str(), done,
                 total_, elapsed, eta, tty_ ? "   " : "\n");
    if (tty_ && done == total_) std::fputc('\n', stderr);
  }

 private:
  std::string what_;
  std::size_t total_;
  bool tty_ = ::isatty(STDERR_FILENO) == 1;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(), last_ = start_;
};

// The model, its weights and the request every length shares.
struct eval_setup {
  model_step_request req;
  host_weights random;
  std::unique_ptr<weight_source> weights;
  std::unique_ptr<weight_source> adapters;  // --adapter's LoRA adapters beside the base (null without)
  std::string directory;  // the model directory (its tokenizer), empty for a preset
};

// --adapter DIR: a PEFT LoRA adapter directory (upipe train --lora --save, or PEFT's
// save_pretrained; a run directory means its latest), evaluated beside the base unmerged.
std::string adapter_directory(const eval_flags& f) {
  if (f.adapter_path.empty()) return "";
  const std::string dir = resolve_checkpoint(f.adapter_path);
  if (!is_adapter_directory(dir))
    throw config_error("--adapter " + f.adapter_path + " holds no " + adapter_config_file + ": give a LoRA adapter "
                       "directory (upipe train --lora --save DIR, or PEFT's save_pretrained)");
  return dir;
}

// The model: --model or --config, else the base an --adapter names, else tiny-llama.
std::string model_name(const eval_flags& f, const std::string& adapter) {
  if (!f.cfg().model.empty() || !f.cfg().config.empty()) return f.cfg().model;
  if (!adapter.empty()) {
    const std::string base = adapter_base_model(adapter);
    if (base.empty())
      throw config_error(adapter + "/" + adapter_config_file + " names no base model (base_model_name_or_path): pass "
                         "the base it was trained on as --model");
    return base;
  }
  return "tiny-llama";
}

eval_setup setup(const eval_flags& f) {
  eval_setup s;
  const std::string adapter = adapter_directory(f);
  const std::string model = model_name(f, adapter);
  s.req.model = load_model(model, f.cfg().config, f.cfg().layers);
  if (!adapter.empty()) {  // lora_dropout is off in evaluation, as in PEFT's eval mode
    s.req.options.lora = read_adapter_config(adapter, s.req.model).lora;
    s.adapters = std::make_unique<adapter_files>(adapter, s.req.model, s.req.options.lora);
  }
  s.req.backend = parse_backend_kind(f.cfg().backend);
  s.req.cp = cp_of(f.cfg());
  require_within(f.samples, 1, limits::samples, "--samples", "8");
  std::int64_t longest = 0;
  for (const std::int64_t L : parse_lengths(f.seq_lens, f.samples)) longest = std::max(longest, L);
  // Forward only: checkpoints on the device, the default host pool.
  const lora_config lora = s.req.options.lora;
  s.req.options = {f.cfg().mlp_tile, f.cfg().loss_chunk, checkpoint_policy{}};
  s.req.options.lora = lora;
  s.req.options.attention_arithmetic = parse_attention_dtype(f.cfg().attention_dtype);
  const resolved_step resolved = resolve_step(sizes_of(s.req, longest, f.cfg().memory_gib, 0));
  s.req.options = resolved.step;
  s.req.options.lora = lora;
  apply_moe(f.cfg(), s.req.options);
  s.req.limits = resolved.limits;
  s.directory = model_directory(model, f.cfg().config);
  const std::string weights_path =
      f.weights_path.empty() ? default_weights(model, f.cfg().config) : resolve_checkpoint(f.weights_path);
  if (weights_path.empty()) {
    s.random = random_weights(s.req.model, f.cfg().seed);
    s.weights = std::make_unique<host_weight_source>(s.random);
  } else {
    s.weights = std::make_unique<hf_model_files>(weights_path, s.req.model);
  }
  return s;
}

// Runs one length's sequences with progress and Ctrl-C; false when interrupted (the
// result then holds the first result.completed).
bool run_length(const eval_setup& s, const std::vector<eval_sequence>& seqs, const std::string& what, eval_result& r) {
  progress_line line(what, seqs.size());
  r = evaluate(s.req, *s.weights, seqs, {[&](std::size_t done) { line.update(done); }, [] { return interrupted.load(); }},
               s.adapters.get());
  return r.completed == seqs.size();
}

void write_json(const std::string& path, const nlohmann::json& out) {
  if (!path.empty()) write_json_file(path, out, 1);
}

// One source's windows of S tokens: --samples consecutive windows from its start, each with
// its documents (when packed as documents) and loss mask; fewer where the source holds fewer,
// so that each token is scored once (no window wraps around to the data's start).
std::vector<eval_sequence> windows(const data_reader& reader, std::size_t source, std::int64_t S, int samples) {
  const std::int64_t tokens = reader.epoch_tokens(source);
  const std::string& name = reader.spec(source).path;
  if (tokens < S)
    throw config_error("--seq-len " + std::to_string(S) + " is longer than " + name + "'s " + std::to_string(tokens) +
                       " tokens: every window would repeat the data; use a --seq-len of at most " +
                       std::to_string(tokens));
  const int count = static_cast<int>(reader.whole_windows(source, S, samples));
  if (count < samples)
    std::printf("# S %lld: %s holds %lld tokens, %d whole window(s), not --samples %d: each token is scored once\n",
                static_cast<long long>(S), name.c_str(), static_cast<long long>(tokens), count, samples);
  std::vector<eval_sequence> seqs;
  for (int i = 0; i < count; ++i) {
    packed_sequence w = reader.read(source, static_cast<std::int64_t>(i) * S, S);
    eval_sequence seq;
    seq.tokens = std::move(w.tokens);
    if (reader.documents(source)) seq.documents = std::move(w.documents);
    seq.targets = std::move(w.targets);
    seqs.push_back(std::move(seq));
  }
  return seqs;
}

// The loss of one source's windows at one length: printed, and its JSON row (null when none
// was scored). Targets the loss mask leaves out are not scored (their loss is NaN) and are
// counted apart; the position of a target is its place in its document.
nlohmann::json score_windows(const std::vector<eval_sequence>& seqs, const eval_result& r, std::int64_t S) {
  buckets by_position;
  double sum = 0;
  std::int64_t targets = 0, masked = 0;
  for (std::size_t i = 0; i < r.completed; ++i) {
    std::size_t doc = 0;
    for (std::size_t t = 0; t < r.target_loss[i].size(); ++t) {
      const float loss = r.target_loss[i][t];
      if (std::isnan(loss)) {
        masked += !seqs[i].targets.empty() && seqs[i].targets[t + 1] == 0 ? 1 : 0;
        continue;
      }
      while (doc + 1 < seqs[i].documents.size() && seqs[i].documents[doc + 1] <= static_cast<std::int64_t>(t)) ++doc;
      const std::int64_t first = seqs[i].documents.empty() ? 0 : seqs[i].documents[doc];
      by_position.add(static_cast<std::int64_t>(t) + 1 - first, loss);
      sum += loss;
      ++targets;
    }
  }
  if (targets == 0 && r.completed > 0)  // a loss over no targets would read as 0
    throw config_error("the " + std::to_string(r.completed) + " sequences of " + std::to_string(S) + " tokens hold no "
                       "token to predict (documents of one token each, or every target masked): evaluate documents "
                       "of several tokens, or use --packing stream");
  const double mean = sum / static_cast<double>(std::max<std::int64_t>(targets, 1));
  std::printf("\nS %lld: loss %.5f  perplexity %.3f  over %lld targets of %zu sequences", static_cast<long long>(S), mean,
              std::exp(mean), static_cast<long long>(targets), r.completed);
  if (masked > 0) std::printf(" (%lld more left out by the loss mask)", static_cast<long long>(masked));
  std::printf("  (%.1f s)\n  %-20s %10s %12s\n", r.seconds, "positions", "loss", "targets");
  nlohmann::json rows = nlohmann::json::array();
  for (std::size_t k = 0; k < by_position.sum.size(); ++k) {
    if (by_position.count[k] == 0) continue;
    const double loss = by_position.sum[k] / static_cast<double>(by_position.count[k]);
    const std::int64_t lo = std::int64_t{1} << k, hi = (std::int64_t{1} << (k + 1)) - 1;
    std::printf("  %-20s %10.5f %12lld\n", (std::to_string(lo) + "-" + std::to_string(hi)).c_str(), loss,
                static_cast<long long>(by_position.count[k]));
    rows.push_back({{"first", lo}, {"last", hi}, {"loss", loss}, {"targets", by_position.count[k]}});
  }
  if (r.completed == 0) return nullptr;
  return {{"seq_len", S}, {"loss", mean}, {"perplexity", std::exp(mean)}, {"targets", targets}, {"masked", masked},
          {"sequences", r.completed}, {"seconds", r.seconds}, {"by_position", rows}, {"peak_bytes", r.peak_bytes},
          {"arena_high_water_bytes", r.arena_high_water}};
}

int held_out_loss(const eval_flags& f, const eval_setup& s) {
  if (f.cfg().data.empty())
    throw config_error("upipe eval needs --data PREFIX (a corpus from upipe prepare-data) or FILE, or --niah");
  const std::vector<data_source_spec> specs = parse_data_sources(f.cfg().data, "--data");
  for (const data_source_spec& d : specs)
    if (d.weight != 1.0)
      throw config_error("--data " + f.cfg().data + ": each source is evaluated on its own, so a weight (" + d.path +
                         ") means nothing; list them without weights, e.g. --data chat-heldout,books-heldout");
  for (const data_source_spec& d : specs)
    check_data_tokenizer(s.directory, d.path, "--data", f.cfg().allow_tokenizer_mismatch);
  const std::vector<std::int64_t> lengths = parse_lengths(f.seq_lens, f.samples);
  const packing_mode packing = f.cfg().packing == "documents" ? packing_mode::documents
                               : f.cfg().packing == "stream"  ? packing_mode::stream
                                                        : packing_mode::automatic;
  // One reader per length (a token file's sequences are of one length), every one opened
  // before any length runs.
  std::vector<data_reader> readers;
  for (const std::int64_t S : lengths) readers.emplace_back(specs, data_reader::options{s.req.model.vocab_size, S, 0, packing, f.cfg().seed});
  const data_reader& first = readers.front();
  std::string packed;
  for (std::size_t d = 0; d < first.size(); ++d) packed += (d ? "," : "") + std::string(first.documents(d) ? "documents" : "stream");
  nlohmann::json out = {{"model", s.req.model.name}, {"data", f.cfg().data}, {"packing", packed},
                        {"strategy", f.cfg().attention}, {"cp", f.cfg().cp}, {"lengths", nlohmann::json::array()}};
  std::printf("# upipe eval  model=%s  data=%s (%s)  %s cp=%d  backend=%s  %d sequences per length, forward only\n",
              s.req.model.name.c_str(), f.cfg().data.c_str(), packed.c_str(), f.cfg().attention.c_str(), f.cfg().cp,
              f.cfg().backend.c_str(), f.samples);
  for (std::size_t d = 0; d < first.size(); ++d) {
    if (first.size() > 1) std::printf("\n## %s%s\n", specs[d].path.c_str(), first.masked(d) ? " (loss mask)" : "");
    for (std::size_t l = 0; l < lengths.size(); ++l) {
      const std::int64_t S = lengths[l];
      const std::vector<eval_sequence> seqs = windows(readers[l], d, S, f.samples);
      eval_result r;
      const bool whole = run_length(s, seqs, "S " + std::to_string(S), r);
      nlohmann::json row = score_windows(seqs, r, S);
      if (!row.is_null()) {
        row["data"] = specs[d].path;
        out["lengths"].push_back(std::move(row));
      }
      if (!whole) {
        out["interrupted"] = true;
        write_json(f.json_path, out);
        std::fprintf(stderr, "upipe eval: interrupted at S %lld after %zu of %zu sequences%s\n",
                     static_cast<long long>(S), r.completed, seqs.size(),
                     f.json_path.empty() ? "" : ("; the results so far are in " + f.json_path).c_str());
        return 130;
      }
    }
  }
  write_json(f.json_path, out);
  return 0;
}

// The needles' text in the model tokenizer's tokens (scripts/niah_text.py), one per key.
struct tokenized_needles {
  std::vector<std::int32_t> prefix, haystack;
  std::vector<needle_text> needles;
};

tokenized_needles tokenize_needles(const std::string& model_dir, const std::vector<std::string>& keys, bool haystack) {
  if (spawn({"python3", "-c", "import tokenizers"}, "upipe eval --niah") != 0)
    throw config_error("upipe eval --niah with text needs Hugging Face tokenizers for python3: scripts/setup-deps "
                       "installs it (or: python3 -m pip install tokenizers)");
  std::string joined;
  for (const std::string& k : keys) joined += (joined.empty() ? "" : ",") + k;
  std::vector<std::string> args = {"--tokenizer", model_dir, "--out", output_placeholder, "--keys", joined};
  if (!haystack) args.push_back("--no-haystack");
  const python_result r = run_python_for_output(niah_text_script, "niah_text.py", args);
  if (r.status != 0) throw config_error("the needles could not be tokenized (the message above says why)");
  const nlohmann::json doc = nlohmann::json::parse(r.output, nullptr, false);
  if (doc.is_discarded()) throw io_error("niah_text.py wrote no JSON");
  tokenized_needles t;
  t.prefix = doc["prefix"].get<std::vector<std::int32_t>>();
  t.haystack = doc["haystack"].get<std::vector<std::int32_t>>();
  for (const auto& n : doc["needles"])
    t.needles.push_back({n["key"].get<std::string>(), n["needle"].get<std::vector<std::int32_t>>(),
                         n["question"].get<std::vector<std::int32_t>>(), n["answer"].get<std::vector<std::int32_t>>()});
  return t;
}

int needle_in_a_haystack(const eval_flags& f, const eval_setup& s) {
  if (f.niah_vocab != "auto" && f.niah_vocab != "text" && f.niah_vocab != "passkey")
    throw config_error("--niah-vocab " + f.niah_vocab + " is not known: use text (the model's tokenizer) or passkey");
  std::error_code unreadable;  // a link loop: no tokenizer (load_model refused it already)
  const bool has_tokenizer = !s.directory.empty() && std::filesystem::is_regular_file(s.directory + "/tokenizer.json", unreadable);
  const bool passkey = f.niah_vocab == "passkey" || (f.niah_vocab == "auto" && !has_tokenizer);
  if (!passkey && !has_tokenizer)
    throw config_error("--niah-vocab text needs the model directory's tokenizer.json (--model DIR); for a model "
                       "trained on the passkey task use --niah-vocab passkey");
  if (passkey && s.req.model.vocab_size < passkey_task::vocab_needed)
    throw config_error("the passkey needle needs a vocabulary of at least " + std::to_string(passkey_task::vocab_needed) +
                       " ids; the model has " + std::to_string(s.req.model.vocab_size));
  if (passkey && !f.cfg().data.empty())
    throw config_error("--data is the haystack of text needles; the passkey needle's haystack is the task's own filler "
                       "(drop --data, or use --niah-vocab text)");
  const std::vector<std::int64_t> lengths = parse_lengths(f.seq_lens, f.samples);
  const std::vector<double> depths = parse_depths(f.depths);
  for (const std::int64_t L : lengths)
    if (passkey) passkey_task check(L);  // throws with the minimum length

  // Every cell's samples get keys of their own: sample j of (length i, depth k) is index
  // (i * depths + k) * samples + j.
  const auto index = [&](std::size_t i, std::size_t k, int j) {
    return (static_cast<std::uint64_t>(i) * depths.size() + k) * static_cast<std::uint64_t>(f.samples) +
           static_cast<std::uint64_t>(j);
  };
  tokenized_needles text;
  std::unique_ptr<document_corpus> corpus;
  if (!passkey) {
    std::vector<std::string> keys;
    for (std::size_t i = 0; i < lengths.size(); ++i)
      for (std::size_t k = 0; k < depths.size(); ++k)
        for (int j = 0; j < f.samples; ++j) keys.push_back(needle_key(f.cfg().seed, index(i, k, j)));
    if (!f.cfg().data.empty()) {
      check_data_tokenizer(s.directory, f.cfg().data, "--data", f.cfg().allow_tokenizer_mismatch);
      if (document_corpus::exists(f.cfg().data))
        corpus = std::make_unique<document_corpus>(f.cfg().data, s.req.model.vocab_size, 0, f.cfg().seed);
      else
        for (const std::int64_t L : lengths) token_file check(f.cfg().data, L, s.req.model.vocab_size);
    }
    text = tokenize_needles(s.directory, keys, f.cfg().data.empty());
  }
  std::printf("# upipe eval --niah  model=%s  needle=%s  haystack=%s  %s cp=%d  backend=%s  %d samples per cell\n",
              s.req.model.name.c_str(), passkey ? "passkey" : "text",
              passkey ? "the passkey filler" : f.cfg().data.empty() ? "built-in text" : f.cfg().data.c_str(),
              f.cfg().attention.c_str(), f.cfg().cp, f.cfg().backend.c_str(), f.samples);
  struct cell {
    int samples = 0;
    double exact = 0, right = 0, log_prob = 0;  // sums over the samples
  };
  std::vector<std::vector<cell>> cells(lengths.size(), std::vector<cell>(depths.size()));
  bool whole = true;
  for (std::size_t i = 0; i < lengths.size() && whole; ++i) {
    const std::int64_t L = lengths[i];
    std::unique_ptr<token_file> stream;
    if (!passkey && !f.cfg().data.empty() && !corpus) stream = std::make_unique<token_file>(f.cfg().data, L, s.req.model.vocab_size);
    std::vector<needle_case> cases;
    std::vector<eval_sequence> seqs;
    for (std::size_t k = 0; k < depths.size(); ++k)
      for (int j = 0; j < f.samples; ++j) {
        const auto from = static_cast<std::int64_t>(j) * L;  // sample j's haystack: the data's j-th window
        if (passkey)
          cases.push_back(passkey_needle(L, depths[k], f.cfg().seed, index(i, k, j)));
        else
          cases.push_back(text_needle(text.prefix, corpus ? corpus->window(from, L).tokens  // documents joined: one context
                                                   : stream ? stream->sequence(from) : text.haystack,
                                      text.needles[index(i, k, j)], L, depths[k]));
        eval_sequence seq{cases.back().tokens, {}, {}};
        for (const std::int64_t a : cases.back().answer) seq.argmax_at.push_back(a - 1);
        seqs.push_back(std::move(seq));
      }
    eval_result r;
    whole = run_length(s, seqs, "S " + std::to_string(L), r);
    for (std::size_t c = 0; c < r.completed; ++c) {
      std::vector<float> log_probs;
      for (const std::int64_t a : cases[c].answer) log_probs.push_back(-r.target_loss[c][static_cast<std::size_t>(a - 1)]);
      const needle_score sc = score_needle(cases[c], r.argmax[c], log_probs);
      cell& into = cells[i][c / static_cast<std::size_t>(f.samples)];
      ++into.samples;
      into.exact += sc.exact ? 1 : 0;
      into.right += sc.token_accuracy;
      into.log_prob += sc.mean_log_prob;
    }
    if (!whole)
      std::fprintf(stderr, "upipe eval: interrupted at S %lld after %zu of %zu sequences\n", static_cast<long long>(L),
                   r.completed, seqs.size());
  }
  // The table: exact match, and in parentheses the fraction of key tokens right.
  std::printf("\nexact match (key tokens right) by depth and length\n  %-8s", "depth");
  for (const std::int64_t L : lengths) std::printf(" %16lld", static_cast<long long>(L));
  std::printf("\n");
  nlohmann::json rows = nlohmann::json::array();
  double right = 0, log_prob = 0;
  int scored = 0;
  for (std::size_t k = 0; k < depths.size(); ++k) {
    std::printf("  %-8.3g", depths[k]);
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      const cell& c = cells[i][k];
      if (c.samples == 0) {
        std::printf(" %16s", "-");
        continue;
      }
      std::printf("    %5.3f (%5.3f)", c.exact / c.samples, c.right / c.samples);
      rows.push_back({{"seq_len", lengths[i]}, {"depth", depths[k]}, {"samples", c.samples},
                      {"exact_match", c.exact / c.samples}, {"token_accuracy", c.right / c.samples},
                      {"mean_log_prob", c.log_prob / c.samples}});
      right += c.right;
      log_prob += c.log_prob;
      scored += c.samples;
    }
    std::printf("\n");
  }
  const double n = std::max(scored, 1);
  std::printf("\nkey tokens right over %d needles %.3f, mean log-probability %.3f\n", scored, right / n, log_prob / n);
  nlohmann::json out = {{"model", s.req.model.name}, {"needle", passkey ? "passkey" : "text"},
                        {"haystack", passkey ? "passkey" : f.cfg().data.empty() ? "built-in" : f.cfg().data},
                        {"strategy", f.cfg().attention}, {"cp", f.cfg().cp}, {"samples", f.samples}, {"seed", f.cfg().seed},
                        {"token_accuracy", right / n}, {"mean_log_prob", log_prob / n}, {"cells", rows}};
  if (!whole) out["interrupted"] = true;
  write_json(f.json_path, {{"niah", out}});
  if (!whole && !f.json_path.empty()) std::fprintf(stderr, "upipe eval: the results so far are in %s\n", f.json_path.c_str());
  return whole ? 0 : 130;
}

int run(const eval_flags& f) {
  const eval_setup s = setup(f);
  interrupted.store(false);
  std::signal(SIGINT, on_interrupt);
  const int status = f.niah ? needle_in_a_haystack(f, s) : held_out_loss(f, s);
  std::signal(SIGINT, SIG_DFL);
  return status;
}

}  // namespace

command_runner add_eval(CLI::App& app) {
  auto f = std::make_shared<eval_flags>();
  f->options = std::make_shared<run_options>(app, for_eval);
  app.add_option("--weights", f->weights_path, "weights (a model directory or checkpoint; default the --model directory's)")
      ->check(path_flag());
  app.add_option("--adapter", f->adapter_path,
                 "a LoRA adapter directory (upipe train --lora --save, or PEFT's save_pretrained) evaluated beside the "
                 "base without merging (its base is --model, else the one adapter_config.json names)")
      ->check(path_flag());
  app.add_option("--seq-len,--lengths", f->seq_lens, "lengths, comma-separated (K and M suffixes), e.g. 4K,32K,128K")
      ->capture_default_str();
  app.add_option("--samples", f->samples, "sequences per length (with --niah: per depth and length)")
      ->capture_default_str();
  app.add_flag("--niah", f->niah, "needle in a haystack: a key planted at each of --depths, asked for at the end");
  app.add_option("--depths", f->depths, "with --niah: where the needle goes, fractions of the context")
      ->capture_default_str();
  app.add_option("--niah-vocab", f->niah_vocab,
                 "with --niah: text (the model's tokenizer) or passkey (the passkey task's ids); auto: text where the "
                 "model directory has tokenizer.json")
      ->capture_default_str();
  app.add_option("--json", f->json_path, "write the results as JSON")->check(output_file_flag("--json"));
  return [f] { return f->options->run([&] { return run(*f); }); };
}

}  // namespace upipe::apps
