#!/usr/bin/env python3
"""The step-time model (src/plan/step_time.*) against measured steps: bench rows (bench
--json, one object per configuration) and train runs (--metrics-json, one object per step,
then a final one). Prints measured, model and their ratio for each, and exits 1 where a
ratio leaves 1 +- --tolerance (0.15: issue #48's bound).

    scripts/step_time_check.py [--upipe build/upipe] [--tolerance 0.15] FILE...
    scripts/step_time_check.py --calibrate FILE...    # the rates the measured phases imply

A row written by this tree carries the model's prediction (step_seconds_model); an older
one (docs/results/) is planned again here: the row's configuration run by `upipe bench
--backend meta` (shapes only, seconds), whose JSON has it. A train run's final record
carries it too; an older run needs --command FILE, the train command it ran (the lean
part's lean_step_command.txt), which runs here on meta for one step.

Which model figure a measurement is held to:
- a bench row: the step with its update (bench's last timed step waits for its own); a
  row of rank 0 emulated over the loopback drops the collectives, which it does not run;
- a train step: the step; the last step of a run adds what the model says a step with no
  next step adds (its whole offloaded update, train waits for it there); the first of a run
  of several builds cuDNN's plans and touches the pools first, and is printed but not held.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

COLLECTIVES = ("all_to_all", "ring", "zero", "data_parallel")


def load(path):
    text = open(path).read().strip()
    if text.startswith("["):
        return "bench", json.loads(text)
    return "train", [json.loads(line) for line in text.splitlines() if line.strip()]


def bench_on_meta(upipe, row):
    """The model's prediction for an older bench row: its configuration on the meta backend."""
    words = [upipe, "bench", "--backend", "meta", "--model", row["model"], "--attention", row["strategy"],
             "--seq-len", str(row["seq_len"]), "--checkpoint-policy", row["checkpoint_policy"], "--repeats", "1",
             "--no-check", "--memory-gib", "4096", "--zero", str(row.get("zero", 3))]
    words += ["--emulate-cp" if row.get("emulated") else "--cp", str(row["cp"])]
    if row.get("layers"):
        words += ["--layers", str(row["layers"])]
    if row.get("head_chunk"):
        words += ["--head-chunk", str(row["head_chunk"])]
    if row.get("dp", 1) > 1:
        words += ["--dp", str(row["dp"])]
    if row.get("lora"):
        words += ["--lora", row["lora"]]
    for key, flag in (("offload", "--offload"), ("offload_overlap", "--offload-overlap"),
                      ("optimizer_state", "--optimizer-state"), ("master_weights", "--master-weights"),
                      ("grad_dtype", "--grad-dtype"), ("max_grad_norm", "--max-grad-norm")):
        if row.get(key) is not None:
            words += [flag, str(row[key])]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "meta.json")
        subprocess.run(words + ["--json", out], check=True, stdout=subprocess.DEVNULL)
        return json.load(open(out))[0]


def train_on_meta(upipe, command_file):
    """The model's prediction for an older train run: its command, one step on meta."""
    words = shlex.split(open(command_file).read())
    while words and not words[0].startswith("--"):  # the program and its command
        words.pop(0)
    for flag in ("--backend", "--steps", "--metrics-json"):
        while flag in words:
            i = words.index(flag)
            del words[i:i + 2]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "meta.jsonl")
        subprocess.run([upipe, "train", *words, "--backend", "meta", "--steps", "1", "--metrics-json", out],
                       check=True, stdout=subprocess.DEVNULL)
        return [json.loads(line) for line in open(out) if line.strip()][-1]["step_seconds_model"]


def bench_rows(path, rows, upipe):
    for i, row in enumerate(rows):
        if row.get("step_ms") is None:
            continue
        if row.get("step_seconds_model") is None:  # an older row: its configuration planned again
            meta = bench_on_meta(upipe, row)
            row = dict(row, step_seconds_model=meta["step_seconds_model"], step_rates=meta["step_rates"])
        model = row["step_seconds_model"]
        predicted = model["total"]
        if row.get("emulated"):
            predicted -= sum(model.get(k, 0) for k in COLLECTIVES)
        what = (f"{row['strategy']}" + (f" U={row['head_chunk']}" if row.get("head_chunk") else "") +
                f" S={row['seq_len']} C={row['cp']}{' emulated' if row.get('emulated') else ''} layers={row['layers']}"
                + (f" --offload {row['offload']} overlap {row.get('offload_overlap', 'on')}"
                   if row.get("offload", "none") != "none" else ""))
        yield f"{os.path.basename(path)}[{i}]", what, row["step_ms"] / 1e3, predicted, row, model


