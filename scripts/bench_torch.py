#!/usr/bin/env python3
"""PyTorch on the shapes of `upipe bench-kernels`, for side-by-side numbers in one call.

usage: bench_torch.py [--tokens 32768] [--repeats 5] [--layout bhsd|bshd|both] [--attention-only] [--json PATH]

GEMMs of a Llama3-8B layer with torch.matmul (bf16), causal grouped-query attention
forward and backward through cuDNN (torch.nn.attention.sdpa_kernel with
SDPBackend.CUDNN_ATTENTION) for d = 128 and 64, and a device-to-device copy. Prints the
cuDNN version PyTorch uses. The attention inputs are (batch, heads, tokens, d) contiguous
(bhsd, the default) or that shape over a (batch, tokens, heads, d) buffer (bshd: what a
Hugging Face model passes, and upipe's own layout).
"""
import argparse
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, repeats):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layout", choices=["bhsd", "bshd", "both"], default="bhsd")
    p.add_argument("--attention-only", action="store_true")
    p.add_argument("--json")
    a = p.parse_args()
    s, D, F, H, K = a.tokens, 4096, 14336, 32, 8
    dev, bf = "cuda", torch.bfloat16
    rows = []
    gemms = [] if a.attention_only else [("gemm q_proj/o_proj", D, D), ("gemm k_proj/v_proj", K * 128, D),
                                  ("gemm gate_proj/up_proj", F, D), ("gemm down_proj", D, F)]
    for name, rows_out, inner in gemms:
        x = torch.full((s, inner), 0.01, device=dev, dtype=bf)
        w = torch.full((rows_out, inner), 0.01, device=dev, dtype=bf)
        ms = timed(lambda: torch.matmul(x, w.t()), a.repeats)
        rows.append({"op": name, "time_ms": ms, "tflops": 2 * s * rows_out * inner / (ms * 1e9)})
        del x, w
    layouts = ["bhsd", "bshd"] if a.layout == "both" else [a.layout]
    for layout in layouts:
        for d in (128, 64):
            def make(heads):
                if layout == "bhsd":
                    return torch.randn(1, heads, s, d, device=dev, dtype=bf, requires_grad=True)
                return torch.randn(1, s, heads, d, device=dev, dtype=bf).transpose(1, 2).requires_grad_(True)
            q, k, v = make(H), make(K), make(K)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                fwd = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                f_ms = timed(fwd, a.repeats)
                o = fwd()
                g = torch.randn_like(o)
                b_ms = timed(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True), a.repeats)
            flops = 2.0 * s * s * H * d
            suffix = "" if layout == "bhsd" else " bshd"
            for tag, ms, f in [("forward", f_ms, flops), ("backward", b_ms, 2.5 * flops),
                               ("forward+backward", f_ms + b_ms, 3.5 * flops)]:
                rows.append({"op": f"sdpa d={d}{suffix} {tag}", "time_ms": ms, "tflops": f / (ms * 1e9)})
            del q, k, v, o, g
    x = torch.empty(s, D, device=dev, dtype=bf)
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), a.repeats)
    rows.append({"op": "copy (device to device)", "time_ms": ms, "gbytes_per_s": 2 * x.numel() * 2 / (ms * 1e6)})
    print(f"# torch {torch.__version__} cuDNN {torch.backends.cudnn.version()} on {torch.cuda.get_device_name()}")
    for r in rows:
        print(f"{r['op']:40s} {r['time_ms']:12.3f} {r.get('tflops', 0):10.1f} {r.get('gbytes_per_s', 0):10.1f}")
    if a.json:
        json.dump({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "rows": rows}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
