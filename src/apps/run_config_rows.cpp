// The run configuration's table: every option of `upipe train` as one row (its flag, its
// key in a TOML config file, its rule, its help, which commands take it and what a resume
// may do with it). apps/run_config.cpp reads, checks and writes the rows.
#include <climits>
#include <cmath>

#include "apps/run_config.hpp"
#include "apps/sizes.hpp"
#include "apps/state_flags.hpp"
#include "core/error.hpp"
#include "core/files.hpp"
#include "core/limits.hpp"
#include "cp/strategy_table.hpp"
#include "model/checkpoint_store.hpp"
#include "train/data_reader.hpp"
#include "train/trainer.hpp"

namespace upipe::apps {

namespace {

// The rules of the rows (value_rule): a range, the words taken, a parser, or any text.
value_rule range(double lo, double hi, const char* example) {
  value_rule r;
  r.lo = lo;
  r.hi = hi;
  r.example = example;
  return r;
}
value_rule positive(double hi, const char* example) {  // (0, hi]
  value_rule r = range(0, hi, example);
  r.above = true;
  return r;
}
value_rule or_chosen(double lo, double hi, const char* example) {  // -1 (the run chooses), or [lo, hi]
  value_rule r = range(lo, hi, example);
  r.minus_one = true;
  return r;
}
value_rule words(const char* taken, const char* example) {
  value_rule r;
  r.words = taken;
  r.example = example;
  return r;
}
value_rule parsed(void (*parse)(const std::string&), const char* example) {
  value_rule r;
  r.parse = parse;
  r.example = example;
  return r;
}
value_rule text(const char* example = "") {
  value_rule r;
  r.example = example;
  return r;
}

// The parsers of the rows whose text has a form (each throws config_error naming the rule).
void seq_len_rule(const std::string& v) { parse_scored_seq_len(v); }
void data_sources_rule(const std::string& v) { parse_data_sources(v, "--data"); }
void eval_sources_rule(const std::string& v) {
  for (const data_source_spec& s : parse_data_sources(v, "--eval-data"))
    if (s.weight != 1.0)
      throw config_error("--eval-data " + v + ": each held-out source is evaluated on its own, so a weight (" + s.path +
                         ") means nothing; list them without weights, e.g. --eval-data chat-heldout,books-heldout");
}
void strategy_rule(const std::string& v) { parse_strategy_kind(v); }
// auto, or U (0: the stored default of a run saved before auto existed).
void head_chunk_rule(const std::string& v) {
  if (v == "auto" || v == "0") return;
  try {
    parse_int_count(v, "--head-chunk");
  } catch (const config_error& e) {
    throw config_error(std::string(e.what()) + "; or auto, the largest U whose step fits");
  }
}
void shard_size_rule(const std::string& v) { parse_bytes(v, "--max-shard-size"); }
void offload_rule(const std::string& v) { parse_offload(v); }
void policy_rule(const std::string& v) {
  if (v != "auto") parse_checkpoint_policy(v);
}
void output_file_rule(const std::string& v) {
  try {
    checked_output_file(v, "--metrics-json", missing_parents::made);
  } catch (const io_error& e) {
    throw config_error(e.what());
  }
}

constexpr unsigned model_commands = for_train | for_step | for_eval | for_bench | for_plan;
constexpr unsigned run_commands = for_train | for_step | for_eval | for_bench;  // those that run ranks

#define UPIPE_FIELD(name) [](run_config& c) -> field_ref { return &c.name; }

std::vector<option_row> make_rows() {
  using r = on_resume;
  return {
      // [model]
      {"--model", "model.model", UPIPE_FIELD(model), text("tiny-llama"),
       "preset (upipe model-config --list) or a Hugging Face model directory (config.json and safetensors weights, "
       "one file or shards); a run directory of checkpoints means its latest",
       model_commands, r::kept, true},
      {"--config", "model.config", UPIPE_FIELD(config), text("models/llama/config.json"),
       "a Hugging Face config.json (or its directory) instead of --model", model_commands, r::kept, true},
      {"--layers", "model.layers", UPIPE_FIELD(layers), range(0, limits::layers.max, "2"),
       "a slice: the first N layers only", model_commands, r::kept},
      {"--init", "model.init", UPIPE_FIELD(init), text("models/llama"),
       "weights to start from: a model directory (one file or shards) or a .safetensors file (default: the --model "
       "directory's weights, else random)",
       for_train, r::base, true},
      {"--lora", "model.lora", UPIPE_FIELD(lora), text(),
       "train LoRA adapters on a frozen base: r=N[,alpha=A][,targets=q,k,v,o,gate,up,down][,dropout=0] (alpha "
       "defaults to r, targets to all seven projections); saves a PEFT adapter directory",
       for_train | for_step | for_bench | for_plan, r::kept},
      {"--init-adapter", "model.init_adapter", UPIPE_FIELD(init_adapter), text("runs/lora/latest"),
       "LoRA: continue from this adapter directory (upipe's --save or PEFT's save_pretrained); its "
       "adapter_config.json gives --lora",
       for_train, r::recorded, true},
      {"--rope-theta", "model.rope_theta", UPIPE_FIELD(rope_theta), positive(HUGE_VAL, "500000"),
       "RoPE base (the model's unless given)", for_train, r::changes},
      {"--rope-scaling", "model.rope_scaling", UPIPE_FIELD(rope_scaling), text(),
       "RoPE scaling as transformers computes it: type=llama3|linear|yarn|default then key=value pairs (factor, "
       "original_max_position_embeddings, low_freq_factor, high_freq_factor, beta_fast, beta_slow, mscale, "
       "mscale_all_dim, attention_factor, truncate), e.g. type=yarn,factor=4 (replaces the model's, said aloud)",
       for_train, r::changes},
      {"--max-position-embeddings", "model.max_position_embeddings", UPIPE_FIELD(max_position_embeddings),
       range(1, limits::context.max, "131072"),
       "the context the saved config declares (default: the model's, or the extended one)", for_train, r::changes},
      {"--router-aux-loss", "model.router_aux_loss", UPIPE_FIELD(router_aux_loss), words("config, on, off", "on"),
       "a mixture of experts' load-balancing loss (router_aux_loss_coef x transformers' load_balancing_loss_func) in "
       "the loss: config (as config.json's output_router_logits says), on or off",
       for_train | for_step, r::kept},
      // [data]
      {"--data", "data.data", UPIPE_FIELD(data), parsed(data_sources_rule, "data/corpus"),
       "a corpus PREFIX from upipe prepare-data (PREFIX.tokens, .index, .json, and .mask for chat data), a flat "
       "little-endian uint32 token file, or a mixture by weight, A:0.7,B:0.3 (default: the synthetic passkey task; "
       "eval: several sources, comma-separated, each scored)",
       for_train | for_eval, r::kept, true},
      {"--packing", "data.packing", UPIPE_FIELD(packing), words("auto, documents, stream", "documents"),
       "documents (attention masked and positions restarted at each document; the default with an index) or stream",
       for_train | for_eval, r::kept},
      {"--min-doc-tokens", "data.min_doc_tokens", UPIPE_FIELD(min_doc_tokens), range(0, max_seq_len, "32768"),
       "leave out documents shorter than this (a long-context mix)", for_train, r::kept},
      {"--seq-len", "data.seq_len", UPIPE_FIELD(seq_len), parsed(seq_len_rule, "4K"),
       "tokens per sequence (K and M suffixes; fine-tune default: the model's context up to 4K)", for_train | for_step,
       r::changes},
      {"--batch", "data.batch", UPIPE_FIELD(batch), or_chosen(1, max_batch, "8"),
       "sequences per optimizer step, gradients accumulated (default: 4 on the passkey task, 1 with --data)", for_train,
       r::changes},
      {"--seq-warmup", "data.seq_warmup", UPIPE_FIELD(seq_warmup), or_chosen(0, max_train_steps, "100"),
       "steps trained on short sequences before --seq-len (default: 9/10 of --steps on the passkey task, 0 with "
       "--data)",
       for_train, r::changes},
      {"--seq-warmup-start", "data.seq_warmup_start", UPIPE_FIELD(seq_warmup_start), range(0, max_seq_len, "1024"),
       "tokens per sequence during --seq-warmup (default: a quarter of --seq-len)", for_train, r::changes},
      {"--epochs", "data.epochs", UPIPE_FIELD(epochs), range(0, 1e6, "1"),
       "passes over --data that set --steps (fine-tune default 1; the demo counts --steps)", for_train, r::recorded},
      {"--allow-tokenizer-mismatch", "data.allow_tokenizer_mismatch", UPIPE_FIELD(allow_tokenizer_mismatch), text(),
       "read data tokenized with another tokenizer than the model directory's (refused otherwise)",
       for_train | for_eval, r::changes, false, true},
      // [eval]
      {"--eval-every", "eval.every", UPIPE_FIELD(eval_every), range(0, max_train_steps, "100"),
       "held-out loss every N steps (and at the last), into the metrics", for_train, r::changes},
      {"--eval-data", "eval.data", UPIPE_FIELD(eval_data), parsed(eval_sources_rule, "data/heldout"),
       "held-out data for --eval-every: corpus PREFIXes or token files, comma-separated, each evaluated", for_train,
       r::changes, true},
      {"--eval-sequences", "eval.sequences", UPIPE_FIELD(eval_sequences), range(1, limits::samples.max, "4"),
       "held-out sequences per evaluation", for_train, r::changes},
      {"--eval-samples", "eval.samples", UPIPE_FIELD(eval_samples), range(0, limits::samples.max, "32"),
       "held-out passkey samples for the retrieval accuracy", for_train, r::changes},
      // [parallel]
      {"--attention", "parallel.attention", UPIPE_FIELD(attention), parsed(strategy_rule, "upipe"),
       "the CP strategy (its help is the strategy table's: cp/strategy_table.hpp)", for_train | for_step | for_eval,
       r::changes},
      {"--cp", "parallel.cp", UPIPE_FIELD(cp), range(1, INT_MAX, "4"),
       "ranks in the CP group (threads on the cpu backend, virtual ranks on one GPU)", run_commands & ~for_bench,
       r::changes},
      {"--head-chunk", "parallel.head_chunk", UPIPE_FIELD(head_chunk), parsed(head_chunk_rule, "auto"),
       "U, query heads per stage (upipe: a multiple of C dividing H; hybrid: of C / R): auto (the largest whose step "
       "fits --memory-gib, printed with its reason) or a number",
       for_train | for_step | for_eval, r::changes},
      {"--ring", "parallel.ring", UPIPE_FIELD(ring), range(1, INT_MAX, "2"),
       "hybrid: R, the ring of all-to-all groups (R divides C)", for_train | for_step | for_eval, r::changes},
      {"--seq-chunks", "parallel.seq_chunks", UPIPE_FIELD(seq_chunks), range(0, INT_MAX, "4"),
       "N sequence chunks for upipe, ulysses and fpdt: the attention holds S / N tokens at a time, earlier chunks' "
       "K/V in host memory (0: 1, fpdt chunks of 64K tokens)",
       for_train | for_step | for_eval, r::changes},
      {"--dp", "parallel.dp", UPIPE_FIELD(dp), range(1, INT_MAX, "2"),
       "data-parallel replicas, each a CP group of --cp ranks reading its own --batch sequences (D x C ranks in all, "
       "ZeRO over every one; a step takes dp x batch sequences)",
       for_train, r::changes},
      {"--gpus-per-node", "parallel.gpus_per_node", UPIPE_FIELD(gpus_per_node), range(0, INT_MAX, "8"),
       "GPUs per node, for the mesh's placement check: a CP group inside a node or over whole nodes (0: every rank "
       "on one node)",
       for_train, r::changes},
      {"--zero", "parallel.zero", UPIPE_FIELD(zero), words("2, 3", "3"),
       "2: shard optimizer state and gradients; 3: shard weights too", for_train | for_bench | for_plan, r::changes},
      {"--comm", "parallel.comm", UPIPE_FIELD(comm), words("auto, threads, nccl", "auto"),
       "how ranks talk: auto (NCCL with a GPU per rank, else threads), threads, nccl", for_train | for_bench,
       r::changes},
      {"--comm-timeout", "parallel.comm_timeout", UPIPE_FIELD(comm_timeout), positive(1e6, "600"),
       "seconds before a stuck collective aborts every rank (NCCL)", for_train | for_bench, r::changes},
      {"--overlap-comm", "parallel.overlap_comm", UPIPE_FIELD(overlap_comm), text(),
       "keep each attention stage's output all-to-all in flight while the next stage projects (NCCL)",
       for_train | for_bench, r::changes, false, true},
      {"--prefetch-weights", "parallel.prefetch_weights", UPIPE_FIELD(prefetch_weights), text(),
       "ZeRO-3: gather the next layer's weights while this layer computes", for_train | for_bench, r::changes, false,
       true},
      // [optimizer]
      {"--steps", "optimizer.steps", UPIPE_FIELD(steps), range(1, max_train_steps, "200"),
       "length of the learning-rate schedule (fine-tune default: --epochs over --data)", for_train, r::changes},
      {"--stop-after", "optimizer.stop_after", UPIPE_FIELD(stop_after), range(0, max_train_steps, "100"),
       "stop once this step is done (the schedule stays --steps long)", for_train, r::fresh},
      {"--lr", "optimizer.lr", UPIPE_FIELD(lr), positive(1, "3e-4"),
       "peak learning rate (fine-tune default 2e-5, 2e-4 with --lora)", for_train, r::changes},
      {"--warmup", "optimizer.warmup", UPIPE_FIELD(warmup), range(0, max_train_steps, "100"),
       "linear warmup steps (or --warmup-ratio)", for_train, r::changes},
      {"--warmup-ratio", "optimizer.warmup_ratio", UPIPE_FIELD(warmup_ratio), range(0, 1, "0.03"),
       "linear warmup as a fraction of --steps (fine-tune default 0.03); replaces --warmup", for_train, r::changes},
      {"--min-lr-ratio", "optimizer.min_lr_ratio", UPIPE_FIELD(min_lr_ratio), range(0, 1, "0.1"),
       "the cosine decays to lr x this at --steps (fine-tune default 0)", for_train, r::changes},
      {"--weight-decay", "optimizer.weight_decay", UPIPE_FIELD(weight_decay), range(0, HUGE_VAL, "0.1"),
       "AdamW weight decay on matrices", for_train, r::changes},
      {"--max-grad-norm", "optimizer.max_grad_norm", UPIPE_FIELD(max_grad_norm), range(0, HUGE_VAL, "1.0"),
       "global-norm clipping (0: off)", for_train, r::changes},
      {"--seed", "optimizer.seed", UPIPE_FIELD(seed), text(), "seed of the initialization and the data",
       model_commands & ~for_plan, r::kept},
      {"--optimizer-state", "optimizer.state", UPIPE_FIELD(optimizer_state), words("fp32, bf16, 8bit", "bf16"),
       "AdamW's moments: fp32, bf16 (round to nearest even), or 8bit (block-wise quantized, 256 a block with an f32 "
       "absmax each, bitsandbytes' AdamW8bit); a resume in another format needs --convert-optimizer-state",
       for_train, r::changes},
      {"--master-weights", "optimizer.master_weights", UPIPE_FIELD(master_weights),
       words("fp32, bf16-kahan", "bf16-kahan"),
       "fp32, or bf16-kahan: the bf16 weights are the master, a bf16 compensation keeps what rounding lost (4 bytes a "
       "parameter instead of 6 on the GPU)",
       for_train, r::changes},
      {"--grad-dtype", "optimizer.grad_dtype", UPIPE_FIELD(grad_dtype), words("fp32, bf16", "bf16"),
       "the gradient shards kept for the norm or a later micro-batch: fp32 or bf16 (none are kept without clipping "
       "at --batch 1)",
       for_train, r::changes},
      {"--convert-optimizer-state", "optimizer.convert_state", UPIPE_FIELD(convert_optimizer_state), text(),
       "--resume from a checkpoint of another state format: decode it to fp32 and encode it in this run's (else "
       "refused)",
       for_train, r::fresh, false, true},
      // [checkpoint]
      {"--save", "checkpoint.save", UPIPE_FIELD(save), text("runs/demo"),
       "the run directory: checkpoints DIR/checkpoint-STEP (Hugging Face model directories with the trainer state in "
       "trainer/), DIR/latest naming the newest",
       for_train, r::changes, true},
      {"--save-every", "checkpoint.save_every", UPIPE_FIELD(save_every), range(0, max_train_steps, "500"),
       "also save every N steps", for_train, r::changes},
      {"--keep-last", "checkpoint.keep_last", UPIPE_FIELD(keep_last), range(0, max_train_steps, "3"),
       "keep the newest N checkpoints of the run, removing older ones after each save (0: keep all)", for_train,
       r::changes},
      {"--keep-best", "checkpoint.keep_best", UPIPE_FIELD(keep_best), text(),
       "with --eval-every: also keep the checkpoint of the lowest held-out loss (DIR/best names it)", for_train,
       r::changes, false, true},
      {"--overwrite", "checkpoint.overwrite", UPIPE_FIELD(overwrite), text(),
       "let --save replace another run's checkpoints in DIR (removed once this run's first save is complete)",
       for_train, r::fresh, false, true},
      {"--save-dtype", "checkpoint.save_dtype", UPIPE_FIELD(save_dtype), words("bf16, fp32", "bf16"),
       "dtype of the saved weights: bf16 or fp32", for_train, r::changes},
      {"--max-shard-size", "checkpoint.max_shard_size", UPIPE_FIELD(max_shard_size), parsed(shard_size_rule, "5GB"),
       "largest weight file of a save (bytes, or KB/MB/GB)", for_train, r::changes},
      {"--resume", "checkpoint.resume", UPIPE_FIELD(resume), text("runs/demo"),
       "continue a run: a checkpoint, or a run directory (its latest); every option not given again is the "
       "checkpoint's, at any --cp and --zero (the state is resharded)",
       for_train, r::fresh, true},
      // [system]
      {"--backend", "system.backend", UPIPE_FIELD(backend), words("cpu, cuda, meta", "cpu"),
       "cpu, cuda (bf16, virtual ranks on one GPU) or meta", model_commands & ~for_plan, r::changes},
      {"--memory-gib", "system.memory_gib", UPIPE_FIELD(memory_gib), positive(limits::max_memory_gib, "8"),
       "arena per rank (cpu or GPU memory), GiB", run_commands, r::changes},
      {"--host-memory-gib", "system.host_memory_gib", UPIPE_FIELD(host_memory_gib),
       range(0, limits::max_memory_gib, "16"), host_memory_gib_help, for_train | for_step | for_bench, r::changes},
      {"--offload", "system.offload", UPIPE_FIELD(offload), parsed(offload_rule, "optimizer"), offload_help, for_train,
       r::changes},  // plan's adds auto
      {"--checkpoint-policy", "system.checkpoint_policy", UPIPE_FIELD(checkpoint_policy), parsed(policy_rule, "auto"),
       "auto (the planner's fastest that fits --memory-gib and --host-memory-gib) or "
       "what=input|input+attention,every=K,where=device|host-pinned|host-pageable",
       for_train | for_step | for_bench | for_plan, r::changes},
      {"--mlp-tile", "system.mlp_tile", UPIPE_FIELD(mlp_tile), range(0, max_seq_len, "8192"), mlp_tile_help,
       model_commands, r::changes},
      {"--loss-chunk", "system.loss_chunk", UPIPE_FIELD(loss_chunk), range(0, max_seq_len, "8192"), loss_chunk_help,
       model_commands, r::changes},
      {"--moe-gemm", "system.moe_gemm", UPIPE_FIELD(moe_gemm), words("grouped, cublas, loop", "loop"),
       "a mixture of experts' expert GEMMs: grouped (CUTLASS's grouped GEMM, the experts' row counts read on the "
       "device), cublas (cuBLAS's grouped GEMM, the counts read on the host) or loop (one GEMM per expert)",
       run_commands, r::changes},
      {"--moe-capacity-factor", "system.moe_capacity_factor", UPIPE_FIELD(moe_capacity_factor), range(0, 1e6, "1.25"),
       "a mixture of experts' capacity: each expert takes at most ceil(F n k / E) of an MLP tile's n tokens, the rest "
       "of its tokens dropped in token order (Switch, GShard); 0: dropless",
       run_commands, r::changes},
      {"--attention-dtype", "system.attention_dtype", UPIPE_FIELD(attention_dtype), words("bf16, fp8", "fp8"),
       "the fused attention's arithmetic: bf16, or fp8 (E4M3 Q, K, V, O and E5M2 gradients with per-tensor scales, "
       "fp32 softmax statistics; docs/design.md section 6)",
       model_commands, r::changes},
      // [metrics]
      {"--metrics-json", "metrics.json", UPIPE_FIELD(metrics_json), parsed(output_file_rule, "metrics.jsonl"),
       "one JSON object per step (with its time), then a final one; appended to on --resume", for_train, r::changes,
       true},
  };
}

#undef UPIPE_FIELD

}  // namespace

const std::vector<option_row>& option_rows() {
  static const std::vector<option_row> rows = make_rows();
  return rows;
}

const option_row* find_row(const std::string& name) {
  for (const option_row& row : option_rows())
    if (name == row.flag || name == row.key) return &row;
  return nullptr;
}

const char* command_name(unsigned command) {
  switch (command) {
    case for_train:
      return "train";
    case for_step:
      return "step";
    case for_eval:
      return "eval";
    case for_bench:
      return "bench";
    case for_plan:
      return "plan";
  }
  return "?";
}

std::string command_names(unsigned commands) {
  std::vector<std::string> names;
  for (unsigned bit = for_train; bit <= for_plan; bit <<= 1)
    if ((commands & bit) != 0) names.emplace_back(command_name(bit));
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i)
    out += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  return out;
}

}  // namespace upipe::apps
