#!/usr/bin/env python3
"""Checks that a checkpoint written by `upipe train --save` loads in Hugging Face
transformers and gives upipe's loss on the same tokens.

usage: check_hf_checkpoint.py UPIPE_BINARY WORK_DIR

For tiny-llama and tiny-qwen3: trains a few steps with upipe (4 CP ranks, upipe),
saves, evaluates the loss of the saved weights on 64 fixed tokens with `upipe step`,
then loads the directory with transformers (float32, CPU) and computes the loss on the
same tokens. Exits non-zero if they differ by more than 1e-5 relative.
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import transformers


def upipe(binary, *args):
    return subprocess.run([binary, *args], check=True, capture_output=True, text=True).stdout


def main():
    binary, work = sys.argv[1], Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    tokens = np.random.default_rng(5).integers(0, 64, size=64, dtype=np.uint32)
    tokens.tofile(work / "tokens.bin")
    worst = 0.0
    for model in ("tiny-llama", "tiny-qwen3"):
        ckpt = work / model
        upipe(binary, "train", "--model", model, "--steps", "8", "--seq-len", "64", "--eval-samples", "0",
              "--save", str(ckpt))
        upipe(binary, "step", "--config", str(ckpt / "config.json"), "--weights", str(ckpt), "--tokens",
              str(work / "tokens.bin"), "--seq-len", "64", "--cp", "1", "--json", str(work / f"{model}.json"))
        ours = json.loads((work / f"{model}.json").read_text())["loss"]
        hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager")
        ids = torch.tensor(tokens.astype(np.int64))[None]
        with torch.no_grad():
            theirs = float(hf(input_ids=ids, labels=ids).loss)
        rel = abs(ours - theirs) / abs(theirs)
        worst = max(worst, rel)
        print(f"{model}: upipe loss {ours:.8f}, transformers {transformers.__version__} loss {theirs:.8f}, "
              f"relative difference {rel:.2e}")
    sys.exit(0 if worst < 1e-5 else 1)


if __name__ == "__main__":
    main()