def train_rows(path, records, upipe, command):
    steps = [r for r in records if not r.get("final")]
    final = next((r for r in records if r.get("final")), {})
    model = final.get("step_seconds_model")
    if model is None:
        if not command:
            sys.exit(f"{path}: no step_seconds_model in its final record: give --command FILE (the train command it ran)")
        model = train_on_meta(upipe, command)
    for n, step in enumerate(steps):
        seconds = step.get("seconds") or step["seq_len"] / step["tokens_per_s"]  # older runs: one sequence a step
        last = n + 1 == len(steps)
        first = n == 0 and len(steps) > 1  # builds cuDNN's plans and touches the pools first: not held to the model
        predicted = model["total"] + (model.get("lone_step_extra", 0) if last else 0)
        note = " (first of the run: not held)" if first else " (last: its update waited for)" if last else ""
        yield (f"{os.path.basename(path)} step {step['step']}", f"S={step['seq_len']}{note}", seconds, predicted,
               dict(step, step_rates=final.get("step_rates"), not_held=first), model)


def calibrate(rows):
    """The rates a row's measured phases imply, from the model's parts at its rates."""
    for name, _, _, _, row, model in rows:
        rates = row.get("step_rates") or {}
        phases = row.get("phases_ms") or {}
        if phases and rates:
            gemm_ms = sum(phases.get(k, 0) for k in ("mlp", "loss", "attn_project", "attn_out_proj", "attn_input_grads"))
            if phases.get("attn_sdpa"):
                print(f"{name}: attention_tflops = {model['attention'] * rates['attention_tflops'] / (phases['attn_sdpa'] / 1e3):.0f}")
            if gemm_ms:
                print(f"{name}: gemm_tflops = {model['gemm'] * rates['gemm_tflops'] / (gemm_ms / 1e3):.0f}")
            rest = sum(phases.get(k, 0) for k in ("other", "attn_rope", "attn_pack"))
            if rest and model.get("elementwise"):
                print(f"{name}: elementwise_ns = {rates['elementwise_ns'] * rest / 1e3 / model['elementwise']:.0f}")
        table = row.get("step_phases") or row.get("phases") or {}
        for what, c in (table.get("side_copies") or {}).items():
            if c["ms"] > 0:
                print(f"{name}: pcie_gbytes ({what}) = {c['bytes'] / c['ms'] / 1e6:.1f}")
        host = table.get("host") or {}
        for kind in ("host_adamw", "host_adamw_master"):
            if kind in host and host[kind]["busy_ms"] > 0 and model.get("host_adamw") and rates:
                print(f"{name}: host_adamw_gbytes ({kind}) = "
                      f"{model['host_adamw'] * rates['host_adamw_gbytes'] / (host[kind]['busy_ms'] / 1e3):.1f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--upipe", default="build/upipe")
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--command", help="the train command an older metrics file ran (for its model)")
    parser.add_argument("--calibrate", action="store_true", help="print the rates the measured phases imply")
    args = parser.parse_args()
    rows = []
    for path in args.files:
        kind, data = load(path)
        rows += list(bench_rows(path, data, args.upipe) if kind == "bench" else train_rows(path, data, args.upipe, args.command))
    if args.calibrate:
        calibrate(rows)
        return 0
    bad = 0
    print(f"{'measured':<40} {'configuration':<70} {'step s':>10} {'model s':>10} {'ratio':>7}")
    for name, what, measured, predicted, row, _ in rows:
        ratio = measured / predicted if predicted > 0 else float("inf")
        ok = abs(ratio - 1) <= args.tolerance or row.get("not_held", False)
        bad += 0 if ok else 1
        print(f"{name:<40} {what:<70} {measured:>10.3f} {predicted:>10.3f} {ratio:>7.3f}{'' if ok else '  OUTSIDE'}")
    print(f"# {len(rows)} measured steps, {bad} outside 1 +- {args.tolerance} of the step-time model")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
