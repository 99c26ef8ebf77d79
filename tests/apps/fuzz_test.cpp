// A fuzz sample in CI: seeded mutations of the flags, config.json fields and safetensors
// headers the program reads. Every run must end as a user error (exit 2) or a success
// (exit 0), quickly: never a crash, an internal error (exit 4), a hang or a memory
// blow-up. The full fuzz (issue #23) ran thousands; this keeps a few hundred in CI.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_upipe.hpp"

namespace fs = std::filesystem;
using upipe::testing::run_result;
using upipe::testing::run_upipe;
using upipe::testing::temp_dir;
// A hang (exit 124 after 60 s) fails like a crash.

namespace {

std::string source_path(const std::string& relative) { return std::string(UPIPE_SOURCE_DIR) + "/" + relative; }

// Values that break numbers: zero, negative, huge, overflowing, not numbers at all.
const std::vector<std::string> bad_numbers = {"0",    "-1",  "-5",  "2147483648", "9223372036854775807",
                                              "1e300", "nan", "inf", "''",         "abc",
                                              "3.5",   "1K",  "99999999999999999999"};

void expect_handled(const run_result& r, const std::string& what) {
  EXPECT_TRUE(r.exit_code == 0 || r.exit_code == 2) << what << " exited " << r.exit_code << "\n" << r.output;
  EXPECT_EQ(r.output.find("internal error"), std::string::npos) << what << "\n" << r.output;
}

// Each numeric flag of the commands takes each bad value (memory-only or tiny runs).
TEST(fuzz, numeric_flags_are_refused_or_run) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> commands = {
      {"train --backend meta --steps 1 --eval-samples 0", {"--cp", "--seq-len", "--batch", "--steps", "--head-chunk",
                                                          "--ring", "--lr", "--weight-decay", "--max-grad-norm",
                                                          "--mlp-tile", "--loss-chunk", "--memory-gib", "--warmup"}},
      {"step --backend meta --seq-len 64", {"--cp", "--seq-len", "--head-chunk", "--ring", "--mlp-tile", "--loss-chunk"}},
      {"plan --model tiny-llama --gpus 2 --attention upipe --gpu-memory 2GiB --host-memory 2GiB",
       {"--gpus", "--margin", "--layers", "--seq-len", "--nodes"}},
      {"bench-attention --backend meta --strategy upipe --seq-len 64",
       {"--cp", "--heads", "--kv-heads", "--head-dim", "--head-chunk", "--ring"}},
  };
  int runs = 0;
  for (const auto& [base, flags] : commands)
    for (const std::string& flag : flags)
      for (const std::string& value : bad_numbers) {
        const std::string args = base + " " + flag + " " + value;
        expect_handled(upipe::testing::run_upipe_env("", args, 60), args);
        ++runs;
      }
  EXPECT_GT(runs, 200);
}

// Every numeric field of a config.json takes each bad value.
TEST(fuzz, config_fields_are_refused_or_run) {
  const auto dir = temp_dir("fuzz_config");
  std::ifstream in(source_path("tests/golden/hf/llama-yarn-shards/config.json"));
  const nlohmann::json base = nlohmann::json::parse(in);
  const std::vector<nlohmann::json> values = {0, -1, std::int64_t{1} << 40, std::int64_t{1} << 62, 1e300, "text",
                                              nullptr, nlohmann::json::array(), 3.5};
  int runs = 0;
  for (const auto& [key, unused] : base.items()) {
    if (!base[key].is_number()) continue;
    for (const nlohmann::json& v : values) {
      nlohmann::json c = base;
      c[key] = v;
      std::ofstream(dir / "config.json") << c.dump();
      const run_result r =
          upipe::testing::run_upipe_env("", "step --backend meta --seq-len 64 --cp 2 --config " + (dir / "config.json").string(), 60);
      expect_handled(r, key + " = " + v.dump());
      ++runs;
    }
  }
  EXPECT_GT(runs, 50);
  fs::remove_all(dir);
}

// A safetensors file whose header lies: its length, its JSON, a tensor's dtype, shape or
// offsets, and a shape nested deep.
TEST(fuzz, safetensors_headers_are_refused) {
  const auto dir = temp_dir("fuzz_safetensors");
  const std::string model = source_path("tests/golden/tiny-llama/model.safetensors");
  std::ifstream in(model, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n));
  const std::string body = bytes.substr(8 + n);
  const auto write = [&](const std::string& head, const std::string& payload) {
    std::string out(8, '\0');
    const std::uint64_t len = head.size();
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((len >> (8 * i)) & 0xff);
    std::ofstream(dir / "m.safetensors", std::ios::binary) << out << head << payload;
  };
  std::vector<std::string> heads;
  for (const auto& [name, t] : header.items()) {
    if (name == "__metadata__") continue;
    for (const nlohmann::json& dtype : {nlohmann::json("Q4"), nlohmann::json(7), nlohmann::json(nullptr)}) {
      nlohmann::json h = header;
      h[name]["dtype"] = dtype;
      heads.push_back(h.dump());
    }
    for (const nlohmann::json& shape : {nlohmann::json::array({-1, 4}), nlohmann::json::array({std::int64_t{1} << 62, 2}),
                                        nlohmann::json("4"), nlohmann::json::array()}) {
      nlohmann::json h = header;
      h[name]["shape"] = shape;
      heads.push_back(h.dump());
    }
    for (const nlohmann::json& offsets :
         {nlohmann::json::array({0, std::int64_t{1} << 60}), nlohmann::json::array({8, 4}), nlohmann::json::array({0})}) {
      nlohmann::json h = header;
      h[name]["data_offsets"] = offsets;
      heads.push_back(h.dump());
    }
    if (heads.size() > 60) break;
  }
  heads.push_back(std::string(100000, '[') + std::string(100000, ']'));  // nested deep
  {  // a tensor's shape nested deep, which the error message must not dump
    const std::string name = header.begin().key() == "__metadata__" ? std::next(header.begin()).key() : header.begin().key();
    heads.push_back("{\"" + name + "\": {\"dtype\": \"F32\", \"shape\": " + std::string(100000, '[') +
                    std::string(100000, ']') + ", \"data_offsets\": [0, 4]}}");
  }
  heads.push_back("{\"a\": ");                                           // cut short
  for (const std::string& head : heads) {
    write(head, body);
    const run_result r = run_upipe("step --seq-len 16 --cp 1 --weights " + (dir / "m.safetensors").string());
    EXPECT_EQ(r.exit_code, 2) << head.substr(0, 200) << "\n" << r.output;
  }
  // A header length past the file, and a file cut inside the header.
  std::ofstream(dir / "m.safetensors", std::ios::binary) << std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) << "{}";
  EXPECT_EQ(run_upipe("step --seq-len 16 --cp 1 --weights " + (dir / "m.safetensors").string()).exit_code, 2);
  std::ofstream(dir / "m.safetensors", std::ios::binary) << bytes.substr(0, 8 + n / 2);
  EXPECT_EQ(run_upipe("step --seq-len 16 --cp 1 --weights " + (dir / "m.safetensors").string()).exit_code, 2);
  fs::remove_all(dir);
}

}  // namespace
