// Corpora of documents (upipe prepare-data's format): windows over the documents in a
// shuffled order, epoch after epoch, documents marked; and the checks before training.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "train/data.hpp"
#include "train/trainer.hpp"
#include "train_support.hpp"

namespace upipe {
namespace {

namespace fs = std::filesystem;

// Writes PREFIX.tokens/.index/.json for documents of the given lengths; document d's
// tokens are 10 * d + i % 7 (so a token tells its document), below `vocab`.
std::string write_corpus(const fs::path& dir, const std::vector<std::int64_t>& lengths, std::int64_t vocab = 256,
                         const std::string& dtype = "uint32") {
  fs::create_directories(dir);
  const std::string prefix = (dir / "corpus").string();
  std::ofstream tokens(prefix + ".tokens", std::ios::binary), index(prefix + ".index", std::ios::binary);
  std::uint64_t offset = 0;
  index.write(reinterpret_cast<const char*>(&offset), 8);
  for (std::size_t d = 0; d < lengths.size(); ++d) {
    for (std::int64_t i = 0; i < lengths[d]; ++i) {
      const std::uint32_t id = static_cast<std::uint32_t>((10 * d + i % 7) % 250);
      tokens.write(reinterpret_cast<const char*>(&id), 4);
    }
    offset += static_cast<std::uint64_t>(lengths[d]);
    index.write(reinterpret_cast<const char*>(&offset), 8);
  }
  const nlohmann::json m = {{"format", "upipe-tokens"}, {"version", 1}, {"dtype", dtype}, {"vocab_size", vocab},
                            {"documents", lengths.size()}, {"tokens", offset}};
  std::ofstream(prefix + ".json") << m.dump();
  return prefix;
}

fs::path scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("upipe_corpus_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir;
}

TEST(document_corpus, windows_walk_the_shuffled_documents_epoch_after_epoch) {
  const fs::path dir = scratch("windows");
  const std::vector<std::int64_t> lengths = {5, 1, 40, 12, 7, 3, 19};  // 87 tokens
  const std::string prefix = write_corpus(dir, lengths);
  const document_corpus corpus(prefix, 256, 0, 11);
  EXPECT_EQ(corpus.epoch_tokens(), 87);
  // Three epochs of 16-token windows, concatenated, are three permutations of the documents.
  std::vector<std::int32_t> stream;
  std::vector<std::int64_t> starts;  // in the stream
  for (std::int64_t p = 0; p < 3 * 87; p += 16) {
    const packed_sequence w = corpus.window(p, std::min<std::int64_t>(16, 3 * 87 - p));
    EXPECT_EQ(w.epoch, p / 87);
    ASSERT_FALSE(w.documents.empty());
    EXPECT_EQ(w.documents[0], 0);
    for (std::int64_t s : w.documents) starts.push_back(p + s);
    stream.insert(stream.end(), w.tokens.begin(), w.tokens.end());
  }
  ASSERT_EQ(stream.size(), 3u * 87u);
  std::vector<std::vector<std::int64_t>> orders(3);
  std::int64_t at = 0;
  for (int e = 0; e < 3; ++e) {
    std::map<std::int64_t, int> seen;
    while (at < (e + 1) * 87) {
      const std::int64_t d = stream[at] / 10;
      const std::int64_t n = lengths[d];
      for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(stream[at + i], (10 * d + i % 7) % 250) << "epoch " << e;
      // Every document's start is marked, and the window starts are too.
      EXPECT_NE(std::find(starts.begin(), starts.end(), at), starts.end()) << at;
      orders[e].push_back(d);
      ++seen[d];
      at += n;
    }
    EXPECT_EQ(seen.size(), lengths.size()) << "epoch " << e << " holds every document once";
  }
  EXPECT_NE(orders[0], orders[1]);  // shuffled per epoch
  // A window is a function of its position: the same again, another seed another order.
  EXPECT_EQ(corpus.window(50, 30).tokens, document_corpus(prefix, 256, 0, 11).window(50, 30).tokens);
  EXPECT_NE(corpus.window(0, 87).tokens, document_corpus(prefix, 256, 0, 12).window(0, 87).tokens);
  // --min-doc-tokens keeps the long documents only.
  const document_corpus long_only(prefix, 256, 12, 11);
  EXPECT_EQ(long_only.documents(), 3);
  EXPECT_EQ(long_only.epoch_tokens(), 40 + 12 + 19);
  fs::remove_all(dir);
}

TEST(document_corpus, inconsistent_or_foreign_corpora_are_refused) {
  const fs::path dir = scratch("bad");
  std::string prefix = write_corpus(dir / "a", {4, 4}, 300);
  EXPECT_THROW(document_corpus(prefix, 256, 0, 1), config_error);  // another vocabulary
  prefix = write_corpus(dir / "b", {4, 4}, 256, "int64");
  EXPECT_THROW(document_corpus(prefix, 256, 0, 1), io_error);
  prefix = write_corpus(dir / "c", {4, 4});
  std::filesystem::resize_file(prefix + ".tokens", 20);
  EXPECT_THROW(document_corpus(prefix, 256, 0, 1), io_error);  // truncated
  prefix = write_corpus(dir / "d", {4, 4});
  EXPECT_THROW(document_corpus(prefix, 256, 5, 1), config_error);  // no document that long
  prefix = write_corpus(dir / "e", std::vector<std::int64_t>(12, 2), 100);  // document 11's ids are 110, 111
  EXPECT_THROW(document_corpus(prefix, 100, 0, 1).check_ids(), io_error);  // ids past the vocabulary
  fs::remove_all(dir);
}

train_options corpus_run(const std::string& prefix, packing_mode packing) {
  train_options o;
  o.model = preset("tiny-llama");
  o.data_path = prefix;
  o.packing = packing;
  o.seq_len = 64;
  o.cp = {strategy_kind::upipe, 2, 0};
  o.optim.lr = 3e-3;
  o.optim.total_steps = 12;
  o.optim.warmup_steps = 2;
  o.seed = 5;
  o.eval_samples = 0;
  o.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
  return o;
}

// Training on a corpus: the documents mask the attention (the loss is not the stream's),
// epochs are counted, and a resume mid-epoch continues bit for bit.
TEST(document_corpus, training_packs_documents_and_resumes_mid_epoch) {
  const fs::path dir = scratch("train");
  const std::string prefix = write_corpus(dir, {30, 1, 90, 17, 44, 5, 60, 23});  // 270 tokens: ~4 steps an epoch
  const train_options whole = corpus_run(prefix, packing_mode::automatic);
  const train_summary run = train(whole, nullptr);
  ASSERT_EQ(run.steps.size(), 12u);
  EXPECT_GT(run.steps.back().epoch, 2.0);
  EXPECT_LT(run.steps.back().loss, run.steps.front().loss);
  const std::vector<double> stream = losses(corpus_run(prefix, packing_mode::stream));
  EXPECT_NE(stream[0], run.steps[0].loss);  // the same tokens, other attention and targets
  train_options first = whole;
  first.stop_after = 5;  // mid-epoch
  first.save_dir = (dir / "ckpt").string();
  losses(first);
  train_options second = whole;
  second.resume_dir = first.save_dir;
  const std::vector<double> resumed = losses(second);
  ASSERT_EQ(resumed.size(), 7u);
  for (std::size_t i = 0; i < resumed.size(); ++i) EXPECT_EQ(resumed[i], run.steps[5 + i].loss) << "step " << 6 + i;
  // The resume refuses another packing of the same data.
  train_options other = second;
  other.packing = packing_mode::stream;
  EXPECT_THROW(train(other, nullptr), config_error);
  // --packing documents without an index.
  train_options flat = whole;
  flat.data_path = prefix + ".tokens";
  flat.packing = packing_mode::documents;
  EXPECT_THROW(train(flat, nullptr), config_error);
  fs::remove_all(dir);
}

// Held-out loss during training: logged at every N-th step and at the last, and the
// training itself unchanged bit for bit (the evaluation is forward only).
TEST(document_corpus, evaluation_during_training_leaves_training_alone) {
  const fs::path dir = scratch("eval_every");
  const std::string prefix = write_corpus(dir / "train", {30, 1, 90, 17, 44, 5, 60, 23});
  const std::string held_out = write_corpus(dir / "held", {50, 70, 9, 120});
  const train_options plain = corpus_run(prefix, packing_mode::automatic);
  train_options with_eval = plain;
  with_eval.eval_every = 4;
  with_eval.eval_data = held_out;
  with_eval.eval_sequences = 2;
  const train_summary a = train(plain, nullptr), b = train(with_eval, nullptr);
  ASSERT_EQ(a.steps.size(), b.steps.size());
  for (std::size_t i = 0; i < a.steps.size(); ++i) {
    EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << "step " << i + 1;
    const bool evaluated = (i + 1) % 4 == 0 || i + 1 == b.steps.size();
    EXPECT_EQ(b.steps[i].eval_loss.has_value(), evaluated) << "step " << i + 1;
    if (evaluated) EXPECT_GT(*b.steps[i].eval_loss, 0.0);
  }
  train_options missing = plain;
  missing.eval_every = 2;
  EXPECT_THROW(train(missing, nullptr), config_error);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace upipe
