// `upipe export CKPT OUT`: a training checkpoint's fp32 master weights as a Hugging Face
// model directory (fp32 or bf16, sharded as save_pretrained shards), without the trainer
// state, with the checkpoint's config.json, tokenizer and generation config.
// `upipe export BASE OUT --merge-adapter ADAPTER`: a base model directory with a LoRA
// adapter merged in (W + alpha/r B A), as a plain model directory.
#include <cstdio>
#include <string>

#include "apps/commands.hpp"
#include "apps/sizes.hpp"
#include "core/error.hpp"
#include "train/run_directory.hpp"
#include "train/train_checkpoint.hpp"

namespace upipe::apps {

namespace {

struct export_flags {
  std::string checkpoint, out, dtype = "fp32", max_shard_size = "5GB", merge_adapter;
};

int run(const export_flags& f) {
  if (f.dtype != "bf16" && f.dtype != "fp32")
    throw config_error("--dtype " + f.dtype + " is not supported: use fp32 (the master weights exactly) or bf16");
  const hf_save_options options{f.dtype == "bf16" ? dtype::bf16 : dtype::f32, parse_bytes(f.max_shard_size, "--max-shard-size")};
  // Which checkpoint a run directory or its latest or best meant, and where it went, in full.
  const std::string out = resolve_checkpoint_dir(f.out);
  if (!f.merge_adapter.empty()) {
    const std::string adapter = merge_adapter(resolve_checkpoint(f.checkpoint), f.merge_adapter, f.out, options);
    std::printf("merged %s into %s: %s (%s weights)\n", adapter.c_str(), f.checkpoint.c_str(), out.c_str(),
                f.dtype.c_str());
    return 0;
  }
  const std::string checkpoint = export_checkpoint(f.checkpoint, f.out, options);
  std::printf("exported %s (step %lld) to %s (%s weights)\n", checkpoint.c_str(),
              static_cast<long long>(checkpoint_step(checkpoint)), out.c_str(), f.dtype.c_str());
  return 0;
}

}  // namespace

command_runner add_export(CLI::App& app) {
  auto f = std::make_shared<export_flags>();
  app.add_option("checkpoint", f->checkpoint,
                 "a checkpoint written by upipe train --save, or its run directory (its latest) or DIR/best; with "
                 "--merge-adapter, the base model directory")
      ->required();
  app.add_option("out", f->out, "the model directory to write (absent or empty; missing parents are made)")->required();
  app.add_option("--dtype", f->dtype, "fp32 (the master weights) or bf16")->capture_default_str();
  app.add_option("--max-shard-size", f->max_shard_size, "largest weight file (bytes, or KB/MB/GB)")->capture_default_str();
  app.add_option("--merge-adapter", f->merge_adapter,
                 "a LoRA adapter directory (upipe's or PEFT's) to merge into the base: W + alpha/r B A");
  return [f] { return run(*f); };
}

}  // namespace upipe::apps
