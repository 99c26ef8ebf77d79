// `upipe bench-adamw`: the offloaded optimizer's host AdamW in parameters per second,
// with the working copy it writes for the device and without (PyTorch's work). With
// --serve it reads "copy", "f32" or "quit" lines on stdin and answers each step's seconds,
// so that scripts/bench_adamw.py interleaves it with PyTorch's CPU AdamW in one run.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "apps/commands.hpp"
#include "apps/sizes.hpp"
#include "apps/state_flags.hpp"
#include "bench/adamw_bench.hpp"
#include "core/error.hpp"

namespace upipe::apps {

namespace {

struct adamw_flags {
  std::string backend = "cpu", params = "64M", json_path, moments = "fp32", master = "fp32", part = "whole";
  int tensors = 16, threads = 0, repeats = 5;
  bool serve = false;
};

int serve(host_adamw_bench& bench) {
  std::printf("ready %lld %d\n", static_cast<long long>(bench.params()), bench.threads());
  std::fflush(stdout);
  for (std::string line; std::getline(std::cin, line) && line != "quit";) {
    if (line != "copy" && line != "f32") throw config_error("bench-adamw --serve: '" + line + "' is not copy, f32 or quit");
    std::printf("%.9f\n", bench.step(line == "copy"));
    std::fflush(stdout);
  }
  return 0;
}

int run(const adamw_flags& f) {
  const backend_kind kind = parse_backend_kind(f.backend);
  if (kind == backend_kind::meta) throw config_error("bench-adamw times real memory: use --backend cpu or cuda");
  if (f.repeats < 1) throw config_error("--repeats " + std::to_string(f.repeats) + " must be at least 1 (e.g. 5)");
  const std::int64_t params = parse_count(f.params, "--params");
  const dtype work = kind == backend_kind::cpu ? dtype::f32 : dtype::bf16;
  const adamw_state_format format{parse_moments(f.moments), parse_master(f.master)};
  if (f.part != "whole" && f.part != "master")
    throw config_error("--part " + f.part + " is not known: whole (the update, --offload optimizer) or master (the "
                       "master's half from f32 steps, --offload master)");
  const adamw_part part = f.part == "master" ? adamw_part::master : adamw_part::whole;
  // The host pool holds the shards, with room for the arena's alignment of each.
  const std::size_t host =
      host_adamw_bench::host_bytes(params, work, format, part) + (std::size_t{8} << 20) * (f.tensors * 8 + 1);
  auto be = make_backend(kind, {std::size_t{64} << 20, host});
  host_adamw_bench bench(*be, params, f.tensors, f.threads, format, part);
  if (f.serve) return serve(bench);
  bench.step(true);  // first touch of the pages, and moments past zero
  double best_copy = 1e30, best_f32 = 1e30;
  for (int r = 0; r < f.repeats; ++r) {
    best_copy = std::min(best_copy, bench.step(true));
    best_f32 = std::min(best_f32, bench.step(false));
  }
  std::printf("# upipe bench-adamw  backend=%s  params=%lld in %d tensors  threads=%d  best of %d  (working copy: %s)  "
              "state: --optimizer-state %s --master-weights %s, %s\n",
              f.backend.c_str(), static_cast<long long>(params), f.tensors, bench.threads(), f.repeats,
              std::string(dtype_name(work)).c_str(), f.moments.c_str(), f.master.c_str(),
              part == adamw_part::master ? "the master's half from f32 steps" : "the whole update");
  std::printf("%-34s %12s %14s\n", "work", "time_ms", "Gparams/s");
  const double n = static_cast<double>(params);
  std::printf("%-34s %12.3f %14.3f\n", "AdamW + working copy (offload)", best_copy * 1e3, n / best_copy / 1e9);
  std::printf("%-34s %12.3f %14.3f\n", "AdamW, f32 state only", best_f32 * 1e3, n / best_f32 / 1e9);
  if (!f.json_path.empty()) {
    nlohmann::json j = {{"backend", f.backend},     {"params", params},
                        {"tensors", f.tensors},     {"threads", bench.threads()},
                        {"repeats", f.repeats},     {"working_copy_dtype", dtype_name(work)},
                        {"copy_seconds", best_copy}, {"f32_seconds", best_f32},
                        {"optimizer_state", f.moments}, {"master_weights", f.master}, {"part", f.part}};
    std::ofstream out(f.json_path);
    out << j.dump(2) << "\n";
    if (!out) throw io_error("cannot write " + f.json_path);
  }
  return 0;
}

}  // namespace

command_runner add_bench_adamw(CLI::App& app) {
  auto f = std::make_shared<adamw_flags>();
  app.add_option("--backend", f->backend, "cpu (f32 working copy) or cuda (bf16 working copy, pinned host memory)")
      ->capture_default_str();
  app.add_option("--params", f->params, "parameters updated per step (e.g. 64M, 1024M)")->capture_default_str();
  app.add_option("--tensors", f->tensors, "equal shards the parameters come in")->capture_default_str();
  app.add_option("--threads", f->threads, "host threads (0: every core)")->capture_default_str();
  app.add_option("--repeats", f->repeats, "timed steps of each kind (the fastest reported)")->capture_default_str();
  app.add_flag("--serve", f->serve, "answer 'copy' or 'f32' lines on stdin with a step's seconds (scripts/bench_adamw.py)");
  app.add_option("--optimizer-state", f->moments, "AdamW's moments: fp32, bf16 or 8bit")->capture_default_str();
  app.add_option("--master-weights", f->master, "fp32 or bf16-kahan")->capture_default_str();
  app.add_option("--part", f->part,
                 "whole (the update, as --offload optimizer runs it) or master (the master's half from f32 steps, as "
                 "--offload master runs it)")
      ->capture_default_str();
  app.add_option("--json", f->json_path, "write the timings as JSON");
  return [f] { return run(*f); };
}

}  // namespace upipe::apps
