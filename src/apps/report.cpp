// `upipe report RESULTS.json...`: plots (SVG) of benchmark and plan results, drawn by
// matplotlib through the script this binary carries (scripts/report.py).
#include <spawn.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "apps/commands.hpp"
#include "apps/report_script.hpp"
#include "core/error.hpp"

extern char** environ;

namespace upipe::apps {

namespace {

struct report_flags {
  std::string out_dir = "report";
  std::vector<std::string> inputs;
};

// Runs argv[0] (looked up on PATH) and returns its exit status.
int spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int err = ::posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ);
  if (err != 0) throw config_error("upipe report needs " + args[0] + " (" + std::strerror(err) + "); install Python 3");
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) throw io_error("waiting for " + args[0] + " failed: " + std::strerror(errno));
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int run(const report_flags& f) {
  for (const std::string& path : f.inputs)
    if (!std::filesystem::is_regular_file(path))
      throw config_error("report input " + path + " is not a file: give the JSON of upipe bench, bench-attention or plan");
  if (spawn({"python3", "-c", "import matplotlib"}) != 0)
    throw config_error("upipe report needs matplotlib for python3: scripts/setup-deps installs it "
                       "(or: python3 -m pip install matplotlib)");
  // The script travels as python3's -c argument (its argv[0] becomes "-c").
  std::vector<std::string> args = {"python3", "-c", report_script, f.out_dir};
  args.insert(args.end(), f.inputs.begin(), f.inputs.end());
  const int status = spawn(args);
  return status == 0 ? 0 : 2;  // the script names the bad input
}

}  // namespace

command_runner add_report(CLI::App& app) {
  auto f = std::make_shared<report_flags>();
  app.add_option("inputs", f->inputs, "JSON of upipe bench, bench-attention or plan")->required();
  app.add_option("--out", f->out_dir, "directory for the SVG files")->capture_default_str();
  return [f] { return run(*f); };
}

}  // namespace upipe::apps
