"""Plots of upipe results (run by `upipe report`, which embeds this file).

usage: python3 -m upipe_tools.report OUT_DIR RESULTS.json...  (upipe report --out OUT_DIR RESULTS.json...)

Reads the JSON of `upipe bench`, `upipe bench-attention` (lists of rows), `upipe plan`
(an object with "entries") and `upipe eval` (an object with "lengths", or with "niah")
and writes each plot as SVG and PNG into OUT_DIR:
  memory_breakdown.svg  stacked bars of the peak by tag per strategy and U, at the
                        longest length of each (plan entries at their longest length)
  throughput_vs_s.svg   tokens/s/GPU against S per strategy and U (timed rows)
  peak_vs_s.svg         device peak against S per strategy and U
  u_ablation.svg        UPipe at one length: time and peak against U
  loss_by_position.svg  eval: held-out loss against the position in the context, a curve
                        per length and input file (log-spaced position buckets)
  niah_heatmap.svg      eval --niah: exact match by needle depth (rows) and context length
                        (columns), one panel per input file
  loss_curve.svg        train --metrics-json (JSON lines): training loss against the step,
                        the held-out loss where measured, the learning rate beside, a curve
                        per input file; a step recorded twice (a resumed run) is drawn
                        once, from its later record, and a skipped step is a gap
Prints one line per file written.
"""
import json
import math
import os
import sys

import matplotlib

matplotlib.use("agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
from . import error_line  # noqa: E402

GIB = float(1 << 30)
TAGS = ["weights", "grads", "optimizer", "activations", "attention", "comm", "workspace", "checkpoints_device"]


class bad_input(Exception):
    """A result file holding what no upipe command writes: the message names the file and the field."""


def check(row, key, kind, where, required=True):
    """The row's field `key` as `kind`: str, count (a whole number >= 0), number (finite), or
    tags (an object of counts by tag); None where it may be absent or null."""
    value = row.get(key) if isinstance(row, dict) else None
    if value is None:
        if required:
            raise bad_input(f"{where}: field '{key}' is missing (or null)")
        return None
    ok = {"str": isinstance(value, str),
          "count": isinstance(value, int) and not isinstance(value, bool) and value >= 0,
          "number": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
          "tags": isinstance(value, dict) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                  and math.isfinite(v) and v >= 0 for v in value.values())}[kind]
    if not ok:
        wants = {"str": "a string", "count": "a whole number of 0 or more", "number": "a finite number",
                 "tags": "an object of byte counts by tag"}[kind]
        raise bad_input(f"{where}: field '{key}' must be {wants}, found {json.dumps(value)[:60]}")
    return value


def objects(value, where):
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise bad_input(f"{where} must be a list of objects, found {json.dumps(value)[:60]}")
    return value


def bench_row(r, where):
    for key, kind, required in [("strategy", "str", True), ("seq_len", "count", True), ("head_chunk", "count", False),
                                ("peak_bytes", "tags", False), ("step_ms", "number", False),
                                ("time_ms", "number", False), ("tokens_per_s_per_gpu", "number", False),
                                ("device_peak_bytes", "number", False)]:
        check(r, key, kind, where, required)
    return dict(r, source="bench")


def plan_row(e, where):
    for key, kind in [("strategy", "str"), ("head_chunk", "count"), ("max_seq_len", "count"), ("peak_bytes", "tags"),
                      ("arena_bytes", "number")]:
        check(e, key, kind, where, key == "strategy")
    return {"strategy": e["strategy"], "head_chunk": e.get("head_chunk"), "seq_len": e["max_seq_len"],
            "peak_bytes": e.get("peak_bytes") or {}, "device_peak_bytes": e.get("arena_bytes"), "source": "plan"}


def eval_row(length, where, file):
    check(length, "seq_len", "count", where)
    for i, b in enumerate(objects(length.get("by_position") or [], where + ": by_position")):
        for key, kind in [("first", "count"), ("last", "count"), ("loss", "number")]:
            check(b, key, kind, f"{where}: by_position[{i}]")
    return {"source": "eval", "file": file, **length}


