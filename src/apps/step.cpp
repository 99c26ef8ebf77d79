// `upipe step`: one forward and backward of a whole model under CP (the model-level
// entry), reporting the loss, the time and the peak memory by tag of rank 0.
#include <cstdio>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "apps/moe_flags.hpp"
#include "apps/commands.hpp"
#include "apps/flag_checks.hpp"
#include "apps/cp_flags.hpp"
#include "apps/json_file.hpp"
#include "apps/model_flags.hpp"
#include "apps/policy_flags.hpp"
#include "apps/run_config.hpp"
#include "apps/sizes.hpp"
#include "core/error.hpp"
#include "train/run_directory.hpp"
#include "model/adapter_files.hpp"
#include "model/model_step.hpp"
#include "train/data.hpp"
#include "formats/safetensors.hpp"

namespace upipe::apps {

namespace {

// The shared options (model, CP group, sizes, policy) are rows of the run configuration.
struct step_flags {
  std::shared_ptr<run_options> options;
  std::string weights_path, tokens_path, json_path, grads_path, adapter;
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
  const run_config& c = f.options->config();
  if (f.adapter.empty()) {
    if (c.lora.empty()) return {};
    const lora_config lora = parse_lora(c.lora, model);
    if (data) adapters = initial_adapters(model, lora, c.seed);
    return lora;
  }
  const lora_config lora = read_adapter_config(f.adapter, model).lora;
  if (!c.lora.empty() && !(parse_lora(c.lora, model) == lora))
    throw config_error("--lora " + c.lora + " differs from the adapters in " + f.adapter + " (" + lora_text(lora) +
                       "); drop --lora");
  if (data) adapters = read_adapter_weights(f.adapter, model, lora);
  return lora;
}

// --head-chunk auto and --checkpoint-policy auto: the largest U, then the planner's fastest
// policy, whose forward and backward (no optimizer state) fits the arenas, as train chooses
// its own; req.cp.head_chunk set, the policy returned.
checkpoint_policy auto_choices(model_step_request& req, std::int64_t S, const run_config& c) {
  train_options o;
  o.model = req.model;
  const std::int64_t unit = layout_unit(req.cp);
  o.seq_len = (S + unit - 1) / unit * unit;  // as the step pads it
  o.cp = req.cp;
  o.zero = zero_stage::replicated;
  o.tokens = token_source::random;
  o.backend = req.backend;
  o.step = req.options;
  size_step(o, c);
  if (is_auto_head_chunk(c.head_chunk)) {
    std::printf("%s", choose_head_chunk(o, c, is_auto_policy(c.checkpoint_policy)).c_str());
    req.cp.head_chunk = o.cp.head_chunk;
  }
  if (!is_auto_policy(c.checkpoint_policy)) return req.options.policy;
  return auto_policy_or_default(o, c, "");
}

int run(step_flags& f) {
  const run_config& c = f.options->config();
  model_step_request req;
  req.model = load_model(c.model, c.config, c.layers);
  req.backend = parse_backend_kind(c.backend);
  req.cp = cp_of(c);
  const std::int64_t S = parse_scored_seq_len(c.seq_len);
  req.options = {c.mlp_tile, c.loss_chunk,
                 is_auto_policy(c.checkpoint_policy) ? checkpoint_policy{} : parse_checkpoint_policy(c.checkpoint_policy)};
  req.options.attention_arithmetic = parse_attention_dtype(c.attention_dtype);
  if (is_auto_policy(c.checkpoint_policy) || is_auto_head_chunk(c.head_chunk))
    req.options.policy = auto_choices(req, S, c);
  const resolved_step resolved = resolve_step(sizes_of(req, S, c.memory_gib, c.host_memory_gib));
  req.options = resolved.step;
  req.options.router_aux = parse_router_aux_loss(c.router_aux_loss);
  apply_moe(c, req.options);
  req.limits = resolved.limits;
  const bool data = req.backend != backend_kind::meta;
  const std::string weights_path =
      f.weights_path.empty() ? default_weights(c.model, c.config) : resolve_checkpoint(f.weights_path);
  const host_weights weights = !data ? host_weights{}
                               : weights_path.empty() ? random_weights(req.model, c.seed)
                                                      : read_weights(req.model, weights_path);
  // meta reads no tokens; elsewhere the sequence's host copies (the tokens, the padded ids
  // and labels, every rank's shard of them: 24 bytes a token) must fit before any exists.
  if (data)
    require_host_memory(static_cast<std::size_t>(S) * 24,
                        "the host copies of a sequence of " + std::to_string(S) + " tokens (--seq-len)");
  else
    req.shape_only = S;
  const std::vector<std::int32_t> tokens = !data                  ? std::vector<std::int32_t>{}
                                           : f.tokens_path.empty() ? random_tokens(S, req.model.vocab_size, c.seed + 1)
                                                                   : token_file(f.tokens_path, S, req.model.vocab_size).sequence(0);
  host_weights adapters;
  req.options.lora = choose_adapters(f, req.model, data, adapters);
  const model_step_result r = run_model_step(req, weights, tokens, adapters);
  std::printf("# upipe step  model=%s  backend=%s  attention=%s  cp=%d  S=%lld (padded %lld)  policy=%s\n",
              req.model.name.c_str(), c.backend.c_str(), c.attention.c_str(), c.cp, static_cast<long long>(S),
              static_cast<long long>(r.seq_len), req.options.policy.str().c_str());
  if (data) std::printf("loss %.6f over %lld tokens\n", r.loss, static_cast<long long>(r.counted));
  std::printf("time %.1f ms (forward + backward, rank 0)\npeak memory of rank 0 by tag (MiB):\n", r.time_ms);
  for (const auto& [tag, bytes] : r.peak_bytes)
    if (bytes > 0) std::printf("  %-20s %12.1f\n", tag.c_str(), static_cast<double>(bytes) / (1 << 20));
  std::printf("  %-20s %12.1f\n", "device total", static_cast<double>(r.device_peak_bytes) / (1 << 20));
  if (!f.json_path.empty()) {
    nlohmann::json j = {{"model", req.model.name}, {"backend", c.backend}, {"attention", c.attention}, {"cp", c.cp},
                        {"seq_len", r.seq_len}, {"time_ms", r.time_ms}, {"peak_bytes", r.peak_bytes},
                        {"device_peak_bytes", r.device_peak_bytes}, {"checkpoint_policy", req.options.policy.str()}};
    j["loss"] = data ? nlohmann::json(r.loss) : nlohmann::json(nullptr);
    if (data && req.model.sparse_layer_count() > 0) {  // a mixture of experts' two terms
      j["lm_loss"] = r.lm_loss;
      j["aux_loss"] = r.aux_loss;
    }
    write_json_file(f.json_path, j);
  }
  if (!f.grads_path.empty() && data) write_grads(f, req.model, req.options.lora, r);
  return 0;
}

}  // namespace

command_runner add_step(CLI::App& app) {
  auto f = std::make_shared<step_flags>();
  f->options = std::make_shared<run_options>(app, for_step);
  app.add_option("--weights", f->weights_path,
                 "weights: a model directory (one file or shards), its index or a .safetensors file; default: the "
                 "--model directory's, else random")
      ->check(path_flag());
  app.add_option("--tokens", f->tokens_path, "flat little-endian uint32 token file; default: random tokens")
      ->check(path_flag());
  app.add_option("--adapter", f->adapter,
                 "a LoRA step with this adapter directory's adapters (upipe's or PEFT's) on the base")
      ->check(path_flag());
  app.add_option("--json", f->json_path, "write the result as JSON")->check(output_file_flag("--json"));
  app.add_option("--save-grads", f->grads_path,
                 "write the weight gradients as safetensors (with LoRA the adapters', under PEFT's names)")
      ->check(output_file_flag("--save-grads"));
  return [f] { return f->options->run([&] { return run(*f); }); };
}

}  // namespace upipe::apps
