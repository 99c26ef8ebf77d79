#!/usr/bin/env python3
"""How long `upipe plan` takes on every preset and GPU count, with the default tiles and
chunks and with the smallest (--mlp-tile 1 --loss-chunk 1), and on two nodes (hybrid
planned too), and what it cost: the meta probes it ran (UPIPE_PLAN_STATS=1's line). Prints
one row per run, slowest first, and the slowest case. No time budget is asserted (the
machine's load moves the seconds); the probe counts are what to compare between versions.

  scripts/fuzz/plan_speed.py --binary build/upipe
  scripts/fuzz/plan_speed.py --binary build/upipe --model llama3-8b --model qwen3-32b
"""
import argparse
import os
import re
import subprocess
import sys
import time

PRESETS = ["llama3-8b", "llama3-70b", "llama3.2-1b", "llama3.2-3b", "qwen3-8b", "qwen3-32b", "tiny-llama",
           "tiny-qwen3"]
LAYOUTS = [["--gpus", str(g)] for g in (1, 2, 4, 8, 16, 32, 64)] + [["--gpus-per-node", "8", "--nodes", "2"]]
TILES = [[], ["--mlp-tile", "1", "--loss-chunk", "1"]]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", required=True)
    ap.add_argument("--model", action="append", choices=PRESETS, help="only these presets (default: all)")
    opts = ap.parse_args()
    rows = []
    for preset in opts.model or PRESETS:
        for layout in LAYOUTS:
            for tiles in TILES:
                args = [opts.binary, "plan", "--model", preset, "--gpu-memory", "80GiB"] + layout + tiles
                start = time.monotonic()
                r = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, UPIPE_PLAN_STATS="1"))
                seconds = time.monotonic() - start
                outcome = "planned" if r.returncode == 0 else f"refused ({r.returncode})"
                probes = re.search(r"(\d+) training-step probes, (\d+) eval probes", r.stderr)
                cost = f"{probes.group(1)}+{probes.group(2)} probes" if probes else "-"
                rows.append((seconds, " ".join(args[2:]), outcome, cost))
    rows.sort(reverse=True)
    for seconds, command, outcome, cost in rows:
        print(f"{seconds:7.2f} s  {cost:>16}  {outcome:<12} plan {command}")
    planned = [r for r in rows if r[2] == "planned"]
    print(f"# {len(rows)} runs ({len(planned)} planned, the rest refused: a GPU count the heads do not divide); "
          f"slowest {rows[0][0]:.2f} s: plan {rows[0][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
