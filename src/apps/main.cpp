// The upipe command line.
#include <cstdio>
#include <exception>

#include "apps/commands.hpp"
#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "core/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"upipe: long-context training with untied Ulysses (UPipe) context parallelism"};
  app.require_subcommand(1);
  upipe::apps::command_runner run;
  auto bench = upipe::apps::add_bench_attention(*app.add_subcommand(
      "bench-attention", "Attention layer forward+backward under CP: time, memory, bytes, error vs reference"));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (app.got_subcommand("bench-attention")) return bench();
  } catch (const upipe::config_error& e) {
    std::fprintf(stderr, "upipe: error: %s\n", e.what());
    return 2;
  } catch (const upipe::io_error& e) {
    std::fprintf(stderr, "upipe: error: %s\n", e.what());
    return 2;
  } catch (const upipe::out_of_memory_error& e) {
    std::fprintf(stderr, "upipe: error: %s\n", e.what());
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "upipe: internal error: %s\n", e.what());
    return 4;
  }
  return 0;
}
