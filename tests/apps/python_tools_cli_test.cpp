// The Python tools travel inside the binary (python/upipe_tools, embedded by the build): a
// copy of upipe far from the source tree runs prepare-data, report and tensorboard from any
// working directory, and a file of the user's there cannot stand in for one of the tools'
// modules.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "run_upipe.hpp"

namespace {

namespace fs = std::filesystem;
using upipe::testing::read_file;
using upipe::testing::source_path;
using upipe::testing::temp_dir;

struct run_output {
  int exit_code;
  std::string output;
};

// `binary args` run in `cwd`, stdout and stderr together.
run_output run_copy(const fs::path& binary, const fs::path& cwd, const std::string& args) {
  const fs::path log = cwd / "log.txt";
  const std::string command = "cd " + cwd.string() + " && env -u UPIPE_COMMAND " + binary.string() + " " + args +
                              " > " + log.string() + " 2>&1";
  const int status = std::system(command.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_file(log)};
}

TEST(python_tools, a_copied_binary_runs_its_tools_from_anywhere) {
  if (std::system("python3 -c 'import tokenizers, matplotlib' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "tokenizers and matplotlib are not installed for python3";
  const fs::path dir = temp_dir("tools_copy");
  fs::create_directories(dir / "bin");
  fs::create_directories(dir / "work");
  fs::copy_file(UPIPE_BINARY, dir / "bin" / "upipe");
  const fs::path upipe = dir / "bin" / "upipe", work = dir / "work";
  std::ofstream(work / "doc.txt") << "A document of a few words, tokenized by the model's own tokenizer.\n";
  // A user's file named as a module the tools import is not imported in its place (Python
  // 3.11 and later, which keep the working directory off the module path when asked).
  if (std::system("python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'") == 0)
    std::ofstream(work / "json.py") << "raise SystemExit('the user\\'s json.py was imported')\n";
  const run_output prepared = run_copy(upipe, work, "prepare-data --tokenizer " +
                                                         source_path("tests/golden/hf/qwen3-tied") +
                                                         " --out corpus doc.txt");
  ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  EXPECT_TRUE(fs::exists(work / "corpus.tokens"));
  EXPECT_TRUE(fs::exists(work / "corpus.json"));
  std::ofstream(work / "m.jsonl") << "{\"step\": 1, \"loss\": 2.5, \"lr\": 0.001}\n{\"step\": 2, \"loss\": 2.0, "
                                     "\"lr\": 0.001}\n";
  const run_output plotted = run_copy(upipe, work, "report --out plots m.jsonl");
  ASSERT_EQ(plotted.exit_code, 0) << plotted.output;
  EXPECT_NE(read_file(work / "plots" / "loss_curve.svg").find("<svg"), std::string::npos);
  // A refusal speaks as upipe, in one line.
  const run_output refused = run_copy(upipe, work, "tensorboard missing.jsonl --logdir tb");
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_NE(refused.output.find("upipe: error: tensorboard: "), std::string::npos) << refused.output;
  fs::remove_all(dir);
}

}  // namespace
