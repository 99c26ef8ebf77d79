#!/usr/bin/env python3
"""upipe's host AdamW (the --offload optimizer's) against PyTorch's CPU AdamW, one run.

Starts `upipe bench-adamw --serve` (the shards in the backend's host pool, updated by the
code the offload runs) and times, in turns, its step with the working copy it writes for
the GPU (bf16 with --backend cuda), its step on the f32 state alone (PyTorch's work), and
torch.optim.AdamW with fused=True and with foreach=True on the same number of parameters
in the same shapes and threads. Each is the fastest of --repeats steps after one warm-up;
the ratio is upipe's parameters per second over the faster PyTorch's.

    python3 scripts/bench_adamw.py --upipe build/upipe --params 64M
    python3 scripts/bench_adamw.py --upipe build-gpu/upipe --backend cuda --params 1024M --json adamw.json
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time


def count(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class Upipe:
    """upipe bench-adamw --serve: one line in, one step's seconds out."""

    def __init__(self, binary, params, tensors, threads, backend):
        self.proc = subprocess.Popen(
            [binary, "bench-adamw", "--serve", "--backend", backend, "--params", str(params), "--tensors",
             str(tensors), "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline().split()
        if not ready or ready[0] != "ready":
            sys.exit("upipe bench-adamw --serve did not start: " + " ".join(ready))
        self.threads = int(ready[2])

    def step(self, kind):
        self.proc.stdin.write(kind + "\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait()


def torch_side(params, tensors, threads):
    import torch
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(1)
    sizes = [params // tensors] * (tensors - 1) + [params - (tensors - 1) * (params // tensors)]
    weights = [torch.nn.Parameter(torch.randn(n, generator=gen) * 0.02) for n in sizes]
    for w in weights:
        w.grad = torch.randn(w.shape, generator=gen) * 1e-3
    opts = {}
    for mode in ("fused", "foreach"):
        opts[mode] = torch.optim.AdamW(weights, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                       **{mode: True})

    def step(mode):
        start = time.perf_counter()
        opts[mode].step()
        return time.perf_counter() - start
    return torch.__version__, step


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upipe", default="build/upipe")
    ap.add_argument("--backend", default="cpu", help="upipe's host pool: cpu, or cuda (pinned, bf16 working copy)")
    ap.add_argument("--params", default="64M")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="0: every core")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    params = count(a.params)
    threads = a.threads or os.cpu_count()
    upipe = Upipe(a.upipe, params, a.tensors, threads, a.backend)
    version, torch_step = torch_side(params, a.tensors, threads)
    sides = {"upipe_copy": lambda: upipe.step("copy"), "upipe_f32": lambda: upipe.step("f32"),
             "torch_fused": lambda: torch_step("fused"), "torch_foreach": lambda: torch_step("foreach")}
    for run in sides.values():  # warm-up: pages touched, moments past zero
        run()
    best = {name: float("inf") for name in sides}
    for _ in range(a.repeats):  # in turns, so that a busy moment of the machine hits every side
        for name, run in sides.items():
            best[name] = min(best[name], run())
    upipe.close()
    rate = {name: params / t for name, t in best.items()}
    fastest = max(("torch_fused", "torch_foreach"), key=lambda n: rate[n])
    work = "bf16" if a.backend == "cuda" else "f32"
    rows = [("upipe host AdamW + %s working copy (what --offload runs)" % work, "upipe_copy"),
            ("upipe host AdamW, f32 state only (PyTorch's work)", "upipe_f32"),
            ("torch.optim.AdamW(fused=True)", "torch_fused"),
            ("torch.optim.AdamW(foreach=True)", "torch_foreach")]
    print("# %s, %d threads; torch %s; %d parameters in %d tensors; fastest of %d steps each, in turns" %
          (cpu_name(), threads, version, params, a.tensors, a.repeats))
    print("| AdamW | ms / step | Gparams/s | vs PyTorch's fastest (%s) |" % fastest.replace("torch_", ""))
    print("|---|---|---|---|")
    for label, name in rows:
        print("| %s | %.1f | %.3f | %.2fx |" % (label, best[name] * 1e3, rate[name] / 1e9, rate[name] / rate[fastest]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_name(), "threads": threads, "torch": version, "params": params,
                       "tensors": a.tensors, "repeats": a.repeats, "backend": a.backend, "seconds": best,
                       "params_per_second": rate, "peer": fastest,
                       "ratio_copy": rate["upipe_copy"] / rate[fastest],
                       "ratio_f32": rate["upipe_f32"] / rate[fastest]}, f, indent=2)


if __name__ == "__main__":
    main()
