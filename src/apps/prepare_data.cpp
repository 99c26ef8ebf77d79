// `upipe prepare-data`: tokenizes documents (text files or folders, JSONL, Parquet) and
// instruction or chat examples (rendered with the model's chat template, with a loss mask)
// with a model directory's tokenizer.json into a corpus for `upipe train --data PREFIX`,
// through the Python tools this binary carries (python/upipe_tools/prepare_data.py and its modules,
// Hugging Face `tokenizers`, jinja2 for chat templates). Its flags pass through; `upipe
// prepare-data --help` lists them.
#include <string>
#include <vector>

#include "apps/commands.hpp"
#include "apps/python.hpp"
#include "core/error.hpp"

namespace upipe::apps {

command_runner add_prepare_data(CLI::App& app) {
  auto args = std::make_shared<std::vector<std::string>>();
  app.allow_extras();
  app.prefix_command();
  app.set_help_flag();  // --help goes to the script, which lists every flag
  return [&app, args] {
    *args = app.remaining();
    if (!python_imports("tokenizers", "upipe prepare-data"))
      throw config_error("upipe prepare-data needs Hugging Face tokenizers for python3: scripts/setup-deps installs "
                         "it (or: python3 -m pip install tokenizers)");
    run_scripts_for("prepare-data");
    return script_exit_status(run_tool("prepare_data", *args), "prepare-data");
  };
}

}  // namespace upipe::apps
