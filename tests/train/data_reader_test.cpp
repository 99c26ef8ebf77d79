// The data a run reads (train/data_reader): --data as written, the mixture's deterministic
// interleave, loss masks read beside a corpus, and what is refused.
#include "train/data_reader.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "model/model_step.hpp"

namespace upipe {
namespace {

namespace fs = std::filesystem;

fs::path scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("upipe_reader_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A corpus at dir/name: document d holds `lengths[d]` tokens 10 d + i % 7 (below 250); with
// `masks`, PREFIX.mask holds byte (i % period != 0) for document d's token i, where period
// is masks[d] (0: every token masked).
std::string write_corpus(const fs::path& dir, const std::string& name, const std::vector<std::int64_t>& lengths,
                         const std::vector<int>& masks = {}) {
  const std::string prefix = (dir / name).string();
  std::ofstream tokens(prefix + ".tokens", std::ios::binary), index(prefix + ".index", std::ios::binary);
  std::ofstream mask;
  if (!masks.empty()) mask.open(prefix + ".mask", std::ios::binary);
  std::uint64_t offset = 0, targets = 0;
  index.write(reinterpret_cast<const char*>(&offset), 8);
  for (std::size_t d = 0; d < lengths.size(); ++d) {
    for (std::int64_t i = 0; i < lengths[d]; ++i) {
      const auto id = static_cast<std::uint32_t>((10 * d + i % 7) % 250);
      tokens.write(reinterpret_cast<const char*>(&id), 4);
      if (!masks.empty()) {
        const char m = masks[d] > 0 && i % masks[d] != 0 ? 1 : 0;
        targets += static_cast<std::uint64_t>(m);
        mask.put(m);
      }
    }
    offset += static_cast<std::uint64_t>(lengths[d]);
    index.write(reinterpret_cast<const char*>(&offset), 8);
  }
  nlohmann::json m = {{"format", "upipe-tokens"}, {"version", 1},       {"dtype", "uint32"},
                      {"vocab_size", 256},        {"documents", lengths.size()}, {"tokens", offset}};
  if (!masks.empty())
    m["loss_mask"] = {{"format", "upipe-loss-mask"}, {"version", 1}, {"dtype", "uint8"}, {"file", name + ".mask"},
                      {"targets", targets}};
  std::ofstream(prefix + ".json") << m.dump();
  return prefix;
}

TEST(data_sources, parse_as_written) {
  const fs::path dir = scratch("parse");
  const std::string a = write_corpus(dir, "a", {4}), b = write_corpus(dir, "b:1", {4});
  EXPECT_TRUE(parse_data_sources("", "--data").empty());
  auto s = parse_data_sources(a, "--data");
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].path, a);
  EXPECT_EQ(s[0].weight, 1.0);
  s = parse_data_sources(b, "--data");  // a corpus whose name has a colon is that corpus
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].path, b);
  s = parse_data_sources("x:0.7,y:0.3,z", "--data");
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].path, "x");
  EXPECT_EQ(s[1].weight, 0.3);
  EXPECT_EQ(s[2].weight, 1.0);
  EXPECT_EQ(data_sources_text(s), "x:0.7,y:0.3,z:1");
  EXPECT_EQ(parse_data_sources(data_sources_text(s), "--data")[0].weight, 0.7);
  for (const char* bad : {"x:0", "x:-1", "x:abc", "x:inf", "x:0.5,", ",x", "x:0.5,x:0.5", "x:nan"}) {
    try {
      parse_data_sources(bad, "--data");
      ADD_FAILURE() << bad << " was accepted";
    } catch (const config_error& e) {
      EXPECT_NE(std::string(e.what()).find("--data"), std::string::npos) << e.what();
    }
  }
  fs::remove_all(dir);
}

TEST(data_layout, interleaves_by_weight_deterministically) {
  data_layout layout{{0.7, 0.2, 0.1}, {0, 0, 0}, 16};
  data_position at = layout.start();
  std::vector<std::size_t> order;
  for (int k = 1; k <= 1000; ++k) {
    const std::size_t i = layout.next_source(at);
    order.push_back(i);
    layout.advance(at, i, 16);
    for (std::size_t s = 0; s < 3; ++s)  // every prefix within one sequence of its share
      EXPECT_LE(std::abs(static_cast<double>(at.sequences[s]) - layout.weights[s] * k), 1.0) << "k " << k;
  }
  EXPECT_EQ(at.sequences, (std::vector<std::int64_t>{700, 200, 100}));
  EXPECT_EQ(at.tokens, (std::vector<std::int64_t>{700 * 16, 200 * 16, 100 * 16}));
  // From a saved position the rest follows as it would have.
  data_position again = layout.start();
  for (int k = 0; k < 400; ++k) layout.advance(again, layout.next_source(again), 16);
  for (int k = 400; k < 1000; ++k) {
    const std::size_t i = layout.next_source(again);
    EXPECT_EQ(i, order[static_cast<std::size_t>(k)]);
    layout.advance(again, i, 16);
  }
  // A token file moves by the run's length; its position counts on past its end (the token
  // read next is at the position modulo its size), so that it counts the passes too.
  data_layout file{{1.0}, {50}, 16};
  data_position f = file.start();
  for (int k = 0; k < 4; ++k) file.advance(f, 0, 8);
  EXPECT_EQ(f.tokens[0], 64);
}

