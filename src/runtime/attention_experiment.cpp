#include "runtime/attention_experiment.hpp"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>

#include <nlohmann/json.hpp>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "cp/attention_layer.hpp"
#include "cp/reference.hpp"
#include "formats/npy.hpp"
#include "runtime/cp_group.hpp"

namespace upipe {

namespace {

// What one rank hands back: its shard of the outputs and its partial weight gradients.
struct rank_output {
  std::vector<position_run> positions;
  std::vector<float> y, attn_out, d_x, d_wq, d_wk, d_wv, d_wo, d_q_norm, d_k_norm;
};

void scatter_rows(std::vector<double>& global, std::int64_t width, const std::vector<position_run>& positions,
                  const std::vector<float>& local) {
  for (const auto& run : positions)
    std::copy_n(local.begin() + run.token_begin * width, run.count * width, global.begin() + run.position_begin * width);
}

std::vector<float> download(backend& be, const tensor& t) {
  std::vector<float> host(static_cast<std::size_t>(t.numel()));
  be.download_f32(host.data(), t);
  return host;
}

struct rank_tensors {
  tensor wq, wk, wv, wo, gq, gk, gv, go, x, d_y, y, d_x;
  tensor q_norm, k_norm, g_q_norm, g_k_norm;  // with qk-norm
};

rank_tensors allocate_rank(const attention_config& c, backend& be, const attention_inputs* in,
                           const std::vector<position_run>& positions) {
  const std::int64_t s = c.local_tokens(), D = c.model_dim, hd = std::int64_t{c.heads} * c.head_dim,
                     kd = std::int64_t{c.kv_heads} * c.head_dim;
  const dtype w = be.work_dtype();
  rank_tensors t;
  t.wq = be.allocate(mem_tag::weights, w, {hd, D}, "wq");
  t.wk = be.allocate(mem_tag::weights, w, {kd, D}, "wk");
  t.wv = be.allocate(mem_tag::weights, w, {kd, D}, "wv");
  t.wo = be.allocate(mem_tag::weights, w, {D, hd}, "wo");
  t.gq = be.allocate_zeroed(mem_tag::grads, dtype::f32, {hd, D}, "grad_wq");
  t.gk = be.allocate_zeroed(mem_tag::grads, dtype::f32, {kd, D}, "grad_wk");
  t.gv = be.allocate_zeroed(mem_tag::grads, dtype::f32, {kd, D}, "grad_wv");
  t.go = be.allocate_zeroed(mem_tag::grads, dtype::f32, {D, hd}, "grad_wo");
  t.x = be.allocate(mem_tag::activations, w, {s, D}, "x");
  t.d_y = be.allocate(mem_tag::activations, w, {s, D}, "d_y");
  t.y = be.allocate(mem_tag::activations, w, {s, D}, "y");
  t.d_x = be.allocate_zeroed(mem_tag::activations, dtype::f32, {s, D}, "d_x");
  if (c.qk_norm) {
    t.q_norm = be.allocate(mem_tag::weights, w, {1, c.head_dim}, "q_norm");
    t.k_norm = be.allocate(mem_tag::weights, w, {1, c.head_dim}, "k_norm");
    t.g_q_norm = be.allocate_zeroed(mem_tag::grads, dtype::f32, {1, c.head_dim}, "grad_q_norm");
    t.g_k_norm = be.allocate_zeroed(mem_tag::grads, dtype::f32, {1, c.head_dim}, "grad_k_norm");
    if (in != nullptr) {
      be.upload_f32(t.q_norm, in->q_norm.data());
      be.upload_f32(t.k_norm, in->k_norm.data());
    }
  }
  if (in != nullptr) {
    be.upload_f32(t.wq, in->wq.data());
    be.upload_f32(t.wk, in->wk.data());
    be.upload_f32(t.wv, in->wv.data());
    be.upload_f32(t.wo, in->wo.data());
    be.upload_f32(t.x, shard_rows(in->x, D, positions, s).data());
    be.upload_f32(t.d_y, shard_rows(in->d_y, D, positions, s).data());
  }
  return t;
}

// Forward and backward of the layer on one rank; rank 0 fills the measurements.
void run_rank(const attention_config& c, backend& be, communicator& comm, const attention_inputs* in,
              const std::vector<std::int64_t>& documents, rank_output& out, experiment_result* result) {
  attention_layer layer(c, be, {&comm, &comm});
  layer.strategy().set_documents(documents);
  out.positions = layer.strategy().local_positions(comm.rank());
  rank_tensors t = allocate_rank(c, be, in, out.positions);
  const attention_weights w = {t.wq.matrix(), t.wk.matrix(), t.wv.matrix(), t.wo.matrix(), t.q_norm.matrix(),
                               t.k_norm.matrix(), {}};
  const attention_grads g = {t.gq.matrix(), t.gk.matrix(), t.gv.matrix(), t.go.matrix(), t.g_q_norm.matrix(),
                             t.g_k_norm.matrix(), {}};
  comm.barrier();
  comm.reset_counters();
  be.synchronize();
  const auto start = std::chrono::steady_clock::now();
  be.ledger().reset_window();
  attention_layer::context ctx = layer.forward(t.x.matrix(), w, t.y.matrix());
  const std::size_t forward_peak = be.ledger().window_peak(mem_tag::attention);
  std::size_t host_peak = be.ledger().window_peak(mem_tag::attention_host);
  be.ledger().reset_window();
  layer.backward(ctx, t.x.matrix(), w, t.d_y.matrix(), t.d_x.matrix(), g);
  const std::size_t backward_peak = be.ledger().window_peak(mem_tag::attention);
  host_peak = std::max(host_peak, be.ledger().window_peak(mem_tag::attention_host));
  be.synchronize();
  comm.barrier();
  const auto stop = std::chrono::steady_clock::now();
  if (result != nullptr) {
    result->time_ms = std::chrono::duration<double, std::milli>(stop - start).count();
    result->attention_forward_peak = forward_peak;
    result->attention_backward_peak = backward_peak;
    result->attention_peak_bytes = std::max(forward_peak, backward_peak);
    result->attention_host_peak = host_peak;
    const stage_plan& plan = layer.strategy().plan();
    const dtype work = be.work_dtype();
    result->plan_forward_peak = plan.forward_peak(work);
    result->plan_backward_peak = plan.backward_peak(work);
    result->plan_host_peak = plan.host_peak(work);
    result->plan_bytes_by_label = plan.bytes_by_label(work);
    result->plan_saved_bytes_by_label = plan.saved_bytes_by_label(work);
    for (const auto& [link, bytes] : plan.bytes_by_link(work)) result->plan_bytes_by_link[std::string(link_name(link))] = bytes;
    result->peak_bytes = be.ledger().peaks_by_name();
    result->device_peak_bytes = be.ledger().device_peak();
    result->arena_high_water = be.device_arena().high_water();
    result->driver_peak_bytes = be.driver_peak_bytes();
    const comm_counters& counters = comm.counters();
    for (std::size_t i = 0; i < collective_count; ++i)
      if (counters.calls[i] > 0) result->bytes_sent[std::string(collective_name(static_cast<collective>(i)))] = counters.bytes[i];
    for (const auto& [label, bytes] : counters.bytes_by_label) result->bytes_sent_by_label[label] = bytes;
  }
  if (in != nullptr) {
    out.y = download(be, t.y);
    out.attn_out = download(be, ctx.out);
    out.d_x = download(be, t.d_x);
    out.d_wq = download(be, t.gq);
    out.d_wk = download(be, t.gk);
    out.d_wv = download(be, t.gv);
    out.d_wo = download(be, t.go);
    if (c.qk_norm) {
      out.d_q_norm = download(be, t.g_q_norm);
      out.d_k_norm = download(be, t.g_k_norm);
    }
  }
}

void add_into(std::vector<double>& sum, const std::vector<float>& part) {
  if (sum.empty()) sum.assign(part.size(), 0.0);
  for (std::size_t i = 0; i < part.size(); ++i) sum[i] += part[i];
}

struct assembled {
  std::vector<double> y, attn_out, d_x, d_wq, d_wk, d_wv, d_wo, d_q_norm, d_k_norm;
};

assembled assemble(const attention_config& c, const std::vector<rank_output>& ranks) {
  const std::int64_t S = c.seq_len, D = c.model_dim, hd = std::int64_t{c.heads} * c.head_dim;
  assembled a;
  a.y.assign(static_cast<std::size_t>(S * D), 0.0);
  a.d_x.assign(a.y.size(), 0.0);
  a.attn_out.assign(static_cast<std::size_t>(S * hd), 0.0);
  for (const rank_output& r : ranks) {
    scatter_rows(a.y, D, r.positions, r.y);
    scatter_rows(a.d_x, D, r.positions, r.d_x);
    scatter_rows(a.attn_out, hd, r.positions, r.attn_out);
    add_into(a.d_wq, r.d_wq);
    add_into(a.d_wk, r.d_wk);
    add_into(a.d_wv, r.d_wv);
    add_into(a.d_wo, r.d_wo);
    add_into(a.d_q_norm, r.d_q_norm);
    add_into(a.d_k_norm, r.d_k_norm);
  }
  return a;
}

void dump(const std::string& dir, const attention_config& c, const attention_inputs& in, const assembled& a) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw io_error("cannot create dump directory " + dir + ": " + ec.message());
  const std::int64_t S = c.seq_len, D = c.model_dim, hd = std::int64_t{c.heads} * c.head_dim,
                     kd = std::int64_t{c.kv_heads} * c.head_dim;
  auto put = [&](const char* name, std::initializer_list<std::int64_t> shape, std::span<const float> v) {
    write_npy(dir + "/" + name + ".npy", std::vector<std::int64_t>(shape), v);
  };
  auto put_d = [&](const char* name, std::initializer_list<std::int64_t> shape, const std::vector<double>& v) {
    put(name, shape, std::vector<float>(v.begin(), v.end()));
  };
  put("x", {S, D}, in.x);
  put("wq", {hd, D}, in.wq);
  put("wk", {kd, D}, in.wk);
  put("wv", {kd, D}, in.wv);
  put("wo", {D, hd}, in.wo);
  put("d_y", {S, D}, in.d_y);
  put_d("y", {S, D}, a.y);
  put_d("attn_out", {S, hd}, a.attn_out);
  put_d("d_x", {S, D}, a.d_x);
  put_d("d_wq", {hd, D}, a.d_wq);
  put_d("d_wk", {kd, D}, a.d_wk);
  put_d("d_wv", {kd, D}, a.d_wv);
  put_d("d_wo", {D, hd}, a.d_wo);
  if (c.qk_norm) {
    put("q_norm", {c.head_dim}, in.q_norm);
    put("k_norm", {c.head_dim}, in.k_norm);
    put_d("d_q_norm", {c.head_dim}, a.d_q_norm);
    put_d("d_k_norm", {c.head_dim}, a.d_k_norm);
  }
  nlohmann::json meta = {{"seq_len", S}, {"heads", c.heads}, {"kv_heads", c.kv_heads}, {"head_dim", c.head_dim},
                         {"model_dim", D}, {"cp", c.cp}, {"head_chunk", c.head_chunk},
                         {"strategy", strategy_name(c.strategy)}, {"rope_theta", c.rope.theta},
                         {"rope_llama3_scaling", c.rope.scaling.kind == rope_kind::llama3}, {"rope_factor", c.rope.scaling.factor},
                         {"rope_low_freq_factor", c.rope.scaling.low_freq_factor},
                         {"rope_high_freq_factor", c.rope.scaling.high_freq_factor},
                         {"rope_original_max_position", c.rope.scaling.original_max_position},
                         {"qk_norm", c.qk_norm}, {"norm_eps", c.norm_eps}, {"window", c.window}};
  std::ofstream f(dir + "/config.json");
  f << meta.dump(2) << "\n";
  if (!f) throw io_error("writing " + dir + "/config.json failed");
}

void compare(experiment_result& result, const assembled& a, const attention_outputs& ref) {
  result.rel_error = {{"out", relative_error(a.y, ref.y)},         {"attn_out", relative_error(a.attn_out, ref.attn_out)},
                      {"d_input", relative_error(a.d_x, ref.d_x)}, {"d_wq", relative_error(a.d_wq, ref.d_wq)},
                      {"d_wk", relative_error(a.d_wk, ref.d_wk)},  {"d_wv", relative_error(a.d_wv, ref.d_wv)},
                      {"d_wo", relative_error(a.d_wo, ref.d_wo)}};
  if (!ref.d_q_norm.empty()) {
    result.rel_error["d_q_norm"] = relative_error(a.d_q_norm, ref.d_q_norm);
    result.rel_error["d_k_norm"] = relative_error(a.d_k_norm, ref.d_k_norm);
  }
  double worst = 0;
  for (const auto& [name, e] : result.rel_error) worst = std::max(worst, e);
  result.max_rel_error = worst;
}

}  // namespace

experiment_result run_attention_experiment(attention_config config, const experiment_options& options) {
  validate(config);
  experiment_result result;
  result.config = config;
  result.backend = options.backend;
  const bool data = options.backend != backend_kind::meta;
  const attention_inputs in = data ? random_attention_inputs(config, options.seed) : attention_inputs{};
  std::vector<rank_output> outputs(static_cast<std::size_t>(config.cp));
  run_cp_group(options.backend, options.limits, config.cp, [&](int rank, backend& be, communicator& comm) {
    run_rank(config, be, comm, data ? &in : nullptr, options.documents, outputs[rank], rank == 0 ? &result : nullptr);
  }, group_run::every_rank, options.comm);
  if (!data) return result;
  const assembled a = assemble(config, outputs);
  if (!options.dump_dir.empty()) dump(options.dump_dir, config, in, a);
  if (options.check) compare(result, a, reference_attention_layer(config, in, options.documents));
  return result;
}

}  // namespace upipe
