// The words of --optimizer-state, --master-weights and --grad-dtype (AdamW's state format,
// docs/design.md section 5, "Lean optimizer state"; train's rows in apps/run_config.cpp,
// plan's own flags): parsed with a clear error, and printed back by plan.
#pragma once

#include <string>

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

}  // namespace upipe::apps
