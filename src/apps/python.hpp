// Running the Python helpers this binary carries (scripts/report.py, scripts/prepare_data.py):
// offline tools beside the engine; training itself never runs Python.
#pragma once

#include <span>
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
// `needed_for` when it cannot be started.
int spawn(const std::vector<std::string>& args, const std::string& needed_for);

// A module a script imports, written beside it.
struct python_module {
  const char* name;  // file name, e.g. "chat_data.py"
  const char* text;
};

// Writes `script` (and the `modules` it imports) to a private temporary directory and runs
// `python3 FILE args...` (a file, not -c, so that its worker processes can import it);
// returns the exit status.
int run_python_file(const char* script, const std::string& name, const std::vector<std::string>& args,
                    std::span<const python_module> modules = {});

// The same, where an argument equal to output_placeholder becomes a file in that private
// directory; returns the exit status and what the script wrote there (empty if nothing).
inline constexpr const char* output_placeholder = "{output}";
struct python_result {
  int status = 0;
  std::string output;
};
python_result run_python_for_output(const char* script, const std::string& name, std::vector<std::string> args);

}  // namespace upipe::apps