def niah_row(doc, where, file):
    if not isinstance(doc, dict):
        raise bad_input(f"{where} must be an object, found {json.dumps(doc)[:60]}")
    check(doc, "needle", "str", where, False)
    for i, c in enumerate(objects(doc.get("cells") or [], where + ": cells")):
        for key, kind in [("seq_len", "count"), ("depth", "number"), ("exact_match", "number")]:
            check(c, key, kind, f"{where}: cells[{i}]")
    return {"source": "niah", "file": file, "needle": "?", **doc}


def metrics_rows(text, file):
    """train --metrics-json: one JSON object per line, a step's ('step', 'loss', 'lr') or the
    run's final one ('final'); None when the text is not JSON lines. A step recorded twice (a
    run resumed from an earlier checkpoint appends the steps after it again) keeps its later
    record, and the steps come back in order; a skipped step's loss is null."""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 1 or not lines[0].lstrip().startswith("{"):
        return None
    by_step = {}
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == 0:
                return None
            raise bad_input(f"line {i + 1} is not JSON (a run killed while writing it?); remove that line")
        except RecursionError:
            raise bad_input(f"line {i + 1} nests too deep to be a metrics record; give the file of upipe train "
                            f"--metrics-json") from None
        if not isinstance(record, dict) or "step" not in record:
            if i == 0 and len(lines) == 1:
                return None
            continue  # the final record, or another object a later upipe adds
        where = f"line {i + 1}"
        check(record, "step", "count", where)
        check(record, "loss", "number", where, required=record.get("skipped") is not True)
        check(record, "lr", "number", where)
        if record.get("eval_loss") is not None:
            check(record, "eval_loss", "number", where)
        by_step[record["step"]] = record  # the later record of a step wins
    if not by_step:
        return None
    return [{"source": "metrics", "file": file, "steps": [by_step[k] for k in sorted(by_step)]}]


def rows_of(path):
    """The rows of one result file, each field the plots use checked."""
    with open(path, encoding="utf-8") as f:
        try:
            text = f.read()
        except UnicodeDecodeError as e:
            raise bad_input(f"it is not text ({e}); give the --json file of a finished upipe bench or plan")
    file = os.path.basename(path)
    metrics = metrics_rows(text, file)
    if metrics is not None:
        return metrics
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_input(f"it is not JSON ({e}); give the --json file of a finished upipe bench or plan")
    except RecursionError:
        raise bad_input("its JSON nests too deep to be a result file; give the --json file of a finished upipe "
                        "bench or plan") from None
    if isinstance(doc, dict) and "niah" in doc:  # upipe eval --niah
        return [niah_row(doc["niah"], "niah", file)]
    if isinstance(doc, dict) and "lengths" in doc:  # upipe eval
        return [eval_row(v, f"lengths[{i}]", file) for i, v in enumerate(objects(doc["lengths"], "lengths"))]
    if isinstance(doc, dict) and "entries" in doc:  # upipe plan
        entries = objects(doc["entries"], "entries")
        return [plan_row(e, f"entries[{i}]") for i, e in enumerate(entries) if e.get("max_seq_len")]
    if isinstance(doc, list):  # upipe bench, bench-attention
        return [bench_row(r, f"row {i}") for i, r in enumerate(objects(doc, "the file"))]
    raise bad_input("it is neither a list of benchmark rows nor a plan (an object with 'entries') nor an evaluation "
                    "(an object with 'lengths' or 'niah')")


def label(r):
    u = r.get("head_chunk")
    return r["strategy"] if r["strategy"] != "upipe" or u is None else f"upipe U={u}"


def tokens(s):
    return f"{s / (1 << 20):g}M" if s >= (1 << 20) else f"{s / (1 << 10):g}K" if s >= 1024 else str(s)


def time_of(r):
    return r.get("step_ms") if r.get("step_ms") is not None else r.get("time_ms")


