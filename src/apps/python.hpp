// Running the Python tools this binary carries (the package python/upipe_tools: prepare-data,
// report, eval --niah's text, tensorboard): offline tools beside the engine; training itself
// never runs Python.
#pragma once

#include <string>
#include <vector>

namespace upipe::apps {

// The scripts speak as upipe: run for `command` (UPIPE_COMMAND in their environment), a
// script names the bad input on one "upipe: error: COMMAND: ..." line and exits with 2.
void run_scripts_for(const std::string& command);
// upipe's exit status for a script's: 0, 2 (the script named the bad input) and 130 (an
// interrupt) as they are; any other ending (a traceback, a signal) is reported on an
// "upipe: error:" line and is 2 too, so that no failure goes without one.
int script_exit_status(int status, const std::string& command);

// Runs args[0] (looked up on PATH) and returns its exit status; config_error naming
// `needed_for` when it cannot be started. `env` adds or replaces variables of this
// process's environment for the child ("NAME=value").
int spawn(const std::vector<std::string>& args, const std::string& needed_for, const std::vector<std::string>& env = {});

// Whether python3 imports `module` (run from anywhere: a file of the working directory is not
// taken for it); config_error naming `needed_for` when python3 cannot be started.
bool python_imports(const std::string& module, const std::string& needed_for);

// One file of the Python package this binary carries (python/upipe_tools, embedded by the
// build: generated/apps/upipe_tools_files.hpp).
struct python_file {
  const char* name;  // file name in the package, e.g. "prepare_data.py"
  const char* text;
};

// Writes the package to a private temporary directory and runs `python3 -m
// upipe_tools.TOOL args...` with that directory leading PYTHONPATH (a module run by name, so
// that its worker processes import it too); returns the exit status.
int run_tool(const std::string& tool, const std::vector<std::string>& args);

// The same, where an argument equal to output_placeholder becomes a file in that private
// directory; returns the exit status and what the tool wrote there (empty if nothing).
inline constexpr const char* output_placeholder = "{output}";
struct python_result {
  int status = 0;
  std::string output;
};
python_result run_tool_for_output(const std::string& tool, std::vector<std::string> args);

}  // namespace upipe::apps
