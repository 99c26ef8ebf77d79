// Subcommands of the `upipe` program: each registers its flags on a CLI11 subcommand
// and returns the function that runs it (exit code).
#pragma once

#include <functional>

#include <CLI/CLI.hpp>

namespace upipe::apps {

using command_runner = std::function<int()>;

command_runner add_bench_attention(CLI::App& app);
command_runner add_model_config(CLI::App& app);
command_runner add_step(CLI::App& app);
command_runner add_train(CLI::App& app);
command_runner add_bench_kernels(CLI::App& app);
command_runner add_plan(CLI::App& app);
command_runner add_bench(CLI::App& app);
command_runner add_report(CLI::App& app);
command_runner add_tensorboard(CLI::App& app);
command_runner add_bench_comm(CLI::App& app);
command_runner add_export(CLI::App& app);
command_runner add_prepare_data(CLI::App& app);
command_runner add_eval(CLI::App& app);
command_runner add_bench_adamw(CLI::App& app);

}  // namespace upipe::apps
