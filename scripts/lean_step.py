#!/usr/bin/env python3
"""The lean GPU check's helpers (scripts/gpu-check lean): a plan's recommended train command
as words, verbatim but for the --seq-len asked for, and the summary of a run of it beside
its meta run and the plan: arena high water, host memory (train's count, the process's peak
resident set and the pinned pools), step time against the step-time model.

    scripts/lean_step.py command PLAN.json [S|longest]
    scripts/lean_step.py summary PLAN.json META.jsonl GPU.jsonl RSS_KIB
"""
import json
import shlex
import sys


def tokens(text):
    scale = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * scale[text[-1]] if text[-1] in scale else int(text)


def command(plan_path, length="longest"):
    words = shlex.split(json.load(open(plan_path))["recommended_command"])[2:]
    if length != "longest":
        words[words.index("--seq-len") + 1] = str(tokens(length))
    print(" ".join(words))


def final(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [r for r in rows if not r.get("final")][-1], [r for r in rows if r.get("final")][0]


def summary(plan_path, meta_path, gpu_path, rss_kib):
    planned = json.load(open(plan_path))["recommended"]
    _, meta = final(meta_path)
    step, gpu = final(gpu_path)
    gib = 2**30
    # A run of one step waits for its whole offloaded update (the model's lone_step_extra).
    modelled = planned.get("step_seconds_model") or {}
    model = modelled["total"] + modelled.get("lone_step_extra", 0) if modelled else float("nan")
    seconds = step["seq_len"] / step["tokens_per_s"]  # one sequence a step
    print(f"S = {step['seq_len']} (planned at {planned['seq_len']}): loss {step['loss']:.4f}, step {seconds:.0f} s "
          f"(the model's at the planned S: {model:.0f} s), {step['tokens_per_s']:.0f} tok/s")
    print(f"arena high water: cuda {gpu['arena_high_water_bytes'] / gib:.2f} GiB, meta {meta['arena_high_water_bytes'] / gib:.2f}, "
          f"plan {planned['arena_bytes'] / gib:.2f} (at its S)")
    print(f"host: train's count {gpu['host_bytes'] / gib:.2f} GiB (pools pinned whole), meta {meta['host_bytes'] / gib:.2f} "
          f"(pools at their high water), plan {planned['host_bytes'] / gib:.2f} of --host-memory-gib "
          f"{planned['host_budget_bytes'] / gib:.2f}; the process's peak resident set {int(rss_kib) / 2**20:.2f} GiB")


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    {"command": command, "summary": summary}[what](*args)
