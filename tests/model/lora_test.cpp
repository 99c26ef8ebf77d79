// LoRA's configuration, initialization and cost: --lora parsing and its refusals, PEFT's
// default initialization, and that a frozen base neither holds a gradient buffer nor runs
// a weight-gradient GEMM (counted on the meta backend for every strategy), with the model
// FLOPs of a LoRA step.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "core/error.hpp"
#include "cp/head_schedule.hpp"
#include "model/lora.hpp"
#include "model/model_step.hpp"

namespace upipe {
namespace {

std::string refusal(const std::string& text, const model_config& model) {
  try {
    parse_lora(text, model);
  } catch (const config_error& e) {
    return e.what();
  }
  return "accepted";
}

TEST(lora, the_flag_parses_short_and_peft_names_with_defaults) {
  const model_config m = preset("llama3-8b");
  const lora_config all = parse_lora("r=16,alpha=32,targets=q,k,v,o,gate,up,down,dropout=0", m);
  EXPECT_EQ(all.rank, 16);
  EXPECT_EQ(all.alpha, 32);
  EXPECT_FLOAT_EQ(all.scale(), 2.0f);
  EXPECT_EQ(all.target_list().size(), 7u);
  const lora_config defaults = parse_lora("r=16", m);  // alpha = r, every projection
  EXPECT_EQ(defaults.alpha, 16);
  EXPECT_EQ(defaults.targets, all.targets);
  const lora_config qv = parse_lora("targets=q_proj,v_proj,r=8", m);
  EXPECT_EQ(qv.target_list(), (std::vector<lora_target>{lora_target::q, lora_target::v}));
  EXPECT_EQ(qv.alpha, 8);
  EXPECT_EQ(parse_lora(lora_text(all), m), all);
  EXPECT_EQ(parse_lora("r=16,alpha=32,targets=all-linear", m).targets, all.targets);
}

TEST(lora, bad_values_are_refused_naming_the_value_the_rule_and_a_way_out) {
  const model_config m = preset("llama3-8b");
  EXPECT_NE(refusal("r=0", m).find("r=0 must be a whole number between 1 and"), std::string::npos) << refusal("r=0", m);
  EXPECT_NE(refusal("r=-4", m).find("r=-4"), std::string::npos);
  EXPECT_NE(refusal("r=2.5", m).find("r=2.5"), std::string::npos);
  EXPECT_NE(refusal("alpha=8", m).find("begin with r=N"), std::string::npos);
  for (const char* alpha : {"-1", "0"})
    EXPECT_NE(refusal(std::string("r=8,alpha=") + alpha, m).find("positive finite number"), std::string::npos) << alpha;
  for (const char* alpha : {"inf", "nan", "0x10", "1e400"})
    EXPECT_NE(refusal(std::string("r=8,alpha=") + alpha, m).find("is not a number"), std::string::npos) << alpha;
  // A key given twice, a rank that is no decimal whole number or does not fit, no targets,
  // and a scale that would diverge at once are refused, never read as some other value.
  EXPECT_NE(refusal("r=4,r=8", m).find("gives r twice"), std::string::npos) << refusal("r=4,r=8", m);
  EXPECT_NE(refusal("r=4,rank=8", m).find("gives r twice"), std::string::npos);
  for (const char* r : {"0x4", "4294967300", "4.9", "1e3", "+-4"})
    EXPECT_NE(refusal(std::string("r=") + r, m).find(std::string("r=") + r), std::string::npos) << r;
  EXPECT_NE(refusal("r=4,targets=", m).find("targets= names no projection"), std::string::npos);
  EXPECT_NE(refusal("r=4,alpha=1e30", m).find("alpha / r"), std::string::npos) << refusal("r=4,alpha=1e30", m);
  EXPECT_NE(refusal("r=8,alpha=x", m).find("is not a number"), std::string::npos);
  const std::string dropout = refusal("r=8,dropout=0.05", m);
  EXPECT_NE(dropout.find("dropout=0.05 is not supported"), std::string::npos) << dropout;
  EXPECT_NE(dropout.find("use dropout=0"), std::string::npos) << dropout;
  const std::string unknown = refusal("r=8,targets=q,foo", m);
  EXPECT_NE(unknown.find("unknown target 'foo'"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("q, k, v, o, gate, up, down"), std::string::npos) << unknown;
  const std::string lacks = refusal("r=8,targets=qkv_proj", m);
  EXPECT_NE(lacks.find("'qkv_proj', a module llama3-8b (llama) does not have"), std::string::npos) << lacks;
  EXPECT_NE(refusal("r=8,targets=q_norm", m).find("does not have"), std::string::npos) << "Llama has no q_norm";
  EXPECT_NE(refusal("r=8,targets=q_norm", preset("qwen3-8b")).find("not a linear projection"), std::string::npos);
  EXPECT_NE(refusal("r=8,targets=lm_head", m).find("not a linear projection"), std::string::npos);
  EXPECT_NE(refusal("r=8,size=3", m).find("key 'size' is not known"), std::string::npos);
  const std::string wide = refusal("r=2048,targets=k", m);
  EXPECT_NE(wide.find("use r <= 1024"), std::string::npos) << wide;
}

TEST(lora, initialization_is_peft_default_kaiming_uniform_a_and_zero_b_seeded) {
  const model_config m = preset("tiny-llama");
  const lora_config lora = parse_lora("r=4,alpha=8", m);
  const host_weights a = initial_adapters(m, lora, 7), again = initial_adapters(m, lora, 7), other = initial_adapters(m, lora, 8);
  EXPECT_EQ(a.size(), lora_parameter_specs(m, lora).size());
  EXPECT_EQ(a, again);
  EXPECT_NE(a, other);
  for (const parameter_spec& spec : lora_parameter_specs(m, lora)) {
    const std::vector<float>& v = a.at(spec.name);
    ASSERT_EQ(static_cast<std::int64_t>(v.size()), spec.shape[0] * spec.shape[1]);
    if (spec.name.find("lora_B") != std::string::npos) {
      for (float x : v) ASSERT_EQ(x, 0.0f) << spec.name;
      continue;
    }
    const double bound = 1.0 / std::sqrt(static_cast<double>(spec.shape[1]));  // kaiming_uniform_(a = sqrt 5)
    double lo = 0, hi = 0, mean_sq = 0;
    for (float x : v) lo = std::min(lo, double{x}), hi = std::max(hi, double{x}), mean_sq += double{x} * x;
    mean_sq /= static_cast<double>(v.size());
    EXPECT_GE(lo, -bound);
    EXPECT_LT(hi, bound);
    EXPECT_NEAR(mean_sq, bound * bound / 3, bound * bound / 6) << spec.name;  // a uniform's variance
  }
}

// One step of a two-layer llama3-8b slice at S = 8192 on the meta backend, rank 0 of 4.
model_step_result meta_step(const cp_settings& cp, const lora_config& lora) {
  model_step_request req;
  req.model = preset("llama3-8b");
  req.model.num_layers = 2;
  req.cp = cp;
  req.backend = backend_kind::meta;
  req.options.lora = lora;
  req.limits = {std::size_t{1} << 40, std::size_t{1} << 40};
  const std::vector<std::int32_t> tokens(8192, 0);
  return run_model_step(req, {}, tokens);
}

// The adapters' weight-gradient FLOPs on rank 0: dB = s dY^T (x A^T) once per output row,
// 2 s r out; dA = s (dY B)^T x once per backward pass of the projection, 2 s r in. A pass
// is a call of the strategy's input-gradient step: the attention's staged strategies make
// one per stage for q and one per resident kv block for k and v (a UPipe stage has the dY
// of its own heads only), ring one for each.
double adapter_weight_grad_flops(const model_config& m, const cp_settings& cp, double s, int r) {
  int q_passes = 1, kv_passes = 1;
  if (cp.strategy != strategy_kind::ring) {
    const int group = cp.cp / cp.ring, u = cp.head_chunk == 0 ? m.num_heads : cp.head_chunk;
    const head_schedule schedule(m.num_heads, m.num_kv_heads, group, u);
    q_passes = schedule.stages();
    kv_passes = static_cast<int>(schedule.blocks(0).size());
  }
  const double D = m.hidden_size, F = m.intermediate_size, q = m.num_heads * m.head_dim, kv = m.num_kv_heads * m.head_dim;
  const double per_layer = (q + D * q_passes) + 2 * (kv + D * kv_passes) + (D + q) + 2 * (F + D) + (D + F);
  return 2 * s * r * per_layer * m.num_layers;
}

TEST(lora, a_frozen_base_has_no_gradient_buffer_and_runs_no_weight_gradient_gemm) {
  model_config m = preset("llama3-8b");
  m.num_layers = 2;
  const lora_config lora = parse_lora("r=16,alpha=32", m);
  const double s = 8192.0 / 4;  // tokens per rank
  const auto adapters = static_cast<std::size_t>(lora_parameter_count(m, lora));
  const auto base = static_cast<std::size_t>(m.parameter_count());
  for (const cp_settings& cp : {cp_settings{strategy_kind::ulysses, 4, 0}, cp_settings{strategy_kind::upipe, 4, 4},
                                cp_settings{strategy_kind::upipe, 4, 8}, cp_settings{strategy_kind::ring, 4, 0},
                                cp_settings{strategy_kind::hybrid, 4, 2, 2}}) {
    SCOPED_TRACE(std::string(strategy_name(cp.strategy)) + " U=" + std::to_string(cp.head_chunk));
    const model_step_result full = meta_step(cp, {});
    const model_step_result tuned = meta_step(cp, lora);
    // The only gradients are the adapters' (f32, whole on every rank in a model step).
    EXPECT_EQ(tuned.peak_bytes.at("grads"), 4 * adapters);
    EXPECT_EQ(full.peak_bytes.at("grads"), 4 * base);
    EXPECT_EQ(tuned.peak_bytes.at("weights"), 2 * (base + adapters));
    // Weight gradients are the GEMMs dY^T X: a full step runs 2 s N_matmul FLOPs of them on
    // each rank; a LoRA step runs the adapters' alone.
    EXPECT_DOUBLE_EQ(full.gemm_flops.left_transposed, 2 * s * static_cast<double>(m.matmul_parameter_count()));
    EXPECT_DOUBLE_EQ(tuned.gemm_flops.left_transposed, adapter_weight_grad_flops(m, cp, s, lora.rank));
    EXPECT_LT(tuned.gemm_flops.left_transposed, 0.01 * full.gemm_flops.left_transposed);
  }
}

TEST(lora, model_flops_drop_the_base_weight_gradients_and_add_the_adapters) {
  const model_config m = preset("llama3-8b");
  const lora_config lora = parse_lora("r=16", m);
  const std::int64_t S = 1 << 20;
  const double n = static_cast<double>(m.matmul_parameter_count()), a = static_cast<double>(lora_parameter_count(m, lora));
  EXPECT_DOUBLE_EQ(lora_model_flops(m, lora, S), m.model_flops(S) - 2 * n * S + 6 * a * S);
  // r = 16 on the seven projections of llama3-8b: 16 (in + out) summed per layer, 32 layers.
  EXPECT_EQ(lora_parameter_count(m, lora), 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336)));
  const std::vector<std::int64_t> documents = {0, S / 2};
  EXPECT_DOUBLE_EQ(lora_model_flops(m, lora, S, documents), m.model_flops(S, documents) - 2 * n * S + 6 * a * S);
}

}  // namespace
}  // namespace upipe
