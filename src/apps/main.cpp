// The upipe command line.
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "apps/commands.hpp"
#include "apps/flag_checks.hpp"
#include "apps/run_config.hpp"
#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "comm/launch.hpp"
#include "core/error.hpp"

namespace {

// Exit codes: 2 bad input (configuration, file), 3 out of memory, 4 a bug.
int report_error(const std::exception& e) {
  const bool user_error = dynamic_cast<const upipe::config_error*>(&e) || dynamic_cast<const upipe::io_error*>(&e);
  const bool memory = dynamic_cast<const upipe::out_of_memory_error*>(&e) != nullptr;
  std::fprintf(stderr, "upipe: %s: %s\n", user_error || memory ? "error" : "internal error", e.what());
  return user_error ? 2 : memory ? 3 : 4;
}

// "did you mean": the subcommand or flag closest to a mistyped one, named in the error.
std::string suggestion(const std::string& word, const std::vector<std::string>& known) {
  const std::string near = upipe::apps::closest(word, known);
  return near.empty() ? std::string() : "; did you mean " + near + "?";
}

std::vector<std::string> option_names(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::Option* opt : app.get_options())
    for (const std::string& name : opt->get_lnames()) names.push_back("--" + name);
  return names;
}

// A command line CLI11 refused: the message, with the closest subcommand or flag where a
// word was mistyped.
std::string explain_parse_error(CLI::App& app, const CLI::ParseError& e, int argc, char** argv) {
  std::vector<std::string> commands;
  for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) commands.push_back(sub->get_name());
  // The first word is the command: one CLI11 does not know is named as such.
  if (argc > 1 && argv[1][0] != '-' && std::find(commands.begin(), commands.end(), argv[1]) == commands.end()) {
    std::string all;
    for (const std::string& c : commands) all += (all.empty() ? "" : ", ") + c;
    return "'" + std::string(argv[1]) + "' is not a command of upipe" + suggestion(argv[1], commands) +
           " The commands: " + all;
  }
  std::string text = e.what();
  if (dynamic_cast<const CLI::ExtrasError*>(&e) == nullptr || argc < 2) return text;
  CLI::App* command = app.get_subcommand(argv[1]);
  for (int i = 2; i < argc; ++i) {
    std::string word = argv[i];
    if (word.rfind("--", 0) != 0) continue;
    word = word.substr(0, word.find('='));
    const std::vector<std::string> known = option_names(*command);
    if (std::find(known.begin(), known.end(), word) != known.end()) continue;
    return "upipe " + std::string(argv[1]) + " has no flag " + word + suggestion(word, known);
  }
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  // A full file system or a file-size limit must surface as a write error we can report
  // (and clean up after), not kill the process.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"upipe: long-context training with untied Ulysses (UPipe) context parallelism"};
  app.require_subcommand(1);
  app.set_version_flag("--version", upipe::apps::version_text());
  upipe::apps::command_runner run;
  auto train = upipe::apps::add_train(*app.add_subcommand(
      "train", "Train under context parallelism (default: a tiny model learns a passkey task on the CPU)"));
  auto bench = upipe::apps::add_bench_attention(*app.add_subcommand(
      "bench-attention", "Attention layer forward+backward under CP: time, memory, bytes, error vs reference"));
  auto model = upipe::apps::add_model_config(
      *app.add_subcommand("model-config", "Show a model configuration and its parameters; write it as config.json"));
  auto step = upipe::apps::add_step(*app.add_subcommand(
      "step", "One forward and backward of a whole model under CP: loss, time, peak memory by tag"));
  auto kernels = upipe::apps::add_bench_kernels(*app.add_subcommand(
      "bench-kernels", "Single-op timings: Llama GEMMs, fused attention, memory-bound kernels vs a device copy"));
  auto plan = upipe::apps::add_plan(*app.add_subcommand(
      "plan", "The longest sequence each strategy fits on C GPUs, the checkpoint policy and the recommended U"));
  auto bench_steps = upipe::apps::add_bench(*app.add_subcommand(
      "bench", "Whole-step benchmarks over strategy x U x S: tokens/s/GPU, TFLOP/s, MFU, peak by tag, checked"));
  auto report = upipe::apps::add_report(*app.add_subcommand(
      "report", "Plots (SVG) of bench, bench-attention and plan results: memory by tag, throughput and peak vs S, U"));
  auto tensorboard = upipe::apps::add_tensorboard(*app.add_subcommand(
      "tensorboard", "Write a train --metrics-json file as TensorBoard scalars, once or as the run goes (--follow)"));
  auto comm = upipe::apps::add_bench_comm(*app.add_subcommand(
      "bench-comm", "The strategies' collectives at their message sizes: time, algorithm and bus bandwidth"));
  auto export_model = upipe::apps::add_export(*app.add_subcommand(
      "export", "Write a training checkpoint's weights, or a base with a LoRA adapter merged, as a Hugging Face model directory"));
  auto prepare = upipe::apps::add_prepare_data(*app.add_subcommand(
      "prepare-data", "Tokenize documents (text, JSONL, Parquet) with a model's tokenizer into a corpus for --data"));
  auto adamw = upipe::apps::add_bench_adamw(*app.add_subcommand(
      "bench-adamw", "The offloaded optimizer's host AdamW in parameters per second (scripts/bench_adamw.py: vs PyTorch)"));
  auto eval = upipe::apps::add_eval(*app.add_subcommand(
      "eval", "Held-out loss under CP, forward only: mean, perplexity and loss by position in the context"));
  upipe::apps::check_every_flag(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Bad flags are bad input: exit 2 like every other refusal (0 for --help).
    if (e.get_exit_code() == 0) return app.exit(e);
    const bool conversion = dynamic_cast<const CLI::ConversionError*>(&e) != nullptr;
    std::fprintf(stderr, "upipe: error: %s%s\nRun with --help for the flags and their values.\n",
                 explain_parse_error(app, e, argc, argv).c_str(),
                 conversion ? " (a number in the flag's range: whole numbers up to 2147483647 for counts of ranks, "
                              "heads or layers; see --help)"
                            : "");
    return 2;
  }
  try {
    // Under a launcher every process runs one rank; rank 0 speaks for the job (errors
    // still reach stderr from every rank).
    if (const auto env = upipe::launcher_environment(); env && env->rank > 0 && !std::freopen("/dev/null", "w", stdout))
      throw upipe::io_error("cannot silence rank " + std::to_string(env->rank) + "'s output");
    if (app.got_subcommand("train")) return train();
    if (app.got_subcommand("bench-attention")) return bench();
    if (app.got_subcommand("model-config")) return model();
    if (app.got_subcommand("step")) return step();
    if (app.got_subcommand("bench-kernels")) return kernels();
    if (app.got_subcommand("plan")) return plan();
    if (app.got_subcommand("bench")) return bench_steps();
    if (app.got_subcommand("report")) return report();
    if (app.got_subcommand("tensorboard")) return tensorboard();
    if (app.got_subcommand("bench-comm")) return comm();
    if (app.got_subcommand("export")) return export_model();
    if (app.got_subcommand("prepare-data")) return prepare();
    if (app.got_subcommand("eval")) return eval();
    if (app.got_subcommand("bench-adamw")) return adamw();
  } catch (const std::exception& e) {
    return report_error(e);
  }
  return 0;
}
