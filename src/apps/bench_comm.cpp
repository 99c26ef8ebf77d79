// `upipe bench-comm`: the collectives of the CP strategies at their real message sizes,
// nccl-tests style (time, algorithm and bus bandwidth), on the group's communicator: the
// distinct messages of each strategy's stage plan (UPipe's per-stage all-to-all of the
// query heads and of a kv block, Ulysses' all-heads all-to-alls, ring attention's K/V
// send/recv step), for each sequence length.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/comm_flags.hpp"
#include "apps/commands.hpp"
#include "apps/flag_checks.hpp"
#include "apps/json_file.hpp"
#include "apps/model_flags.hpp"
#include "apps/sizes.hpp"
#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "core/limits.hpp"
#include "cp/attention_config.hpp"
#include "cp/stage_plan.hpp"
#include "cp/strategy_table.hpp"
#include "model/config.hpp"
#include "model/transformer.hpp"
#include "runtime/cp_group.hpp"

namespace upipe::apps {

namespace {

struct bench_comm_flags {
  std::string model = "llama3-8b", config_path, backend = "cpu", json_path;
  comm_flags comm;
  std::vector<std::string> seq_lens{"4K"};
  int cp = 4, head_chunk = 0, repeats = 10;
  double memory_gib = 4;
};

// One message of one strategy: all-to-all of `bytes` per rank (its whole send buffer),
// or a ring step sending `bytes` to the next rank while receiving as many.
struct message {
  std::string name;
  bool ring = false;
  std::int64_t seq_len = 0;
  std::size_t bytes = 0;
};

struct timing {
  message m;
  double ms = 0;
};

// The forward messages of every strategy in the table as its stage plan sends them (U for
// the rows that choose it, each row's default N), each distinct size once under the labels
// that send it: "upipe U=8 a2a_q/a2a_o" is a stage's query (and output) all-to-all, "ring
// ring_kv" a ring step. A mesh's collectives run on sub-groups of the CP group, which this
// command does not form: its rows are left out.
std::vector<message> messages(const model_config& m, int C, int U, std::int64_t S, dtype work) {
  std::vector<message> out;
  for (const strategy_row& row : strategy_rows()) {
    if (row.mesh) continue;
    const bool chosen = row.heads == head_stages::chosen;
    const attention_config c = attention_config_for(m, {row.kind, C, chosen ? U : 0, 1, 0}, S);
    const stage_plan plan = make_stage_plan(c, 0);
    std::string name(row.name);
    if (chosen) name += " U=" + std::to_string(U);
    if (c.chunked()) name += " N=" + std::to_string(c.seq_chunks);
    for (const plan_message& msg : plan.forward.messages()) {
      if (msg.link != plan_link::all_to_all && msg.link != plan_link::ring) continue;
      const auto bytes = static_cast<std::size_t>(msg.bytes(work));
      const bool ring = msg.link == plan_link::ring;
      const auto same = [&](const message& o) {
        return o.name.rfind(name + " ", 0) == 0 && o.bytes == bytes && o.ring == ring;
      };
      auto it = std::find_if(out.begin(), out.end(), same);
      if (it == out.end())
        out.push_back({name + " " + msg.label, ring, S, bytes});
      else if (("/" + it->name.substr(name.size() + 1) + "/").find(std::string("/") + msg.label + "/") == std::string::npos)
        it->name += std::string("/") + msg.label;
    }
  }
  return out;
}

int run(const bench_comm_flags& f) {
  const backend_kind kind = parse_backend_kind(f.backend);
  if (kind == backend_kind::meta) throw config_error("--backend meta moves no bytes: use cpu or cuda");
  if (f.cp < 2) throw config_error("--cp " + std::to_string(f.cp) + ": a collective needs at least 2 ranks");
  require_within(f.repeats, 1, limits::repeats, "--repeats", "10");
  const model_config m = load_model(f.model, f.config_path);
  const int U = f.head_chunk > 0 ? f.head_chunk : f.cp;
  const std::vector<int> valid = valid_head_chunks(m.num_heads, f.cp);
  if (valid.empty())
    throw config_error("--cp " + std::to_string(f.cp) + " does not divide the " + std::to_string(m.num_heads) +
                       " heads of " + m.name + ": use a C that does, for example 2, 4 or 8");
  if (std::find(valid.begin(), valid.end(), U) == valid.end())
    throw config_error("--head-chunk " + std::to_string(U) + " is not valid for " + std::to_string(m.num_heads) +
                       " heads over " + std::to_string(f.cp) + " ranks (C must divide U and U must divide H), for "
                       "example --head-chunk " + std::to_string(valid.front()));
  const comm_options comm = f.comm.options();
  std::vector<std::int64_t> lengths;
  for (const std::string& t : f.seq_lens) {
    const std::int64_t S = parse_seq_len(t, "--seq-len");
    if (S % (2 * f.cp) != 0)
      throw config_error("--seq-len " + t + " is not a multiple of 2 x --cp = " + std::to_string(2 * f.cp) +
                         " (ring's zigzag halves)");
    lengths.push_back(S);
  }
  const memory_limits limits = run_limits(kind, f.memory_gib, checkpoint_location::device);
  std::vector<timing> results;
  run_cp_group(
      kind, limits, f.cp,
      [&](int rank, backend& be, communicator& c) {
        // Messages in the backend's working dtype, as the strategies send them.
        std::vector<message> all;
        for (std::int64_t S : lengths)
          for (message& msg : messages(m, f.cp, U, S, be.work_dtype())) all.push_back(std::move(msg));
        std::size_t largest = 0;
        for (const message& msg : all) largest = std::max(largest, msg.bytes);
        // Beside what the backend already holds (on a GPU, the libraries' workspaces).
        const std::size_t in_use = be.device_arena().in_use();
        if (2 * largest + in_use > limits.device_bytes)
          throw config_error("the largest message at --seq-len up to " + std::to_string(*std::max_element(lengths.begin(), lengths.end())) + ", " +
                             std::to_string(largest) + " bytes, needs --memory-gib of at least " +
                             real_text(static_cast<double>(2 * largest + in_use) / (1 << 30) + 0.01) +
                             "; shorten --seq-len or raise --memory-gib");
        const auto words = static_cast<std::int64_t>((largest + 3) / 4);
        tensor send = be.allocate_zeroed(mem_tag::comm, dtype::f32, {words}, "comm_send");
        tensor recv = be.allocate_zeroed(mem_tag::comm, dtype::f32, {words}, "comm_recv");
        const auto once = [&](const message& msg) {
          if (msg.ring)
            c.send_recv(send.data(), msg.bytes, (rank + 1) % f.cp, recv.data(), msg.bytes, (rank + f.cp - 1) % f.cp,
                        "ring");
          else
            c.all_to_all(send.data(), recv.data(), msg.bytes / f.cp, "a2a");
        };
        for (const message& msg : all) {
          once(msg);  // warm-up (NCCL connects lazily)
          be.synchronize();
          c.barrier();
          const auto start = std::chrono::steady_clock::now();
          for (int i = 0; i < f.repeats; ++i) once(msg);
          be.synchronize();  // the clock stops here: the barrier below is not the message's
          const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
          c.barrier();
          if (rank == 0) results.push_back({msg, ms / f.repeats});
        }
      },
      group_run::every_rank, comm);
  std::printf("# upipe bench-comm  model=%s  C=%d  U=%d  backend=%s  comm=%s  repeats=%d\n", m.name.c_str(), f.cp, U,
              f.backend.c_str(), f.comm.kind.c_str(), f.repeats);
  std::printf("# bytes: one rank's send buffer; algbw = bytes / time; busbw = algbw x (C-1)/C for all-to-all, "
              "algbw for send/recv (nccl-tests)\n");
  std::printf("%-44s %9s %14s %10s %10s %10s\n", "collective", "S", "bytes", "time_us", "algbw", "busbw");
  nlohmann::json rows = nlohmann::json::array();
  for (const timing& t : results) {
    const double algbw = static_cast<double>(t.m.bytes) / (t.ms * 1e-3) / 1e9;
    const double busbw = t.m.ring ? algbw : algbw * (f.cp - 1) / f.cp;
    std::printf("%-44s %9lld %14zu %10.1f %10.2f %10.2f\n", t.m.name.c_str(), static_cast<long long>(t.m.seq_len),
                t.m.bytes, t.ms * 1e3, algbw, busbw);
    rows.push_back({{"collective", t.m.name}, {"seq_len", t.m.seq_len}, {"bytes", t.m.bytes}, {"time_us", t.ms * 1e3},
                    {"algbw_gbytes_per_s", algbw}, {"busbw_gbytes_per_s", busbw}, {"cp", f.cp}, {"head_chunk", U},
                    {"model", m.name}, {"backend", f.backend}, {"comm", f.comm.kind}});
  }
  if (!f.json_path.empty()) write_json_file(f.json_path, rows, 1);
  return 0;
}

}  // namespace

command_runner add_bench_comm(CLI::App& app) {
  auto f = std::make_shared<bench_comm_flags>();
  add_model_flags(app, f->model, f->config_path);
  app.add_option("--backend", f->backend, "cpu or cuda")->capture_default_str();
  add_comm_flags(app, f->comm, false);
  app.add_option("--cp", f->cp, "ranks in the group")->capture_default_str();
  app.add_option("--head-chunk", f->head_chunk, "UPipe's U (default C)");
  app.add_option("--seq-len", f->seq_lens, "sequence lengths S (K and M suffixes)")->delimiter(',')->capture_default_str();
  app.add_option("--repeats", f->repeats, "timed repeats per message after one warm-up")->capture_default_str();
  app.add_option("--memory-gib", f->memory_gib, "arena per rank, GiB")->capture_default_str();
  app.add_option("--json", f->json_path, "write the rows as JSON")->check(output_file_flag("--json"));
  return [f] { return run(*f); };
}

}  // namespace upipe::apps