def series(rows):
    groups = {}
    for r in rows:
        groups.setdefault(label(r), []).append(r)
    for g in groups.values():
        g.sort(key=lambda r: r["seq_len"])
    return groups


def save(fig, out_dir, name, tight=True):
    """Writes NAME (an .svg) and the same plot as .png."""
    if tight:
        fig.tight_layout()
    for path in (os.path.join(out_dir, name), os.path.join(out_dir, name[: -len(".svg")] + ".png")):
        fig.savefig(path, dpi=150)
        print(path)
    plt.close(fig)


def memory_breakdown(rows, out_dir):
    longest = {}
    for r in rows:
        if r.get("peak_bytes") and (label(r) not in longest or r["seq_len"] > longest[label(r)]["seq_len"]):
            longest[label(r)] = r
    if not longest:
        return
    names = list(longest)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(names) + 2), 4.5))
    bottom = [0.0] * len(names)
    for tag in TAGS:
        heights = [longest[n]["peak_bytes"].get(tag, 0) / GIB for n in names]
        if any(heights):
            ax.bar(names, heights, bottom=bottom, label=tag)
            bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("peak by tag (GiB; each tag at its own peak)")
    ax.set_title("memory per rank at " + ", ".join(sorted({tokens(longest[n]["seq_len"]) for n in names})))
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    save(fig, out_dir, "memory_breakdown.svg")


def against_s(rows, out_dir, key, ylabel, name, scale=1.0):
    groups = {k: [r for r in g if r.get(key) is not None] for k, g in series(rows).items()}
    groups = {k: g for k, g in groups.items() if g}
    if not groups:
        return
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for k, g in groups.items():
        ax.plot([r["seq_len"] for r in g], [r[key] / scale for r in g], marker="o", label=k)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: tokens(int(v))))
    ax.set_xlabel("sequence length S (tokens)")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    save(fig, out_dir, name)


def u_ablation(rows, out_dir):
    up = [r for r in rows if r["strategy"] == "upipe" and r.get("head_chunk") and r["source"] == "bench"
          and r.get("device_peak_bytes") is not None]
    by_s = {}
    for r in up:
        by_s.setdefault(r["seq_len"], []).append(r)
    candidates = {s: g for s, g in by_s.items() if len({r["head_chunk"] for r in g}) >= 2}
    if not candidates:
        return
    s = max(candidates)
    g = sorted(candidates[s], key=lambda r: r["head_chunk"])
    fig, ax = plt.subplots(figsize=(6, 4.5))
    us = [r["head_chunk"] for r in g]
    ax.plot(us, [r["device_peak_bytes"] / GIB for r in g], marker="o", color="C0", label="device peak")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("U (query heads per stage)")
    ax.set_ylabel("device peak per rank (GiB)", color="C0")
    times = [time_of(r) for r in g]
    if all(t is not None for t in times):
        ax2 = ax.twinx()
        ax2.plot(us, times, marker="s", color="C1", label="time")
        ax2.set_ylabel("time per step (ms)", color="C1")
    ax.set_title(f"UPipe U ablation at S = {tokens(s)}")
    save(fig, out_dir, "u_ablation.svg")


def loss_by_position(rows, out_dir):
    rows = [r for r in rows if r["source"] == "eval" and r.get("by_position")]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in rows:
        b = r["by_position"]
        x = [(e["first"] + e["last"]) / 2 for e in b]
        data = f" {os.path.basename(str(r['data']))}" if r.get("data") else ""  # upipe eval of several sources
        ax.plot(x, [e["loss"] for e in b], marker="o", label=f"{r['file']}{data} S={tokens(r['seq_len'])}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in the context (tokens, bucket centre)")
    ax.set_ylabel("held-out loss (nats)")
    ax.set_title("loss by position (upipe eval)")
    ax.legend(fontsize=8)
    save(fig, out_dir, "loss_by_position.svg")


