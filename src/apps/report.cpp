// `upipe report RESULTS.json...`: plots (SVG) of benchmark and plan results, drawn by
// matplotlib through the script this binary carries (scripts/report.py).
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "apps/commands.hpp"
#include "apps/python.hpp"
#include "apps/report_script.hpp"
#include "core/error.hpp"
#include "core/files.hpp"

namespace upipe::apps {

namespace {

struct report_flags {
  std::string out_dir = "report";
  std::vector<std::string> inputs;
};

int run(const report_flags& f) {
  for (const std::string& path : f.inputs)
    input_file(path, "report input");  // a regular file: never a FIFO the script would wait on
  if (spawn({"python3", "-c", "import matplotlib"}, "upipe report") != 0)
    throw config_error("upipe report needs matplotlib for python3: scripts/setup-deps installs it "
                       "(or: python3 -m pip install matplotlib)");
  // The script travels as python3's -c argument (its argv[0] becomes "-c").
  std::vector<std::string> args = {"python3", "-c", report_script, f.out_dir};
  args.insert(args.end(), f.inputs.begin(), f.inputs.end());
  run_scripts_for("report");
  return script_exit_status(spawn(args, "upipe report"), "report");
}

}  // namespace

command_runner add_report(CLI::App& app) {
  auto f = std::make_shared<report_flags>();
  app.add_option("inputs", f->inputs, "JSON of upipe bench, bench-attention or plan")->required();
  app.add_option("--out", f->out_dir, "directory for the SVG files")->capture_default_str();
  return [f] { return run(*f); };
}

}  // namespace upipe::apps
