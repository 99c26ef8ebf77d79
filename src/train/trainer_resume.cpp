// What a resume checks of the checkpoint against the run: the model or the adapters, the
// optimizer state's format, the seed and the schedule (the data: trainer_data.cpp).
#include <cstdio>
#include <string>

#include "core/error.hpp"
#include "model/adapter_files.hpp"
#include "model/hf_model.hpp"
#include "train/train_checkpoint.hpp"
#include "train/trainer_data.hpp"

namespace upipe {

namespace {

bool uses_lora(const train_options& o) { return o.step.lora.enabled(); }

// A LoRA run resumes a LoRA run's adapters of the same shape and settings (the base is the
// run's --model, frozen: not part of the trainer state).
void check_resumed_adapters(const train_options& o, const saved_state& saved) {
  if (!is_adapter_directory(saved.dir()))
    throw config_error("cannot resume LoRA from " + o.resume_dir + ": it holds a full model's trainer state (no " +
                       adapter_config_file + "); start LoRA on its weights with --model " + o.resume_dir +
                       " and no --resume, or resume it without --lora");
  const adapter_settings settings = read_adapter_config(saved.dir(), o.model);
  // The manifest records the adapters the state was trained as; an adapter_config.json that
  // says otherwise was edited (or copied from another run).
  if (!saved.lora().empty() && saved.lora() != lora_text(settings.lora))
    throw config_error("cannot resume from " + o.resume_dir + ": its " + adapter_config_file + " says --lora " +
                       lora_text(settings.lora) + " but its trainer state was saved as --lora " + saved.lora() +
                       " (trainer/manifest.json): the file was edited or replaced; restore it");
  if (!(settings.lora == o.step.lora))
    throw config_error("cannot resume from " + o.resume_dir + ": its adapters are --lora " + lora_text(settings.lora) +
                       ", not " + lora_text(o.step.lora) + "; pass --lora " + lora_text(settings.lora));
  saved.check_units(o.model, o.step.lora);
  // The base is not in the checkpoint: another one of the same shape is allowed, and said aloud.
  const std::string base = base_model_name(o);
  if (!settings.base_model.empty() && settings.base_model != base)
    std::fprintf(stderr, "upipe: note: the adapters in %s were trained on %s; they continue on %s\n",
                 o.resume_dir.c_str(), settings.base_model.c_str(), base.c_str());
}

// A full run resumes a full run of the same model; the RoPE and epsilon it may change on
// purpose (context extension) are said aloud.
void check_resumed_model(const train_options& o, const saved_state& saved) {
  if (is_adapter_directory(saved.dir()))
    throw config_error("cannot resume from " + o.resume_dir + ": it holds LoRA adapters (" + adapter_config_file +
                       "); resume it with --lora as it was trained (its " + adapter_config_file + " says which) and "
                       "its base as --model");
  const model_config saved_model = read_hf_config(saved.dir());
  check_same_model(saved_model, o.model, saved.dir());
  saved.check_units(o.model);
  if (!(saved_model.rope == o.model.rope))
    std::fprintf(stderr, "upipe: note: the RoPE differs from the checkpoint's config.json (theta %g, %s scaling); "
                 "the run continues with theta %g, %s scaling\n", saved_model.rope.theta,
                 rope_kind_name(saved_model.rope.scaling.kind), o.model.rope.theta,
                 rope_kind_name(o.model.rope.scaling.kind));
  if (saved_model.rms_norm_eps != o.model.rms_norm_eps)
    std::fprintf(stderr, "upipe: note: rms_norm_eps is %g, the checkpoint's config.json has %g\n", o.model.rms_norm_eps,
                 saved_model.rms_norm_eps);
}

// The flags that name a state format, for messages.
std::string format_flags(const adamw_state_format& f) {
  return std::string("--optimizer-state ") +
         (f.moments == moment_format::f32 ? "fp32" : f.moments == moment_format::bf16 ? "bf16" : "8bit") +
         " --master-weights " + (f.master == master_format::f32 ? "fp32" : "bf16-kahan");
}

// AdamW's state resumes in the format it was saved in; another format only when asked
// (decoded to f32 and encoded again: q8 and bf16 lose what their format cannot hold).
void check_resumed_format(const train_options& o, const saved_state& saved) {
  if (saved.state_format() == o.state_format) return;
  if (!o.convert_state)
    throw config_error("cannot resume from " + o.resume_dir + ": its optimizer state was saved with " +
                       format_flags(saved.state_format()) + ", this run asks for " + format_flags(o.state_format) +
                       "; pass " + format_flags(saved.state_format()) +
                       ", or add --convert-optimizer-state to convert it (decoded to fp32, encoded in the new format)");
  std::fprintf(stderr, "upipe: note: converting the optimizer state of %s from %s to %s\n", o.resume_dir.c_str(),
               format_flags(saved.state_format()).c_str(), format_flags(o.state_format).c_str());
}

}  // namespace

// A resumed run must continue the saved one: the same model and the same data.
void check_resume(const train_options& o, const saved_state& saved) {
  if (uses_lora(o))
    check_resumed_adapters(o, saved);
  else
    check_resumed_model(o, saved);
  check_resumed_format(o, saved);
  const trainer_state& st = saved.state();
  if (st.seed != o.seed)
    throw config_error("cannot resume from " + o.resume_dir + ": it was trained with --seed " + std::to_string(st.seed) +
                       " (the order of its data and its held-out samples), not " + std::to_string(o.seed) +
                       "; pass --seed " + std::to_string(st.seed));
  // What a resume may change on purpose, said aloud: the schedule's length.
  if (st.total_steps != 0 && st.total_steps != o.optim.total_steps)
    std::fprintf(stderr, "upipe: note: the schedule now runs to step %lld (it ran to %lld when saved): the learning "
                 "rate from step %lld follows the new schedule\n", static_cast<long long>(o.optim.total_steps),
                 static_cast<long long>(st.total_steps), static_cast<long long>(st.step + 1));
  if (st.step >= (o.stop_after > 0 ? o.stop_after : o.optim.total_steps))
    throw config_error("the checkpoint in " + o.resume_dir + " is at step " + std::to_string(st.step) +
                       ", past the last step asked for; raise --steps or --stop-after");
  check_resumed_data(o, saved);
}


}  // namespace upipe