def niah_heatmap(rows, out_dir):
    rows = [r for r in rows if r["source"] == "niah" and r.get("cells")]
    if not rows:
        return
    fig, axes = plt.subplots(1, len(rows), figsize=(1.2 + 3.2 * len(rows), 3.8), squeeze=False)
    for n, (ax, r) in enumerate(zip(axes[0], rows)):
        lengths = sorted({c["seq_len"] for c in r["cells"]})
        depths = sorted({c["depth"] for c in r["cells"]})
        grid = [[float("nan")] * len(lengths) for _ in depths]
        for c in r["cells"]:
            grid[depths.index(c["depth"])][lengths.index(c["seq_len"])] = c["exact_match"]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v == v:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [tokens(s) for s in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        if n == 0:
            ax.set_ylabel("needle depth")
        ax.set_title(f"{r['file']} ({r['needle']} needle)", fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), label="exact match")
    fig.suptitle("needle in a haystack (upipe eval --niah)", fontsize=10)
    save(fig, out_dir, "niah_heatmap.svg", tight=False)


def fail(message):
    """The one line upipe's refusals end with (upipe runs this script for `upipe report`), exit 2."""
    print(error_line("report", message), file=sys.stderr)
    sys.exit(2)


def loss_curve(rows, out_dir):
    runs = [r for r in rows if r["source"] == "metrics"]
    if not runs:
        return
    fig, (loss_ax, lr_ax) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for run in runs:
        steps = run["steps"]
        losses = [s["loss"] if s.get("loss") is not None else math.nan for s in steps]  # a skipped step: a gap
        line, = loss_ax.plot([s["step"] for s in steps], losses, lw=1, label=f"{run['file']} train")
        held = [s for s in steps if s.get("eval_loss") is not None]
        if held:
            loss_ax.plot([s["step"] for s in held], [s["eval_loss"] for s in held], "o--", ms=3, color=line.get_color(),
                         label=f"{run['file']} held-out")
        lr_ax.plot([s["step"] for s in steps], [s["lr"] for s in steps], lw=1, color=line.get_color())
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("training loss (upipe train --metrics-json)", fontsize=10)
    loss_ax.legend(fontsize=7)
    loss_ax.grid(alpha=0.3)
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("step")
    lr_ax.grid(alpha=0.3)
    save(fig, out_dir, "loss_curve.svg")


def main(argv):
    if len(argv) < 3:
        raise SystemExit(__doc__)
    out_dir = argv[1]
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        fail(f"cannot make the output directory {out_dir}: {e.strerror}; use --out DIR")
    rows = []
    for path in argv[2:]:
        try:
            rows.extend(rows_of(path))
        except bad_input as e:
            fail(f"{path}: {e}")
        except OSError as e:
            fail(f"cannot read {path}: {e.strerror}")
        except RecursionError:
            fail(f"{path}: its JSON nests too deep to be a result file; give the --json file of a finished upipe "
                 f"bench, plan or eval")
    if not rows:
        fail(f"{', '.join(argv[2:])} hold no rows: give the --json file of a finished upipe bench, plan or eval")
    loss_by_position(rows, out_dir)
    niah_heatmap(rows, out_dir)
    loss_curve(rows, out_dir)
    rows = [r for r in rows if r["source"] not in ("eval", "niah", "metrics")]
    if not rows:
        return
    memory_breakdown(rows, out_dir)
    against_s([r for r in rows if r["source"] == "bench"], out_dir, "tokens_per_s_per_gpu", "tokens/s/GPU",
              "throughput_vs_s.svg")
    against_s(rows, out_dir, "device_peak_bytes", "device peak per rank (GiB)", "peak_vs_s.svg", GIB)
    u_ablation(rows, out_dir)


if __name__ == "__main__":
    try:
        main(sys.argv)
    except OSError as e:  # writing a plot: a full disk, a path that is no directory
        fail(f"cannot write the plots into {sys.argv[1]}: {e}")
    except (ValueError, TypeError, OverflowError) as e:  # values the checks let through but a plot cannot draw
        fail(f"cannot plot the values in {', '.join(sys.argv[2:])}: {e}")
