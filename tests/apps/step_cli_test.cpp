// `upipe step` as a user runs it, and its refusals of bad weights, configurations,
// token files and flags: each a clear message and a non-zero exit.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "formats/safetensors.hpp"
#include "model/weights.hpp"
#include "run_upipe.hpp"

namespace {

using upipe::testing::run_result;
using upipe::testing::run_upipe;
using upipe::testing::source_path;
using upipe::testing::temp_dir;
namespace fs = std::filesystem;

std::string golden(const std::string& model) { return source_path("tests/golden/" + model); }

TEST(step_cli, golden_weights_give_the_transformers_loss) {
  // The golden tokens as a flat uint32 file; the loss must be transformers'.
  std::ifstream in(golden("tiny-qwen3") + "/golden.json");
  const auto j = nlohmann::json::parse(in);
  const auto dir = temp_dir("step_golden");
  {
    std::ofstream out(dir / "tokens.bin", std::ios::binary);
    for (std::uint32_t t : j["tokens"].get<std::vector<std::uint32_t>>()) out.write(reinterpret_cast<char*>(&t), 4);
  }
  const run_result r = run_upipe("step --config " + golden("tiny-qwen3") + "/config.json --weights " + golden("tiny-qwen3") +
                                 " --tokens " + (dir / "tokens.bin").string() + " --seq-len 62 --cp 2 --attention ring "
                                 "--json " + (dir / "r.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream result(dir / "r.json");
  const auto got = nlohmann::json::parse(result);
  EXPECT_NEAR(got["loss"].get<double>(), j["loss"].get<double>(), 1e-5 * j["loss"].get<double>());
  EXPECT_GT(got["peak_bytes"]["weights"].get<double>(), 0);
  fs::remove_all(dir);
}

TEST(step_cli, meta_reports_llama3_8b_memory_at_one_million_tokens) {
  const run_result r = run_upipe("step --model llama3-8b --backend meta --cp 8 --seq-len 1M");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("checkpoints_device"), std::string::npos);
  EXPECT_NE(r.output.find("attention"), std::string::npos);
}

// --head-chunk auto (the default): every head in one stage where the step fits, fewer where
// it does not, each printed with its reason; --attention-dtype fp8 runs on the meta backend
// with its buffers modelled.
TEST(step_cli, head_chunk_auto_takes_the_largest_u_that_fits) {
  const std::string base = "step --model llama3.2-1b --layers 2 --backend meta --cp 4 --seq-len 256K ";
  const run_result roomy = run_upipe(base + "--memory-gib 200");
  ASSERT_EQ(roomy.exit_code, 0) << roomy.output;
  EXPECT_NE(roomy.output.find("# head chunk U = 32 (auto: the largest whose step fits, every head in one stage"),
            std::string::npos)
      << roomy.output;
  const run_result tight = run_upipe(base + "--memory-gib 6");
  ASSERT_EQ(tight.exit_code, 0) << tight.output;
  EXPECT_NE(tight.output.find("# head chunk U = 16 (auto: the largest whose step fits;"), std::string::npos)
      << tight.output;
  const run_result fixed = run_upipe(base + "--memory-gib 200 --head-chunk 8");
  ASSERT_EQ(fixed.exit_code, 0) << fixed.output;
  EXPECT_EQ(fixed.output.find("# head chunk U ="), std::string::npos) << "a given U is not chosen";
  const run_result fp8 = run_upipe(base + "--memory-gib 200 --attention-dtype fp8");
  ASSERT_EQ(fp8.exit_code, 0) << fp8.output;
}

// Writes the golden tiny-llama weights without one tensor.
std::string weights_without(const fs::path& dir, const std::string& missing) {
  const upipe::model_config c = upipe::preset("tiny-llama");
  upipe::host_weights w = upipe::read_weights(c, golden("tiny-llama") + "/model.safetensors");
  std::vector<upipe::safetensors_tensor> tensors;
  for (const auto& spec : upipe::parameter_specs(c))
    if (spec.name != missing) tensors.push_back({spec.name, spec.shape, w.at(spec.name), upipe::dtype::f32});
  const std::string path = (dir / "missing.safetensors").string();
  upipe::write_safetensors(path, tensors);
  return path;
}

std::string patched_copy(const fs::path& dir, const std::string& name, std::size_t keep_bytes, bool patch_dtype) {
  std::ifstream in(golden("tiny-llama") + "/model.safetensors", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (patch_dtype) bytes.replace(bytes.find("\"F32\""), 5, "\"I64\"");
  bytes.resize(std::min(bytes.size(), keep_bytes));
  const std::string path = (dir / name).string();
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

TEST(step_cli, bad_inputs_exit_non_zero_with_a_clear_message) {
  const auto dir = temp_dir("step_bad");
  // A config that contradicts the weights' shapes.
  {
    std::ifstream in(golden("tiny-llama") + "/config.json");
    auto cfg = nlohmann::json::parse(in);
    cfg["intermediate_size"] = 128;
    std::ofstream(dir / "config.json") << cfg.dump();
  }
  {
    std::ofstream tokens(dir / "short.bin", std::ios::binary);
    const std::uint32_t t[3] = {1, 2, 3};
    tokens.write(reinterpret_cast<const char*>(t), sizeof t);
    std::ofstream big(dir / "big.bin", std::ios::binary);
    const std::uint32_t b[4] = {1, 2, 999, 3};
    big.write(reinterpret_cast<const char*>(b), sizeof b);
  }
  {
    std::ofstream(dir / "odd.bin", std::ios::binary) << std::string(13, '\1');
    std::ifstream in(golden("tiny-llama") + "/config.json");
    auto cfg = nlohmann::json::parse(in);
    cfg["vocab_size"] = std::int64_t{1} << 62;
    std::filesystem::create_directories(dir / "vocab");
    std::ofstream(dir / "vocab" / "config.json") << cfg.dump();
  }
  const std::string truncated = patched_copy(dir, "truncated.safetensors", 300000, false);
  const std::string wrong_dtype = patched_copy(dir, "dtype.safetensors", SIZE_MAX, true);
  const std::string missing = weights_without(dir, "model.layers.1.mlp.up_proj.weight");
  const std::pair<std::string, std::string> cases[] = {
      {"--weights " + truncated, "truncated"},
      {"--weights " + wrong_dtype, "supported dtypes are F32, BF16, F16"},
      {"--weights " + missing, "has no tensor model.layers.1.mlp.up_proj.weight"},
      {"--weights " + (dir / "absent.safetensors").string(), "absent.safetensors"},
      {"--config " + (dir / "config.json").string() + " --weights " + golden("tiny-llama"), "needs [128, 64]"},
      {"--model tiny-qwen3 --weights " + golden("tiny-llama"), "has shape [64, 64] but tiny-qwen3 needs [128, 64]"},
      {"--model llama5-1t", "unknown"},
      {"--tokens " + (dir / "short.bin").string() + " --seq-len 16", "fewer than the sequence length 16"},
      {"--tokens " + (dir / "big.bin").string() + " --seq-len 4", "token 999 at index 2 of"},
      {"--tokens " + (dir / "odd.bin").string() + " --seq-len 4", "its size 13 bytes is not a multiple of 4"},
      {"--config " + (dir / "vocab").string() + " --seq-len 16", "at most what 32-bit token ids address"},
      {"--json /dev/full --seq-len 16", "No space left on device (a full disk?)"},
      {"--checkpoint-policy what=everything", "what=input|input+attention"},
      {"--checkpoint-policy every=0", "every=0 must be a whole number between 1 and"},
      {"--cp 3", "must divide query heads H = 4"},
      {"--attention upipe --head-chunk 3 --cp 2", "U must be a multiple of C"},
      {"--seq-len 1", "at least 2"},
      {"--cp -1", "--cp -1 must lie between 1 and 2147483647"},
      {"--cp 0", "--cp 0 must lie between 1 and 2147483647"},
      {"--seq-len 2048M", "beyond the longest this engine plans and runs"},
      {"--seq-len 9999999999999M", "too large to count"},
      {"--attention hybrid --ring 0", "--ring 0 must lie between 1 and"},
      {"--mlp-tile -4", "--mlp-tile -4 must lie between 0 and 1073741824"},
      {"--attention-dtype fp16", "--attention-dtype fp16 is not one of: bf16, fp8"},
      {"--head-chunk eight", "or auto, the largest U whose step fits"},
  };
  for (const auto& [args, message] : cases) {
    const bool has_length = args.find("--seq-len") != std::string::npos;
    const run_result r = run_upipe("step " + (has_length ? "" : std::string("--seq-len 16 ")) + args);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << "\n" << r.output;
  }
  // The tied Qwen3 head needs no lm_head.weight: its golden file has none and loads.
  EXPECT_EQ(run_upipe("step --model tiny-qwen3 --weights " + golden("tiny-qwen3") + " --seq-len 16").exit_code, 0);
  fs::remove_all(dir);
}

}  // namespace
