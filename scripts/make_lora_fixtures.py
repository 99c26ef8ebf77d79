#!/usr/bin/env python3
"""Golden reference for upipe's LoRA, produced by PEFT on Hugging Face transformers.

usage: make_lora_fixtures.py [OUT_ROOT]      (default: tests/golden/lora)

For each tiny base model of tests/golden/ (tiny-llama: Llama 3 RoPE scaling, untied head;
tiny-qwen3: q/k norm, tied head) it loads the directory's config.json and
model.safetensors with transformers in float32, wraps the model with PEFT's LoRA (r = 4,
lora_alpha = 7, so alpha / r is not a power of two; dropout 0; every linear projection of
the layers: q, k, v, o, gate, up, down), lets PEFT initialize the adapters (A
kaiming-uniform, B = 0) from a fixed seed and then draws B from N(0, 0.05^2), so that no
gradient is trivially zero (with B = 0 every lora_A gradient would be). It computes the
causal-LM loss on the base's golden tokens (62 of them: padded under CP) and its backward,
and writes OUT_ROOT/<name>/:
  adapter_config.json, adapter_model.safetensors   PEFT's save_pretrained (what
                                                   `upipe train --init-adapter` reads)
  grads.safetensors   every lora_A / lora_B gradient, under the file's tensor names
  golden.json         loss, tokens, the LoRA settings, versions
Runs on the CPU; eager attention keeps it deterministic.
"""
import json
import os
import sys
from pathlib import Path

import peft
import torch
import transformers
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
SEED = 20261207
RANK, ALPHA = 4, 7
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def file_name(parameter_name):
    """PEFT's parameter name as its adapter file stores it: without the adapter's name."""
    return parameter_name.replace(".default.", ".")


def make(base_dir, out_dir):
    """base_dir relative to the repository (PEFT records it as base_model_name_or_path)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    golden = json.loads((base_dir / "golden.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32,
                                                              attn_implementation="eager")
    torch.manual_seed(SEED)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, bias="none",
                             task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn_like(p))
    tokens = torch.tensor(golden["tokens"])[None]
    out = model(input_ids=tokens, labels=tokens)
    out.loss.backward()
    grads = {file_name(n): p.grad.contiguous() for n, p in model.named_parameters() if p.requires_grad}
    assert len(grads) == 2 * len(TARGETS) * model.config.num_hidden_layers, sorted(grads)
    model.save_pretrained(out_dir)
    (out_dir / "README.md").unlink(missing_ok=True)  # PEFT's model card template
    save_file(grads, str(out_dir / "grads.safetensors"))
    record = {
        "base": str(base_dir),
        "tokens": golden["tokens"],
        "loss": float(out.loss.item()),
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": TARGETS,
        "seed": SEED,
        "peft": peft.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    (out_dir / "golden.json").write_text(json.dumps(record, indent=1) + "\n")
    print(base_dir.name, "loss", record["loss"], "adapter tensors", len(grads))


def main():
    out_root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / "tests/golden/lora"
    os.chdir(ROOT)
    for name in ("tiny-llama", "tiny-qwen3"):
        make(Path("tests/golden") / name, out_root / name)


if __name__ == "__main__":
    main()
