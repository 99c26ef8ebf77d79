#include "apps/python.hpp"

#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.hpp"

extern char** environ;

namespace upipe::apps {

void run_scripts_for(const std::string& command) {
  if (::setenv("UPIPE_COMMAND", command.c_str(), 1) != 0)
    throw io_error("cannot set UPIPE_COMMAND for " + command + "'s script: " + std::strerror(errno));
}

int script_exit_status(int status, const std::string& command) {
  if (status == 0 || status == 2 || status == 130) return status;
  std::fprintf(stderr, "upipe: error: %s failed: its Python script ended with status %d (%s); the output above says "
               "where\n", command.c_str(), status, status > 128 ? "killed by a signal" : "an unexpected error");
  return 2;
}

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

namespace {

// A private temporary directory, removed with everything in it when it goes out of scope.
class private_dir {
 public:
  explicit private_dir(const std::string& what)
      : path_((std::filesystem::temp_directory_path() / "upipe-script-XXXXXX").string()) {
    if (::mkdtemp(path_.data()) == nullptr)
      throw io_error("cannot make a temporary directory for " + what + ": " + std::strerror(errno));
  }
  ~private_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  private_dir(const private_dir&) = delete;
  private_dir& operator=(const private_dir&) = delete;
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

int run_in(const private_dir& dir, const char* script, const std::string& name, const std::vector<std::string>& args) {
  const std::string file = dir.file(name);
  std::ofstream(file) << script;
  std::vector<std::string> argv = {"python3", file};
  argv.insert(argv.end(), args.begin(), args.end());
  return spawn(argv, "upipe");
}

}  // namespace

int run_python_file(const char* script, const std::string& name, const std::vector<std::string>& args,
                    std::span<const python_module> modules) {
  const private_dir dir(name);
  for (const python_module& m : modules) std::ofstream(dir.file(m.name)) << m.text;
  return run_in(dir, script, name, args);
}

python_result run_python_for_output(const char* script, const std::string& name, std::vector<std::string> args) {
  const private_dir dir(name);
  const std::string out = dir.file("output");
  for (std::string& a : args)
    if (a == output_placeholder) a = out;
  python_result r;
  r.status = run_in(dir, script, name, args);
  std::ifstream in(out, std::ios::binary);
  r.output.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return r;
}

}  // namespace upipe::apps
