// Runs the upipe program as a user would, capturing its exit code and output.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace upipe::testing {

struct run_result {
  int exit_code;
  std::string output;  // stdout and stderr
};

// With `env` ("NAME=value ...") set for the program only; with `seconds`, killed past
// that many (exit 124, a hang).
inline run_result run_upipe_env(const std::string& env, const std::string& args, int seconds = 0) {
  const std::string limit = seconds > 0 ? "timeout " + std::to_string(seconds) + " " : "";
  const std::string command = limit + "env " + env + " " + std::string(UPIPE_BINARY) + " " + args + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  std::string output;
  std::array<char, 4096> buffer;
  while (std::fgets(buffer.data(), buffer.size(), pipe) != nullptr) output += buffer.data();
  const int status = pclose(pipe);
  // A crash (signal) is never an acceptable way to refuse input.
  EXPECT_TRUE(WIFEXITED(status)) << "upipe " << args << " died: " << output;
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

inline run_result run_upipe(const std::string& args) { return run_upipe_env("", args); }

// A fresh, empty directory for one test.
inline std::filesystem::path temp_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / ("upipe_test_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

inline std::string source_path(const std::string& relative) { return std::string(UPIPE_SOURCE_DIR) + "/" + relative; }

// A JSON-lines file (train --metrics-json): one object per non-empty line.
inline std::vector<nlohmann::json> read_lines(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> rows;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

}  // namespace upipe::testing
