#!/usr/bin/env python3
"""Checks that what `upipe train --save` writes is a model directory transformers loads as
its own, with the same loss, tokenizer and configuration.

usage: check_hf_checkpoint.py UPIPE_BINARY WORK_DIR [NAMES]

For each model directory in tests/golden/hf/ (Llama with YaRN in bf16 shards, a tied Qwen3,
an fp16 Llama with linear scaling, and the families of make_family_fixtures.py: Qwen2 with
biases and with a window, Mistral, Phi-3 with fused projections saved fused again, Gemma 3's
text model), the mixtures of experts of make_moe_fixtures.py (tests/golden/moe/: Qwen3-MoE,
Mixtral, Qwen2-MoE with its load-balancing loss in the loss), the hybrids of
make_hybrid_fixtures.py (tests/golden/hybrid/: Qwen3.5 with and without its Gated DeltaNet
layers, Qwen3.5-MoE, Qwen3-Next, and the multimodal Qwen3.5 directory, saved as its text
model: its config.json the input's text_config) and for the tiny-llama preset
(NAMES: a comma-separated selection of these runs): trains a few steps with
upipe starting from it (4 CP ranks, UPipe), saving in bf16 (the default) and in fp32, and
once with the context extended (--rope-theta and --rope-scaling yarn). For every saved
directory it then checks, with transformers on the CPU in float32:
- the loss on 64 fixed tokens equals `upipe step --model SAVED` on the same tokens within
  1e-5 relative (both read the same stored weights), and the bf16 save's loss equals the
  fp32 save's within 1e-2;
- the tokenizer loads and encodes the input directory's sample texts as the input did;
- every field of the input config.json is kept, bos/eos included, except those training
  changes (dtype, max_position_embeddings, the RoPE settings when extended) and the
  version transformers stamps;
- `upipe export` of the checkpoint loads with the fp32 save's loss.
Exits non-zero on any difference.
"""
import json
import shutil
import sys
from pathlib import Path

import torch
import transformers

from checklib import check, failures, fixed_inputs, train_into, upipe

ROOT = Path(__file__).resolve().parent.parent
CHANGED = {"dtype", "torch_dtype", "max_position_embeddings", "transformers_version"}


def hf_loss(directory, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                              attn_implementation="eager")
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def upipe_loss(binary, directory, tokens, work, name):
    out = work / f"{name}.json"
    upipe(binary, "step", "--model", directory, "--tokens", tokens, "--seq-len", 64, "--cp", 1, "--json", out)
    return json.loads(out.read_text())["loss"]


def main():
    binary, work = sys.argv[1], Path(sys.argv[2])
    tokens, torch_ids, data = fixed_inputs(work)
    sources = [ROOT / "tests/golden/hf" / n for n in ("llama-yarn-shards", "qwen3-tied", "llama-fp16-linear",
                                                      "qwen2-bias", "qwen2-window", "mistral-window", "phi3-fused",
                                                      "gemma3-text")]
    sources += [ROOT / "tests/golden/moe" / n for n in ("qwen3-moe", "mixtral", "qwen2-moe")]
    sources += [ROOT / "tests/golden/hybrid" / n for n in ("qwen3-5-attention", "qwen3-5", "qwen3-5-moe", "qwen3-next",
                                                           "qwen3-5-vl")]
    runs = [(s, s.name, []) for s in sources] + [("tiny-llama", "tiny-llama", [])]
    runs.append((sources[0], "llama-yarn-extended",
                 ["--rope-theta", "20000", "--rope-scaling", "type=yarn,factor=8,original_max_position_embeddings=32"]))
    if len(sys.argv) > 3:  # only the runs named (e.g. qwen3-moe,mixtral)
        runs = [r for r in runs if r[1] in sys.argv[3].split(",")]
    for source, name, extra in runs:
        train = ["--model", source, "--data", data, "--seq-len", 64, "--steps", 4, "--cp", 4, "--eval-samples", 0, *extra]
        saved = {}
        for dtype in ("bf16", "fp32"):
            saved[dtype] = train_into(binary, work / f"{name}-{dtype}", *train, "--save-dtype", dtype)
        losses = {}
        for dtype, directory in saved.items():
            ours = upipe_loss(binary, directory, tokens, work, f"{name}-{dtype}")
            theirs = hf_loss(directory, torch_ids)
            losses[dtype] = theirs
            rel = abs(ours - theirs) / abs(theirs)
            check(rel < 1e-5, f"{name} {dtype} save: upipe {ours:.7f}, transformers {transformers.__version__} "
                              f"{theirs:.7f}, relative {rel:.1e}")
        rel = abs(losses["bf16"] - losses["fp32"]) / abs(losses["fp32"])
        check(rel < 1e-2, f"{name}: bf16 save's loss within 1e-2 of the fp32 save's ({rel:.1e})")
        exported = work / f"{name}-export"
        shutil.rmtree(exported, ignore_errors=True)
        upipe(binary, "export", saved["bf16"], exported, "--dtype", "fp32")
        rel = abs(hf_loss(exported, torch_ids) - losses["fp32"]) / abs(losses["fp32"])
        check(rel < 1e-6, f"{name}: upipe export (fp32) has the fp32 save's loss ({rel:.1e})")
        if not isinstance(source, Path):
            continue
        base = json.loads((source / "config.json").read_text())
        if "text_config" in base:  # a multimodal input: what upipe trained and saved is its text model
            base = dict(base["text_config"], bos_token_id=base["text_config"].get("bos_token_id"),
                        eos_token_id=base["text_config"].get("eos_token_id"))
            base.pop("architectures", None)
            base.pop("model_type", None)
        for directory in saved.values():
            got = json.loads((directory / "config.json").read_text())
            rope_keys = {"rope_parameters", "rope_scaling", "rope_theta"} if extra else set()
            lost = [k for k, v in base.items() if k not in CHANGED | rope_keys and got.get(k) != v]
            check(not lost, f"{directory.name}: every input config field kept (differing: {lost})")
            cfg = transformers.AutoConfig.from_pretrained(directory)
            check(cfg.bos_token_id == base["bos_token_id"] and cfg.eos_token_id == base["eos_token_id"],
                  f"{directory.name}: bos/eos {cfg.bos_token_id}/{cfg.eos_token_id}")
            gen = json.loads((directory / "generation_config.json").read_text())
            check(gen.get("bos_token_id") == base["bos_token_id"], f"{directory.name}: generation_config.json copied")
            golden = json.loads((source / "golden.json").read_text())
            tok = transformers.AutoTokenizer.from_pretrained(directory)
            encoded = [tok.encode(t) for t in golden.get("text_samples", [])]
            check(encoded == golden.get("text_ids", []), f"{directory.name}: the tokenizer encodes as the input's did")
            if extra:
                rope = got.get("rope_parameters") or got.get("rope_scaling")
                check(rope.get("rope_type") == "yarn" and rope.get("factor") == 8.0 and
                      (rope.get("rope_theta") or got.get("rope_theta")) == 20000.0,
                      f"{directory.name}: the extended RoPE is in config.json ({rope})")
    print(f"{len(failures)} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
