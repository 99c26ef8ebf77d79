#!/usr/bin/env python3
"""Loading a Hugging Face model directory for training: upipe against transformers.

usage: bench_load.py UPIPE_BINARY WORK_DIR [--model llama3.2-1b|llama3-8b] [--shards 2]
                     [--cp 4] [--backend cuda] [--json PATH]

Writes a random bf16 model of the named shape with transformers' save_pretrained, cut into
--shards files, then measures in fresh processes, one after the other:
- upipe: `upipe train --model DIR` with --cp ranks (ZeRO-3, each rank reads its shard of
  every unit from the mapped files) for one short step; the time is the one upipe prints
  for "weights loaded on every rank" (the checks and file mapping included), the peak RSS
  that of the whole process (the load and the step);
- transformers: `AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.bfloat16)` onto
  the GPU (device_map) where --backend is cuda, else onto the CPU; the time of the call,
  the process's peak RSS.
The page cache is warm for both: the directory was just written, and a first untimed
read brings every file in.
"""
import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, rope_theta=10000.0,
                 max_position_embeddings=2048),
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                        rope_theta=500000.0, max_position_embeddings=131072,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                      rope_theta=500000.0, max_position_embeddings=131072,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}

PEER = r"""
import resource, sys, time, torch, transformers
t = time.perf_counter()
kw = dict(dtype=torch.bfloat16)
if sys.argv[2] == "cuda":
    try:
        import accelerate  # noqa: F401  (device_map needs it)
        kw["device_map"] = "cuda"
    except ImportError:
        pass
m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], **kw)
if sys.argv[2] == "cuda":
    m = m.to("cuda")
    torch.cuda.synchronize()
print("seconds", time.perf_counter() - t)
print("versions", f"torch={torch.__version__},transformers={transformers.__version__}")
print("maxrss_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def make_model(shape, out, shards):
    import torch
    import transformers
    if (out / "config.json").exists():
        return
    config = transformers.LlamaConfig(**SHAPES[shape], bos_token_id=128000, eos_token_id=128001)
    torch.manual_seed(0)
    with torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    total = sum(p.numel() * 2 for p in model.parameters())
    # A little over total / shards: transformers cuts between tensors, so an even split would
    # leave a small extra file.
    model.save_pretrained(out, max_shard_size=int(total * 1.05) // shards)
    del model


# A fresh wrapper whose only child is the command: its RUSAGE_CHILDREN is that child's peak.
WRAP = r"""
import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stdout.write(r.stdout)
sys.stderr.write(r.stderr)
print("maxrss_kib", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(r.returncode)
"""


def child_maxrss(cmd):
    """Runs cmd in a fresh process; returns its output and its peak RSS in KiB."""
    r = subprocess.run([sys.executable, "-c", WRAP, *cmd], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    rss = [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("maxrss_kib")][-1]
    return r.stdout, rss


def main():
    p = argparse.ArgumentParser()
    p.add_argument("binary")
    p.add_argument("work", type=Path)
    p.add_argument("--model", default="llama3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--backend", default="cuda")
    p.add_argument("--json")
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    model_dir = a.work / f"{a.model}-bf16"
    make_model(a.model, model_dir, a.shards)
    files = sorted(f.name for f in model_dir.glob("*.safetensors"))
    for f in model_dir.glob("*.safetensors"):  # warm the page cache for both sides
        with open(f, "rb") as fh:
            while fh.read(1 << 26):
                pass
    import numpy as np
    tokens = a.work / "tokens.bin"
    np.random.default_rng(1).integers(0, min(128000, SHAPES[a.model]["vocab_size"]), size=4096, dtype=np.uint32).tofile(tokens)
    upipe_cmd = [a.binary, "train", "--model", str(model_dir), "--backend", a.backend, "--cp", str(a.cp), "--zero", "3",
                 "--data", str(tokens), "--seq-len", "1024", "--steps", "1", "--eval-samples", "0",
                 "--checkpoint-policy", "what=input,every=1,where=device", "--memory-gib", "16"]
    t = time.perf_counter()
    out, upipe_rss = child_maxrss(upipe_cmd)
    upipe_wall = time.perf_counter() - t
    load = [float(line.split(" in ")[1].split()[0]) for line in out.splitlines() if line.startswith("weights loaded")][0]
    out, peer_rss = child_maxrss([sys.executable, "-c", PEER, str(model_dir), a.backend])
    peer = dict(line.split() for line in out.splitlines() if line.startswith(("seconds", "versions")))
    size = sum((model_dir / f).stat().st_size for f in files)
    result = {"model": a.model, "files": files, "bytes": size, "cp": a.cp, "backend": a.backend,
              "upipe_load_s": load, "upipe_process_s": upipe_wall, "upipe_peak_rss_gib": upipe_rss / 2**20,
              "transformers_load_s": float(peer["seconds"]), "versions": peer["versions"], "transformers_peak_rss_gib": peer_rss / 2**20}
    print(f"# {a.model}: {len(files)} files, {size / 2**30:.2f} GiB of bf16; upipe {a.cp} ranks (ZeRO-3), backend {a.backend}")
    print(f"{'':14s} {'load s':>8s} {'peak RSS GiB':>13s}")
    print(f"{'upipe':14s} {load:8.3f} {result['upipe_peak_rss_gib']:13.2f}")
    print(f"{'transformers':14s} {result['transformers_load_s']:8.3f} {result['transformers_peak_rss_gib']:13.2f}")
    print(f"ratio (transformers / upipe): time {result['transformers_load_s'] / max(load, 1e-3):.2f}x, "
          f"peak RSS {result['transformers_peak_rss_gib'] / result['upipe_peak_rss_gib']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
