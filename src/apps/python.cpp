#include "apps/python.hpp"

#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.hpp"

extern char** environ;

namespace upipe::apps {

int spawn(const std::vector<std::string>& args, const std::string& needed_for) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int err = ::posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ);
  if (err != 0)
    throw config_error(needed_for + " needs " + args[0] + " (" + std::strerror(err) + "); install Python 3");
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) throw io_error("waiting for " + args[0] + " failed: " + std::strerror(errno));
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int run_python_file(const char* script, const std::string& name, const std::vector<std::string>& args) {
  std::string dir = (std::filesystem::temp_directory_path() / "upipe-script-XXXXXX").string();
  if (::mkdtemp(dir.data()) == nullptr)
    throw io_error("cannot make a temporary directory for " + name + ": " + std::strerror(errno));
  const std::string file = dir + "/" + name;
  int status = 0;
  try {
    std::ofstream(file) << script;
    std::vector<std::string> argv = {"python3", file};
    argv.insert(argv.end(), args.begin(), args.end());
    status = spawn(argv, "upipe");
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    throw;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return status;
}

}  // namespace upipe::apps
