#include "apps/python.hpp"

#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "apps/upipe_tools_files.hpp"
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

int spawn(const std::vector<std::string>& args, const std::string& needed_for, const std::vector<std::string>& env) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  // This process's environment, with `env`'s variables in place of those of the same name.
  std::vector<char*> envp;
  const auto name_of = [](const std::string& var) { return var.substr(0, var.find('=') + 1); };
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string var = *e;
    if (std::none_of(env.begin(), env.end(), [&](const std::string& v) { return name_of(v) == name_of(var); }))
      envp.push_back(*e);
  }
  for (const std::string& v : env) envp.push_back(const_cast<char*>(v.c_str()));
  envp.push_back(nullptr);
  pid_t pid = 0;
  const int err = ::posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), envp.data());
  if (err != 0)
    throw config_error(needed_for + " needs " + args[0] + " (" + std::strerror(err) + "); install Python 3");
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) throw io_error("waiting for " + args[0] + " failed: " + std::strerror(errno));
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// PYTHONSAFEPATH: the working directory is not put first on the module path (Python 3.11+;
// older ones ignore it), so that a user's file there cannot stand in for a module.
constexpr const char* safe_path = "PYTHONSAFEPATH=1";

bool python_imports(const std::string& module, const std::string& needed_for) {
  return spawn({"python3", "-c", "import " + module}, needed_for, {safe_path}) == 0;
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

// The package written into `dir` (dir/upipe_tools/...), then `python3 -m upipe_tools.TOOL
// args...` with dir leading PYTHONPATH.
int run_in(const private_dir& dir, const std::string& tool, const std::vector<std::string>& args) {
  const std::string package = dir.file("upipe_tools");
  std::filesystem::create_directory(package);
  for (const python_file& f : upipe_tools_files) {
    std::ofstream out(package + "/" + f.name);
    out << f.text;
    if (!out.flush()) throw io_error("cannot write the Python tools into " + package + " (a full disk?)");
  }
  std::vector<std::string> argv = {"python3", "-m", "upipe_tools." + tool};
  argv.insert(argv.end(), args.begin(), args.end());
  const char* inherited = std::getenv("PYTHONPATH");
  std::string path = dir.file("");
  if (inherited != nullptr && *inherited != '\0') path.append(":").append(inherited);
  return spawn(argv, "upipe", {"PYTHONPATH=" + path, safe_path});
}

}  // namespace

int run_tool(const std::string& tool, const std::vector<std::string>& args) {
  const private_dir dir(tool);
  return run_in(dir, tool, args);
}

python_result run_tool_for_output(const std::string& tool, std::vector<std::string> args) {
  const private_dir dir(tool);
  const std::string out = dir.file("output");
  for (std::string& a : args)
    if (a == output_placeholder) a = out;
  python_result r;
  r.status = run_in(dir, tool, args);
  std::ifstream in(out, std::ios::binary);
  r.output.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return r;
}

}  // namespace upipe::apps
