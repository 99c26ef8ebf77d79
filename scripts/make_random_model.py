#!/usr/bin/env python3
"""A Llama-family model directory with random weights, as save_pretrained lays it out.

usage: make_random_model.py CONFIG.json OUT_DIR [--dtype bf16|fp32] [--seed N] [--std 0.02]
                            [--max-shard-gib 5]

Writes OUT_DIR/config.json (CONFIG's) and the weights transformers' initialization draws
(every matrix normal with standard deviation --std, the RMSNorm weights 1) as
model.safetensors, or as 5 GiB shards with model.safetensors.index.json, under the Hugging
Face names (model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight, ...,
lm_head.weight unless tie_word_embeddings). NumPy only. For a model of billions of
parameters the values are windows at random offsets of one pool of 2^26 normal draws (the
files are written at the disk's speed); a model of at most 2^26 parameters gets its own
draws for every tensor.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

POOL = 1 << 26


def parameters(cfg):
    """(name, shape) of every parameter, in the order the files hold them."""
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, K = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or D // H
    out = [("model.embed_tokens.weight", (V, D))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (H * hd, D)), (p + "self_attn.k_proj.weight", (K * hd, D)),
                (p + "self_attn.v_proj.weight", (K * hd, D)), (p + "self_attn.o_proj.weight", (D, H * hd)),
                (p + "mlp.gate_proj.weight", (F, D)), (p + "mlp.up_proj.weight", (F, D)),
                (p + "mlp.down_proj.weight", (D, F)), (p + "input_layernorm.weight", (D,)),
                (p + "post_attention_layernorm.weight", (D,))]
    out.append(("model.norm.weight", (D,)))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (V, D)))
    return out


def bf16_bits(x):
    """float32 -> bf16 bits, round to nearest even."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


class writer:
    """One safetensors file: the header first (its offsets known from the shapes), then the
    data streamed tensor by tensor."""

    def __init__(self, path, tensors, dtype):
        self.size = 2 if dtype == "bf16" else 4
        header, offset = {}, 0
        for name, shape in tensors:
            n = int(np.prod(shape)) * self.size
            header[name] = {"dtype": "BF16" if dtype == "bf16" else "F32", "shape": list(shape),
                            "data_offsets": [offset, offset + n]}
            offset += n
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * ((8 - len(text) % 8) % 8)
        self.file = open(path, "wb")
        self.file.write(len(text).to_bytes(8, "little") + text)
        self.bytes = offset

    def close(self):
        self.file.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--std", type=float, default=0.02)
    p.add_argument("--max-shard-gib", type=float, default=5)
    a = p.parse_args()
    cfg = json.loads(a.config.read_text())
    cfg["torch_dtype"] = "bfloat16" if a.dtype == "bf16" else "float32"
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    rng = np.random.default_rng(a.seed)
    tensors = parameters(cfg)
    total = sum(int(np.prod(s)) for _, s in tensors)
    pool = (rng.standard_normal(POOL) * a.std).astype(np.float32) if total > POOL else np.zeros(0, np.float32)
    pool = bf16_bits(pool) if a.dtype == "bf16" else pool
    ones = np.ones(1, np.float32)
    ones = bf16_bits(ones) if a.dtype == "bf16" else ones
    size = 2 if a.dtype == "bf16" else 4
    # Shards of at most --max-shard-gib, in order.
    limit = int(a.max_shard_gib * (1 << 30))
    shards, current, used = [], [], 0
    for name, shape in tensors:
        n = int(np.prod(shape)) * size
        if current and used + n > limit:
            shards.append(current)
            current, used = [], 0
        current.append((name, shape))
        used += n
    shards.append(current)
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for shard, file in zip(shards, files):
        w = writer(a.out / file, shard, a.dtype)
        for name, shape in shard:
            n = int(np.prod(shape))
            weight_map[name] = file
            if len(shape) == 1:  # an RMSNorm weight
                w.file.write(np.repeat(ones, n).tobytes())
                continue
            if total <= POOL:  # a small model: its own draws for every tensor
                x = (rng.standard_normal(n) * a.std).astype(np.float32)
                w.file.write((bf16_bits(x) if a.dtype == "bf16" else x).tobytes())
                continue
            start = int(rng.integers(len(pool)))
            while n > 0:
                piece = pool[start:start + n]
                w.file.write(piece.tobytes())
                n -= len(piece)
                start = 0
        w.close()
        print(f"{a.out / file}: {len(shard)} tensors", flush=True)
    if len(files) > 1:
        index = {"metadata": {"total_size": total * size}, "weight_map": weight_map}
        (a.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    print(f"{a.out}: {total} parameters ({total * size / (1 << 30):.2f} GiB, {a.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
