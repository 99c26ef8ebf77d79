#!/usr/bin/env python3
"""Checks that the LoRA adapters `upipe train --lora ... --save` writes are a PEFT adapter
directory that PEFT loads on the base with upipe's loss, and that `upipe export
--merge-adapter` writes a model transformers loads with the same loss.

usage: check_lora_adapter.py UPIPE_BINARY WORK_DIR

For the model directories of tests/golden/hf/ (a Llama with YaRN in bf16 shards, a tied
Qwen3, and the families of make_family_fixtures.py: Qwen2 with biases and with a window,
Mistral, Phi-3 with its fused modules, Gemma 3's text model): trains 6 steps of LoRA (r = 4, alpha = 8, all seven projections; 4 CP ranks,
UPipe, ZeRO-3 base) from the directory and saves the adapters, then with PyTorch on the
CPU in float32:
- PeftModel.from_pretrained(base, adapter) has the loss of `upipe step --model BASE
  --adapter ADAPTER` on 64 fixed tokens within 1e-5 relative, and the adapters moved away
  from their initialization (B is not zero);
- the run directory itself loads in PEFT as its latest checkpoint (the adapter links at its
  root), and `upipe step --adapter` takes it and its `latest` with the same loss;
- the export merged into the base (`upipe export BASE OUT --merge-adapter ADAPTER`, fp32)
  loads in transformers with PEFT's loss within 1e-5 relative, and PEFT's own
  merge_and_unload gives the same weights within 1e-6;
- `upipe train --init-adapter` from the saved adapters continues with its step-1 loss equal
  to `upipe step`'s on the same sequence.
Prints each number; exits non-zero on any difference.
"""
import json
import sys
from pathlib import Path

import peft
import torch
import transformers

from checklib import check, failures, fixed_inputs, train_into, upipe
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
LORA = "r=4,alpha=8,targets=q,k,v,o,gate,up,down"  # Phi-3's fused qkv_proj and gate_up_proj whole
# scripts/make_family_fixtures.py's model directories.
FAMILIES = ("qwen2-bias", "qwen2-window", "mistral-window", "phi3-fused", "gemma3-text")


def base_model(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                             attn_implementation="eager")


def loss_of(model, ids):
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def main():
    binary, work = sys.argv[1], Path(sys.argv[2])
    tokens, torch_ids, data = fixed_inputs(work)
    for name in ("llama-yarn-shards", "qwen3-tied", *FAMILIES):
        base = ROOT / "tests/golden/hf" / name
        adapter = train_into(binary, work / f"{name}-adapter", "--model", base, "--data", data, "--seq-len", 64,
                             "--steps", 6, "--cp", 4, "--zero", 3, "--lr", "1e-2", "--eval-samples", 0, "--lora", LORA)
        step = work / f"{name}-step.json"
        upipe(binary, "step", "--model", base, "--adapter", adapter, "--tokens", tokens, "--seq-len", 64, "--cp", 1,
              "--json", step)
        ours = json.loads(step.read_text())["loss"]
        b_max = max(float(t.abs().max()) for n, t in load_file(str(adapter / "adapter_model.safetensors")).items()
                    if "lora_B" in n)
        check(b_max > 1e-4, f"{name}: the adapters trained (max |B| {b_max:.2e})")
        model = peft.PeftModel.from_pretrained(base_model(base), adapter)
        theirs = loss_of(model, torch_ids)
        rel = abs(ours - theirs) / abs(theirs)
        check(rel < 1e-5, f"{name}: upipe step with the adapter {ours:.7f}, PEFT {peft.__version__} "
                          f"PeftModel.from_pretrained {theirs:.7f}, relative {rel:.1e}")
        run_dir = adapter.parent
        from_run = loss_of(peft.PeftModel.from_pretrained(base_model(base), run_dir), torch_ids)
        check(from_run == theirs, f"{name}: PeftModel.from_pretrained(base, the run directory) loads its latest "
                                  f"adapter ({from_run:.7f})")
        for named in (run_dir, run_dir / "latest"):
            upipe(binary, "step", "--model", base, "--adapter", named, "--tokens", tokens, "--seq-len", 64, "--cp", 1,
                  "--json", step)
            again = json.loads(step.read_text())["loss"]
            check(again == ours, f"{name}: upipe step --adapter {named.relative_to(work)}: {again:.7f}")
        base_loss = loss_of(base_model(base), torch_ids)
        check(abs(base_loss - theirs) > 1e-4, f"{name}: the adapter changes the loss ({base_loss:.7f} -> {theirs:.7f})")
        merged = work / f"{name}-merged"
        upipe(binary, "export", base, merged, "--merge-adapter", adapter, "--dtype", "fp32")
        merged_model = base_model(merged)
        merged_loss = loss_of(merged_model, torch_ids)
        rel = abs(merged_loss - theirs) / abs(theirs)
        check(rel < 1e-5, f"{name}: upipe export --merge-adapter loads in transformers {transformers.__version__} "
                          f"with loss {merged_loss:.7f}, relative to PEFT's {rel:.1e}")
        peft_merged = model.merge_and_unload().state_dict()
        worst = max(float((merged_model.state_dict()[k] - v).abs().max() / max(float(v.abs().max()), 1e-30))
                    for k, v in peft_merged.items())
        check(worst < 1e-6, f"{name}: merged weights equal PEFT's merge_and_unload (worst relative {worst:.1e})")
        # Continuing from the saved adapters: step 1's loss is that of the adapted model.
        metrics = work / f"{name}-continue.jsonl"
        upipe(binary, "train", "--model", base, "--data", tokens, "--seq-len", 64, "--steps", 1, "--cp", 2,
              "--eval-samples", 0, "--init-adapter", adapter, "--metrics-json", metrics)
        first = json.loads(metrics.read_text().splitlines()[0])["loss"]
        rel = abs(first - ours) / abs(ours)
        check(rel < 1e-5, f"{name}: train --init-adapter step 1 loss {first:.7f} equals the adapted model's "
                          f"({rel:.1e})")
    print(f"{len(failures)} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
