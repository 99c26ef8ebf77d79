// `upipe step`: one forward and backward of a whole model under CP (the model-level
// entry), reporting the loss, the time and the peak memory by tag of rank 0.
#include <cstdio>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "apps/commands.hpp"
#include "apps/flag_checks.hpp"
#include "apps/cp_flags.hpp"
#include "apps/json_file.hpp"
#include "apps/model_flags.hpp"
#include "apps/sizes.hpp"
#include "core/error.hpp"
#include "model/adapter_files.hpp"
#include "model/model_step.hpp"
#include "train/data.hpp"
#include "formats/safetensors.hpp"

namespace upipe::apps {

namespace {

struct step_flags {
  std::string model = "tiny-llama", config_path, weights_path, tokens_path, json_path, grads_path;
  std::string backend = "cpu", policy, seq_len = "256", lora, adapter;
  cp_flags mesh{"upipe", 4};
  std::int64_t mlp_tile = 0, loss_chunk = 0;
  unsigned long long seed = 1;
  double memory_gib = 8, host_memory_gib = 0;
};


// The weights' gradients under Hugging Face names, or with LoRA the adapters' under PEFT's.
void write_grads(const step_flags& f, const model_config& c, const lora_config& lora, const model_step_result& r) {
  std::vector<safetensors_tensor> tensors;
  if (lora.enabled()) {
    for (const parameter_spec& p : lora_parameter_specs(c, lora))
      tensors.push_back({std::string(peft_name_prefix) + p.name, p.shape, r.grads.at(p.name), dtype::f32});
  } else {
    for (const parameter_spec& p : parameter_specs(c)) tensors.push_back({p.name, p.shape, r.grads.at(p.name), dtype::f32});
  }
  write_safetensors(f.grads_path, tensors);
}

// LoRA: an adapter directory's settings and weights (--adapter), or fresh adapters (--lora,
// PEFT's initialization from --seed); none without either.
lora_config choose_adapters(const step_flags& f, const model_config& model, bool data, host_weights& adapters) {
  if (f.adapter.empty()) {
    if (f.lora.empty()) return {};
    const lora_config lora = parse_lora(f.lora, model);
    if (data) adapters = initial_adapters(model, lora, f.seed);
    return lora;
  }
  const lora_config lora = read_adapter_config(f.adapter, model).lora;
  if (!f.lora.empty() && !(parse_lora(f.lora, model) == lora))
    throw config_error("--lora " + f.lora + " differs from the adapters in " + f.adapter + " (" + lora_text(lora) +
                       "); drop --lora");
  if (data) adapters = read_adapter_weights(f.adapter, model, lora);
  return lora;
}

int run(const step_flags& f) {
  model_step_request req;
  req.model = load_model(f.model, f.config_path);
  req.backend = parse_backend_kind(f.backend);
  req.cp = f.mesh.settings();
  const std::int64_t S = parse_scored_seq_len(f.seq_len);
  req.options = {f.mlp_tile, f.loss_chunk, parse_checkpoint_policy(f.policy)};
  const resolved_step resolved = resolve_step(sizes_of(req, S, f.memory_gib, f.host_memory_gib));
  req.options = resolved.step;
  req.limits = resolved.limits;
  const bool data = req.backend != backend_kind::meta;
  const std::string weights_path = f.weights_path.empty() ? default_weights(f.model, f.config_path) : f.weights_path;
  const host_weights weights = !data ? host_weights{}
                               : weights_path.empty() ? random_weights(req.model, f.seed)
                                                      : read_weights(req.model, weights_path);
  // meta reads no tokens; elsewhere the sequence's host copies (the tokens, the padded ids
  // and labels, every rank's shard of them: 24 bytes a token) must fit before any exists.
  if (data)
    require_host_memory(static_cast<std::size_t>(S) * 24,
                        "the host copies of a sequence of " + std::to_string(S) + " tokens (--seq-len)");
  else
    req.shape_only = S;
  const std::vector<std::int32_t> tokens = !data                  ? std::vector<std::int32_t>{}
                                           : f.tokens_path.empty() ? random_tokens(S, req.model.vocab_size, f.seed + 1)
                                                                   : token_file(f.tokens_path, S, req.model.vocab_size).sequence(0);
  host_weights adapters;
  req.options.lora = choose_adapters(f, req.model, data, adapters);
  const model_step_result r = run_model_step(req, weights, tokens, adapters);
  std::printf("# upipe step  model=%s  backend=%s  attention=%s  cp=%d  S=%lld (padded %lld)  policy=%s\n",
              req.model.name.c_str(), f.backend.c_str(), f.mesh.attention.c_str(), f.mesh.cp, static_cast<long long>(S),
              static_cast<long long>(r.seq_len), req.options.policy.str().c_str());
  if (data) std::printf("loss %.6f over %lld tokens\n", r.loss, static_cast<long long>(r.counted));
  std::printf("time %.1f ms (forward + backward, rank 0)\npeak memory of rank 0 by tag (MiB):\n", r.time_ms);
  for (const auto& [tag, bytes] : r.peak_bytes)
    if (bytes > 0) std::printf("  %-20s %12.1f\n", tag.c_str(), static_cast<double>(bytes) / (1 << 20));
  std::printf("  %-20s %12.1f\n", "device total", static_cast<double>(r.device_peak_bytes) / (1 << 20));
  if (!f.json_path.empty()) {
    nlohmann::json j = {{"model", req.model.name}, {"backend", f.backend}, {"attention", f.mesh.attention}, {"cp", f.mesh.cp},
                        {"seq_len", r.seq_len}, {"time_ms", r.time_ms}, {"peak_bytes", r.peak_bytes},
                        {"device_peak_bytes", r.device_peak_bytes}, {"checkpoint_policy", req.options.policy.str()}};
    j["loss"] = data ? nlohmann::json(r.loss) : nlohmann::json(nullptr);
    write_json_file(f.json_path, j);
  }
  if (!f.grads_path.empty() && data) write_grads(f, req.model, req.options.lora, r);
  return 0;
}

}  // namespace

command_runner add_step(CLI::App& app) {
  auto f = std::make_shared<step_flags>();
  add_model_flags(app, f->model, f->config_path);
  app.add_option("--weights", f->weights_path, "weights: a model directory (one file or shards), its index or a .safetensors file; default: "
                 "the --model directory's, else random");
  app.add_option("--tokens", f->tokens_path, "flat little-endian uint32 token file; default: random tokens");
  app.add_option("--seq-len", f->seq_len, "tokens in the sequence (K and M suffixes)")->capture_default_str();
  app.add_option("--backend", f->backend, "cpu, cuda (bf16, virtual ranks on one GPU) or meta")->capture_default_str();
  add_cp_flags(app, f->mesh);
  app.add_option("--checkpoint-policy", f->policy, "what=input|input+attention,every=K,where=device|host-pinned|host-pageable");
  app.add_option("--mlp-tile", f->mlp_tile, mlp_tile_help);
  app.add_option("--loss-chunk", f->loss_chunk, loss_chunk_help);
  app.add_option("--seed", f->seed, "seed of random weights and tokens")->capture_default_str();
  app.add_option("--memory-gib", f->memory_gib, "arena per rank (cpu or GPU memory), GiB")->capture_default_str();
  app.add_option("--host-memory-gib", f->host_memory_gib, host_memory_gib_help);
  app.add_option("--lora", f->lora, "a LoRA step with fresh adapters: r=N[,alpha=A][,targets=...] (base frozen)");
  app.add_option("--adapter", f->adapter,
                 "a LoRA step with this adapter directory's adapters (upipe's or PEFT's) on the base");
  app.add_option("--json", f->json_path, "write the result as JSON")->check(output_file_flag("--json"));
  app.add_option("--save-grads", f->grads_path,
                 "write the weight gradients as safetensors (with LoRA the adapters', under PEFT's names)")
      ->check(output_file_flag("--save-grads"));
  return [f] { return run(*f); };
}

}  // namespace upipe::apps
