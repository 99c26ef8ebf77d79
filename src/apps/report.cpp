// `upipe report RESULTS.json...`: plots (SVG) of benchmark and plan results, drawn by
// matplotlib through the Python tools this binary carries (python/upipe_tools/report.py).
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "apps/commands.hpp"
#include "apps/python.hpp"
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
  if (!python_imports("matplotlib", "upipe report"))
    throw config_error("upipe report needs matplotlib for python3: scripts/setup-deps installs it "
                       "(or: python3 -m pip install matplotlib)");
  std::vector<std::string> args = {f.out_dir};
  args.insert(args.end(), f.inputs.begin(), f.inputs.end());
  run_scripts_for("report");
  return script_exit_status(run_tool("report", args), "report");
}

}  // namespace

command_runner add_report(CLI::App& app) {
  auto f = std::make_shared<report_flags>();
  app.add_option("inputs", f->inputs, "JSON of upipe bench, bench-attention or plan")->required();
  app.add_option("--out", f->out_dir, "directory for the SVG files")->capture_default_str();
  return [f] { return run(*f); };
}

// `upipe tensorboard METRICS.jsonl --logdir DIR [--follow]`: a metrics file as TensorBoard
// scalars (python/upipe_tools/tensorboard_follow.py, tensorboardX); its flags pass through.
command_runner add_tensorboard(CLI::App& app) {
  app.allow_extras();
  app.prefix_command();
  app.set_help_flag();  // --help goes to the tool, which lists its flags
  return [&app] {
    run_scripts_for("tensorboard");
    return script_exit_status(run_tool("tensorboard_follow", app.remaining()), "tensorboard");
  };
}

}  // namespace upipe::apps
