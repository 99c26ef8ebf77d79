// Runs the upipe program as a user would, capturing its exit code and output.
#pragma once

#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
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

// A command line's words (split at spaces).
inline std::vector<std::string> split(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

// A file's bytes ("" when it cannot be read).
inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// A checkpoint file's bytes as two runs of the same training must agree on them: a
// safetensors file without its run id (each run has its own), any other file as it is.
inline std::string checkpoint_bytes(const std::filesystem::path& path) {
  std::string bytes = read_file(path);
  if (path.extension() != ".safetensors" || bytes.size() < 8) return bytes;
  std::uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, bytes.data(), 8);
  if (header_bytes > bytes.size() - 8) return bytes;
  auto header = nlohmann::json::parse(bytes.substr(8, header_bytes));
  if (header.contains("__metadata__")) header["__metadata__"].erase("run_id");
  return header.dump() + bytes.substr(8 + header_bytes);
}

// upipe with `args` from the working directory `cwd`.
inline run_result run_in(const std::filesystem::path& cwd, const std::string& args) {
  return run_upipe_env("--chdir=" + cwd.string(), args);
}

// Starts upipe (in this process's working directory) in the background, sends `signal` once
// `metrics` holds `lines` complete lines, and returns its exit status (the output in `log`).
inline int run_and_signal(const std::vector<std::string>& args, const std::filesystem::path& metrics,
                          std::size_t lines, int signal, const std::filesystem::path& log) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, STDOUT_FILENO);
    ::dup2(fd, STDERR_FILENO);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(UPIPE_BINARY));
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(UPIPE_BINARY, argv.data());
    ::_exit(127);
  }
  // The run writes a line per step; the limit only guards a broken run (CI machines are slow).
  for (int waited = 0; waited < 6000; ++waited) {
    const std::string text = read_file(metrics);
    if (static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n')) >= lines) break;
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(pid, signal);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace upipe::testing
