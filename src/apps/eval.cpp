// `upipe eval`: held-out loss of a model on a user's data, forward only (the weights and
// nothing of training's state), at one or more sequence lengths under CP: mean loss,
// perplexity, and the loss by position in the context in power-of-two buckets (with the
// targets in each), as a table and as JSON.
#include <bit>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/commands.hpp"
#include "apps/model_flags.hpp"
#include "apps/sizes.hpp"
#include "core/error.hpp"
#include "model/hf_model.hpp"
#include "model/model_step.hpp"
#include "train/data.hpp"

namespace upipe::apps {

namespace {

struct eval_flags {
  std::string model, config_path, weights_path, data_path, json_path, backend = "cpu", attention = "upipe",
                                                                      seq_lens = "1K", packing = "auto";
  int cp = 1, head_chunk = 0, samples = 4;
  std::int64_t mlp_tile = 0, loss_chunk = 0;
  double memory_gib = 8;
  unsigned long long seed = 1;
};

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

std::vector<std::int64_t> parse_lengths(const std::string& text) {
  std::vector<std::int64_t> out;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    out.push_back(parse_count(text.substr(start, comma - start), "--seq-len"));
    start = comma + 1;
  }
  return out;
}

int run(const eval_flags& f) {
  model_step_request req;
  req.model = load_model(f.model.empty() ? "tiny-llama" : f.model, f.config_path);
  req.backend = parse_backend_kind(f.backend);
  req.cp = {parse_strategy_kind(f.attention), f.cp, f.head_chunk};
  req.options = sized_for_gpu({f.mlp_tile, f.loss_chunk, checkpoint_policy{}}, req.model, f.memory_gib);
  req.limits = run_limits(req.backend, f.memory_gib, checkpoint_location::device);
  if (f.data_path.empty()) throw config_error("upipe eval needs --data PREFIX (a corpus from upipe prepare-data) or FILE");
  if (f.samples < 1) throw config_error("--samples " + std::to_string(f.samples) + " must be at least 1 (e.g. 8)");
  if (f.packing != "auto" && f.packing != "documents" && f.packing != "stream")
    throw config_error("--packing " + f.packing + " is not known: use documents or stream");
  const std::string weights_path = f.weights_path.empty() ? model_directory(f.model, f.config_path) : f.weights_path;
  host_weights random;
  std::unique_ptr<weight_source> weights;
  if (weights_path.empty()) {
    random = random_weights(req.model, f.seed);
    weights = std::make_unique<host_weight_source>(random);
  } else {
    weights = std::make_unique<hf_model_files>(weights_path, req.model);
  }
  const bool documents = f.packing != "stream" && document_corpus::exists(f.data_path);
  if (f.packing == "documents" && !documents)
    throw config_error("--packing documents needs " + f.data_path + ".index (upipe prepare-data writes it)");
  std::unique_ptr<document_corpus> corpus;
  if (document_corpus::exists(f.data_path)) corpus = std::make_unique<document_corpus>(f.data_path, req.model.vocab_size, 0, f.seed);
  nlohmann::json out = {{"model", req.model.name}, {"data", f.data_path}, {"packing", documents ? "documents" : "stream"},
                        {"strategy", f.attention}, {"cp", f.cp}, {"lengths", nlohmann::json::array()}};
  std::printf("# upipe eval  model=%s  data=%s (%s)  %s cp=%d  backend=%s  %d sequences per length, forward only\n",
              req.model.name.c_str(), f.data_path.c_str(), documents ? "documents" : "stream", f.attention.c_str(), f.cp,
              f.backend.c_str(), f.samples);
  for (const std::int64_t S : parse_lengths(f.seq_lens)) {
    std::unique_ptr<token_file> file;
    if (!corpus) file = std::make_unique<token_file>(f.data_path, S, req.model.vocab_size);
    std::vector<eval_sequence> seqs;
    for (int i = 0; i < f.samples; ++i) {
      eval_sequence s;
      if (corpus) {
        packed_sequence w = corpus->window(static_cast<std::int64_t>(i) * S, S);
        s.tokens = std::move(w.tokens);
        if (documents) s.documents = std::move(w.documents);
      } else {
        s.tokens = file->sequence(static_cast<std::int64_t>(i) * S);
      }
      seqs.push_back(std::move(s));
    }
    const eval_result r = evaluate(req, *weights, seqs);
    buckets by_position;
    double sum = 0;
    std::int64_t targets = 0;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      std::size_t doc = 0;
      for (std::size_t t = 0; t < r.target_loss[i].size(); ++t) {
        const float loss = r.target_loss[i][t];
        if (std::isnan(loss)) continue;
        while (doc + 1 < seqs[i].documents.size() && seqs[i].documents[doc + 1] <= static_cast<std::int64_t>(t)) ++doc;
        const std::int64_t first = seqs[i].documents.empty() ? 0 : seqs[i].documents[doc];
        by_position.add(static_cast<std::int64_t>(t) + 1 - first, loss);
        sum += loss;
        ++targets;
      }
    }
    const double mean = targets > 0 ? sum / static_cast<double>(targets) : 0.0;
    std::printf("\nS %lld: loss %.5f  perplexity %.3f  over %lld targets  (%.1f s)\n", static_cast<long long>(S), mean,
                std::exp(mean), static_cast<long long>(targets), r.seconds);
    std::printf("  %-20s %10s %12s\n", "positions", "loss", "targets");
    nlohmann::json rows = nlohmann::json::array();
    for (std::size_t k = 0; k < by_position.sum.size(); ++k) {
      if (by_position.count[k] == 0) continue;
      const double loss = by_position.sum[k] / static_cast<double>(by_position.count[k]);
      const std::int64_t lo = std::int64_t{1} << k, hi = (std::int64_t{1} << (k + 1)) - 1;
      std::printf("  %-20s %10.5f %12lld\n", (std::to_string(lo) + "-" + std::to_string(hi)).c_str(), loss,
                  static_cast<long long>(by_position.count[k]));
      rows.push_back({{"first", lo}, {"last", hi}, {"loss", loss}, {"targets", by_position.count[k]}});
    }
    out["lengths"].push_back({{"seq_len", S}, {"loss", mean}, {"perplexity", std::exp(mean)}, {"targets", targets},
                              {"seconds", r.seconds}, {"by_position", rows}, {"peak_bytes", r.peak_bytes},
                              {"arena_high_water_bytes", r.arena_high_water}});
  }
  if (!f.json_path.empty()) {
    std::ofstream file(f.json_path);
    file << out.dump(1) << "\n";
    if (!file) throw io_error("cannot write --json " + f.json_path);
  }
  return 0;
}

}  // namespace

