#!/usr/bin/env python3
"""Independent check of an `upipe bench-attention --dump DIR` run.

Recomputes the attention layer (QKV projection, Qwen3's per-head q/k RMSNorm when the
run used it, rotate-half RoPE with optional Llama 3
scaling, causal grouped-query attention within the run's sliding window, output projection) and its backward pass in
float64 NumPy from the dumped inputs and weights, and compares upipe's outputs and
gradients per tensor as max|a-b| / max|b|. Exits non-zero above the tolerance.
"""
import json
import math
import sys
from pathlib import Path

import numpy as np


def inverse_frequencies(cfg, d):
    inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d)
    if not cfg["rope_llama3_scaling"]:
        return inv
    factor, low, high = cfg["rope_factor"], cfg["rope_low_freq_factor"], cfg["rope_high_freq_factor"]
    original = cfg["rope_original_max_position"]
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    scaled = np.where(wavelen > original / low, inv / factor, (1 - smooth) * inv / factor + smooth * inv)
    return np.where(wavelen < original / high, inv, scaled)


def rope(t, inv, sign):
    # t: (S, heads, d); pairs (i, i + d/2) rotate by sign * position * inv_freq[i].
    angles = np.arange(t.shape[0], dtype=np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(angles)[:, None, :], sign * np.sin(angles)[:, None, :]
    half = t.shape[2] // 2
    x1, x2 = t[..., :half], t[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def head_norm(t, w, eps):
    # Qwen3: RMSNorm over d of every (token, head) row; returns the rows and 1/rms.
    rstd = 1.0 / np.sqrt((t * t).mean(axis=-1, keepdims=True) + eps)
    return t * rstd * w, rstd


def head_norm_backward(g, pre, rstd, w):
    gw = g * w
    d_pre = rstd * (gw - pre * rstd**2 * (gw * pre).mean(axis=-1, keepdims=True))
    return d_pre, (g * pre * rstd).reshape(-1, pre.shape[-1]).sum(axis=0)


def layer(cfg, a):
    S, H, K, d = cfg["seq_len"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    inv = inverse_frequencies(cfg, d)
    x = a["x"]
    q_pre, k_pre = (x @ a["wq"].T).reshape(S, H, d), (x @ a["wk"].T).reshape(S, K, d)
    qk_norm = cfg.get("qk_norm", False)
    if qk_norm:
        q_normed, q_rstd = head_norm(q_pre, a["q_norm"], cfg["norm_eps"])
        k_normed, k_rstd = head_norm(k_pre, a["k_norm"], cfg["norm_eps"])
    else:
        q_normed, k_normed = q_pre, k_pre
    q, k = rope(q_normed, inv, 1.0), rope(k_normed, inv, 1.0)
    v = (x @ a["wv"].T).reshape(S, K, d)
    kq, vq = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)  # head h reads kv h // G
    scores = np.einsum("shd,thd->hst", q, kq) / math.sqrt(d)
    visible = np.tril(np.ones((S, S), dtype=bool))
    window = cfg.get("window", 0)
    if window > 0:  # query i sees keys j with i - W < j <= i
        visible &= np.triu(np.ones((S, S), dtype=bool), -(window - 1))
    scores = np.where(visible[None], scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = np.einsum("hst,thd->shd", p, vq)
    out = {"attn_out": o.reshape(S, H * d), "y": o.reshape(S, H * d) @ a["wo"].T}
    d_y = a["d_y"]
    d_o = (d_y @ a["wo"]).reshape(S, H, d)
    out["d_wo"] = d_y.T @ out["attn_out"]
    d_p = np.einsum("shd,thd->hst", d_o, vq)
    d_s = p * (d_p - np.einsum("shd,shd->hs", d_o, o)[..., None]) / math.sqrt(d)
    d_q = rope(np.einsum("hst,thd->shd", d_s, kq), inv, -1.0)
    d_kq = np.einsum("hst,shd->thd", d_s, q)
    d_vq = np.einsum("hst,shd->thd", p, d_o)
    d_k = rope(d_kq.reshape(S, K, H // K, d).sum(axis=2), inv, -1.0)
    if qk_norm:
        d_q, out["d_q_norm"] = head_norm_backward(d_q, q_pre, q_rstd, a["q_norm"])
        d_k, out["d_k_norm"] = head_norm_backward(d_k, k_pre, k_rstd, a["k_norm"])
    d_q, d_k = d_q.reshape(S, H * d), d_k.reshape(S, K * d)
    d_v = d_vq.reshape(S, K, H // K, d).sum(axis=2).reshape(S, K * d)
    out["d_x"] = d_q @ a["wq"] + d_k @ a["wk"] + d_v @ a["wv"]
    out["d_wq"], out["d_wk"], out["d_wv"] = d_q.T @ x, d_k.T @ x, d_v.T @ x
    return out


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: check_dump.py DUMP_DIR [TOLERANCE]")
    root = Path(sys.argv[1])
    tolerance = float(sys.argv[2]) if len(sys.argv) == 3 else 1e-5
    cfg = json.loads((root / "config.json").read_text())
    names = ["x", "wq", "wk", "wv", "wo", "d_y", "y", "attn_out", "d_x", "d_wq", "d_wk", "d_wv", "d_wo"]
    if cfg.get("qk_norm", False):
        names += ["q_norm", "k_norm", "d_q_norm", "d_k_norm"]
    a = {n: np.load(root / f"{n}.npy").astype(np.float64) for n in names}
    ref = layer(cfg, a)
    worst = 0.0
    for name, expected in ref.items():
        err = np.abs(a[name] - expected).max() / max(np.abs(expected).max(), 1e-300)
        worst = max(worst, err)
        print(f"{name:9s} max|a-b|/max|b| = {err:.3e}")
    print(f"worst {worst:.3e} (tolerance {tolerance:.0e})")
    sys.exit(0 if worst < tolerance else 1)


if __name__ == "__main__":
    main()
