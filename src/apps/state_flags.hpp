// --optimizer-state, --master-weights, --grad-dtype and --convert-optimizer-state: AdamW's
// state format (docs/design.md section 5, "Lean optimizer state") for the commands that
// train (train, bench), and the words plan uses to print them.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "core/error.hpp"
#include "train/trainer.hpp"

namespace upipe::apps {

inline moment_format parse_moments(const std::string& text) {
  if (text == "fp32") return moment_format::f32;
  if (text == "bf16") return moment_format::bf16;
  if (text == "8bit") return moment_format::q8;
  throw config_error("--optimizer-state " + text + " is not known: use fp32 (AdamW's moments in f32, the default), "
                     "bf16 (rounded to bf16) or 8bit (bitsandbytes' block-wise 8-bit quantization)");
}

inline master_format parse_master(const std::string& text) {
  if (text == "fp32") return master_format::f32;
  if (text == "bf16-kahan") return master_format::bf16_kahan;
  throw config_error("--master-weights " + text + " is not known: use fp32 (the default) or bf16-kahan (the bf16 "
                     "weights with a bf16 compensation, Kahan summation)");
}

inline dtype parse_grad_dtype(const std::string& text) {
  if (text == "fp32") return dtype::f32;
  if (text == "bf16") return dtype::bf16;
  throw config_error("--grad-dtype " + text + " is not known: use fp32 (the default) or bf16");
}

inline const char* moments_flag(moment_format f) {
  return f == moment_format::f32 ? "fp32" : f == moment_format::bf16 ? "bf16" : "8bit";
}
inline const char* master_flag(master_format f) { return f == master_format::f32 ? "fp32" : "bf16-kahan"; }

struct state_flags {
  std::string moments = "fp32", master = "fp32", grads = "fp32";
  bool convert = false;

  void add(CLI::App& app, bool resumes) {
    app.add_option("--optimizer-state", moments,
                   "AdamW's moments: fp32, bf16 (round to nearest even), or 8bit (block-wise quantized, 256 a block "
                   "with an f32 absmax each, bitsandbytes' AdamW8bit)")
        ->capture_default_str();
    app.add_option("--master-weights", master,
                   "fp32, or bf16-kahan: the bf16 weights are the master, a bf16 compensation keeps what rounding "
                   "lost (on the GPU 4 bytes a parameter instead of 6)")
        ->capture_default_str();
    app.add_option("--grad-dtype", grads,
                   "the gradient shards kept for the norm or a later micro-batch: fp32 or bf16 (none are kept "
                   "without clipping at --batch 1)")
        ->capture_default_str();
    if (resumes)
      app.add_flag("--convert-optimizer-state", convert,
                   "--resume from a checkpoint of another state format: decode it to fp32 and encode it in this "
                   "run's (else refused)");
  }

  void apply(train_options& o) const {
    o.state_format = {parse_moments(moments), parse_master(master)};
    o.grad_type = parse_grad_dtype(grads);
    o.convert_state = convert;
  }
};

}  // namespace upipe::apps
