// `upipe prepare-data`: tokenizes documents (text files or folders, JSONL, Parquet) and
// instruction or chat examples (rendered with the model's chat template, with a loss mask)
// with a model directory's tokenizer.json into a corpus for `upipe train --data PREFIX`,
// through the Python helper this binary carries (scripts/prepare_data.py and its modules,
// Hugging Face `tokenizers`, jinja2 for chat templates). Its flags pass through; `upipe
// prepare-data --help` lists them.
#include <string>
#include <vector>

#include "apps/chat_data_script.hpp"
#include "apps/commands.hpp"
#include "apps/corpus_writer_script.hpp"
#include "apps/prepare_data_script.hpp"
#include "apps/prepare_encode_script.hpp"
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
    if (spawn({"python3", "-c", "import tokenizers"}, "upipe prepare-data") != 0)
      throw config_error("upipe prepare-data needs Hugging Face tokenizers for python3: scripts/setup-deps installs "
                         "it (or: python3 -m pip install tokenizers)");
    const python_module modules[] = {{"chat_data.py", chat_data_script},
                                     {"corpus_writer.py", corpus_writer_script},
                                     {"prepare_encode.py", prepare_encode_script}};
    run_scripts_for("prepare-data");
    return script_exit_status(run_python_file(prepare_data_script, "prepare_data.py", *args, modules), "prepare-data");
  };
}

}  // namespace upipe::apps