command_runner add_eval(CLI::App& app) {
  auto f = std::make_shared<eval_flags>();
  add_model_flags(app, f->model, f->config_path);
  app.add_option("--weights", f->weights_path, "weights (a model directory or checkpoint; default the --model directory's)");
  app.add_option("--data", f->data_path, "held-out data: a corpus PREFIX from upipe prepare-data, or a uint32 token file")
      ->required();
  app.add_option("--seq-len", f->seq_lens, "lengths, comma-separated (K and M suffixes), e.g. 4K,32K,128K")
      ->capture_default_str();
  app.add_option("--samples", f->samples, "sequences per length, consecutive windows from the start")->capture_default_str();
  app.add_option("--packing", f->packing, "documents (positions and attention per document) or stream")->capture_default_str();
  app.add_option("--attention", f->attention, "ulysses, upipe or ring")->capture_default_str();
  app.add_option("--cp", f->cp, "ranks in the CP group")->capture_default_str();
  app.add_option("--head-chunk", f->head_chunk, "U for upipe (0: C)");
  app.add_option("--backend", f->backend, "cpu or cuda")->capture_default_str();
  app.add_option("--mlp-tile", f->mlp_tile, mlp_tile_help);
  app.add_option("--loss-chunk", f->loss_chunk, loss_chunk_help);
  app.add_option("--memory-gib", f->memory_gib, "arena per rank, GiB")->capture_default_str();
  app.add_option("--seed", f->seed, "seed of random weights (without --model DIR)")->capture_default_str();
  app.add_option("--json", f->json_path, "write the results as JSON");
  return [f] { return run(*f); };
}

}  // namespace upipe::apps