TEST(data_reader, windows_carry_the_loss_mask_and_the_labels_follow_it) {
  const fs::path dir = scratch("mask");
  const std::string prefix = write_corpus(dir, "chat", {6, 9, 5}, {2, 0, 3});
  data_reader reader({{prefix, 1.0}}, {256, 20, 0, packing_mode::automatic, 3});
  EXPECT_TRUE(reader.masked(0));
  data_position at = reader.layout().start();
  const packed_sequence w = reader.next(at, 20);
  ASSERT_EQ(w.targets.size(), 20u);
  ASSERT_EQ(w.sources.size(), 3u);
  // Each document's bytes, in the shuffled order the window holds them.
  const std::vector<int> periods = {2, 0, 3};
  for (std::size_t part = 0; part < w.documents.size(); ++part) {
    const auto d = static_cast<std::size_t>(w.sources[part]);
    const std::int64_t end = part + 1 < w.documents.size() ? w.documents[part + 1] : 20;
    for (std::int64_t t = w.documents[part]; t < end; ++t) {
      const std::int64_t i = t - w.documents[part];
      EXPECT_EQ(w.targets[static_cast<std::size_t>(t)], periods[d] > 0 && i % periods[d] != 0 ? 1 : 0);
    }
  }
  // A label counts where its token is a target and inside the document.
  const prepared_sequence p = prepare_sequence(w.tokens, 4, w.documents, w.targets);
  std::int64_t counted = 0;
  for (std::size_t t = 0; t + 1 < w.tokens.size(); ++t) {
    const bool crosses = std::find(w.documents.begin(), w.documents.end(), static_cast<std::int64_t>(t) + 1) !=
                         w.documents.end();
    const bool want = !crosses && w.targets[t + 1] == 1;
    EXPECT_EQ(p.labels[t] != masked_label, want) << t;
    counted += want ? 1 : 0;
  }
  EXPECT_EQ(p.counted, counted);
  EXPECT_THROW(prepare_sequence(w.tokens, 4, w.documents, std::vector<std::uint8_t>(3, 1)), config_error);
  fs::remove_all(dir);
}

TEST(data_reader, damaged_or_foreign_masks_are_refused) {
  const fs::path dir = scratch("bad_mask");
  const data_reader::options o{256, 8, 0, packing_mode::automatic, 1};
  std::string prefix = write_corpus(dir, "short", {6, 9}, {2, 2});
  fs::resize_file(prefix + ".mask", 10);
  EXPECT_THROW(data_reader({{prefix, 1.0}}, o), io_error);
  prefix = write_corpus(dir, "version", {6, 9}, {2, 2});
  auto m = nlohmann::json::parse(std::ifstream(prefix + ".json"));
  m["loss_mask"]["version"] = 2;
  std::ofstream(prefix + ".json") << m.dump();
  EXPECT_THROW(data_reader({{prefix, 1.0}}, o), io_error);
  prefix = write_corpus(dir, "byte", {6, 9}, {2, 2});
  {
    std::fstream f(prefix + ".mask", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4);
    f.put(7);
  }
  const data_reader reader({{prefix, 1.0}}, o);
  try {
    reader.check_ids();
    ADD_FAILURE() << "a mask byte of 7 was accepted";
  } catch (const io_error& e) {
    EXPECT_NE(std::string(e.what()).find("byte 4 is 7"), std::string::npos) << e.what();
  }
  // The stream packing would drop the mask.
  EXPECT_THROW(data_reader({{write_corpus(dir, "stream", {6, 9}, {2, 2}), 1.0}},
                           {256, 8, 0, packing_mode::stream, 1}),
               config_error);
  fs::remove_all(dir);
}

TEST(data_reader, a_mixture_takes_each_source_by_its_weight) {
  const fs::path dir = scratch("mixture");
  const std::string a = write_corpus(dir, "a", {30, 12, 40}), b = write_corpus(dir, "b", {50, 20}, {1, 2});
  const data_reader reader({{a, 3.0}, {b, 1.0}}, {256, 16, 0, packing_mode::automatic, 9});
  data_position at = reader.layout().start();
  std::vector<int> from(2, 0);
  for (int k = 0; k < 40; ++k) {
    const packed_sequence s = reader.next(at, 16);
    ++from[static_cast<std::size_t>(s.source)];
    EXPECT_EQ(s.targets.empty(), s.source == 0);  // b's windows carry its mask
    // The window is the source's own at its position: reading it again gives the same.
    EXPECT_EQ(s.tokens, reader.read(static_cast<std::size_t>(s.source), at.tokens[static_cast<std::size_t>(s.source)] - 16, 16).tokens);
  }
  EXPECT_EQ(from, (std::vector<int>{30, 10}));
  EXPECT_EQ(at.tokens, (std::vector<std::int64_t>{30 * 16, 10 * 16}));
  EXPECT_GT(reader.epoch(at, 0), 5.0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace upipe
