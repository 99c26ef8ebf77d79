#!/usr/bin/env python3
"""The fuzz corpus runner (issue #23): generates case I of seed S (scripts/fuzz/cases*.py),
runs upipe on it with a time and a memory limit, and classifies how the run ended.

  scripts/fuzz/run.py --binary build/upipe --runs 300              # the CI sample (seed 1)
  scripts/fuzz/run.py --binary build-asan/upipe --runs 6000 --jobs 2 --report fuzz.json
  scripts/fuzz/run.py --binary build/upipe --case 1234 --keep /tmp/case   # one case, its files kept

Good endings: ok (exit 0), refused (exit 2, the message naming the value or file), oom
(exit 3). Everything else fails the run: crash (a signal), sanitizer (an ASan/UBSan
report), internal (exit 4), hang (past the time limit), memory (past the RSS limit),
bad_exit (any other status), traceback (a Python traceback shown), silent (a value that
must be refused ran), spurious (a valid input refused), unnamed (a refusal without an
"upipe: error:" line, or naming neither the value nor the file), damaged
(a checkpoint or a user's file changed by a failed run, a path replaced, a temporary left).
Standard library only.
"""
import argparse
import concurrent.futures
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import inputs  # noqa: E402
from cases_runs import make_case  # noqa: E402

GOOD = {"ok", "refused", "oom"}
SANITIZER_MARKS = ["AddressSanitizer", "UndefinedBehaviorSanitizer", "LeakSanitizer", ": runtime error: "]


class result:
    def __init__(self, code, output, seconds, killed=None, peak_mib=0):
        self.code, self.output, self.seconds, self.killed, self.peak_mib = code, output, seconds, killed, peak_mib


def rss_mib(pid):
    """Resident memory of a process and its direct children, MiB."""
    total = 0
    pids = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) // 1024
        except OSError:
            pass
    return total


def run_limited(args, cwd, timeout, memory_mib, env):
    """Runs a command in its own process group; kills the group past `timeout` seconds or
    `memory_mib` of resident memory."""
    start = time.monotonic()
    with tempfile.TemporaryFile() as out:
        p = subprocess.Popen(args, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env=env)
        killed, peak = None, 0
        while p.poll() is None:
            peak = max(peak, rss_mib(p.pid))
            if peak > memory_mib:
                killed = "memory"
            elif time.monotonic() - start > timeout:
                killed = "hang"
            if killed:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
                break
            time.sleep(0.02)
        out.seek(0)
        text = out.read().decode("utf-8", "replace")
    return result(p.returncode, text, time.monotonic() - start, killed, peak)


def digest(path):
    """What a path holds: node kinds, names, sizes and contents, for 'unchanged' checks."""
    h = hashlib.sha1()
    if not os.path.lexists(path):
        return "missing"
    for root, dirs, files in os.walk(path) if os.path.isdir(path) and not os.path.islink(path) else [("", [], [path])]:
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            h.update(full.encode())
            if os.path.islink(full):
                h.update(os.readlink(full).encode())
            elif os.path.isfile(full):
                with open(full, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def temporaries(w):
    found = set()
    for root, dirs, files in os.walk(w):
        for name in dirs + files:
            if ".tmp-" in name:
                found.add(os.path.relpath(os.path.join(root, name), w))
    return found


def error_text(output):
    lines = [line for line in output.splitlines() if "error" in line.lower()]
    return "\n".join(lines[-3:]) if lines else output[-600:]


def classify(case, r, problems):
    out = r.output
    if any(mark in out for mark in SANITIZER_MARKS):
        return "sanitizer"
    if r.killed:
        return r.killed
    if r.code < 0:
        return "crash"
    if r.code == 4 or "internal error" in out:
        return "internal"
    if "Traceback (most recent call last)" in out:
        return "traceback"
    if r.code not in (0, 2, 3):
        return "bad_exit"
    if problems:
        return "damaged"
    if r.code == 0:
        return "silent" if case.expect == "refuse" else "ok"
    if case.expect == "ok":
        return "spurious"
    names = [n for n in case.names if n and n.strip()]
    message = error_text(out).lower()
    if not any(line.startswith("upipe: error:") for line in out.splitlines()):
        return "unnamed"  # every refusal ends with upipe's own error line, Python's scripts' too
    if names and not any(n.lower() in message for n in names):
        return "unnamed"
    return "refused" if r.code == 2 else "oom"


def run_case(index, opts, templates):
    case = make_case(opts.seed, index, templates, opts.families)
    w = os.path.join(opts.work, f"case-{index}")
    shutil.rmtree(w, ignore_errors=True)
    os.makedirs(w)
    case.setup(w)
    before_temps = temporaries(w)
    protected = {p: digest(os.path.join(w, p)) for p in case.protect}
    args = [opts.binary] + [a.replace("{w}", w).replace("{t}", templates["root"]) for a in case.args]
    r = run_limited(args, w, min(case.timeout, opts.timeout) * opts.slowdown, opts.memory_mib, opts.env)
    problems = list(case.check(w, r)) if case.check and not r.killed else []
    if r.code != 0 and not r.killed:
        problems += [f"{p} changed by a failed run" for p, d in protected.items() if digest(os.path.join(w, p)) != d]
    if not r.killed and r.code in (0, 2, 3):
        left = temporaries(w) - before_temps
        if left:
            problems.append(f"temporaries left: {sorted(left)}")
    kind = classify(case, r, problems)
    record = {"case": index, "family": case.family, "what": case.what, "class": kind, "exit": r.code,
              "seconds": round(r.seconds, 3), "peak_mib": r.peak_mib,
              "command": " ".join(repr(a) if (not a or " " in a) else a for a in args[1:])}
    if kind not in GOOD:
        record["problems"] = problems
        record["output"] = r.output[-3000:]
    if opts.keep is None or kind in GOOD:
        shutil.rmtree(w, ignore_errors=True)
    return record


def make_templates(opts):
    """The valid inputs cases start from: three checkpoints (passkey, a corpus, LoRA), a corpus,
    the JSON the report reads, and whether character devices can be made here."""
    root = os.path.join(opts.work, "templates")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    source = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    t = {"root": root, "golden": os.path.join(source, "tests", "golden"),
         "hf": os.path.join(source, "tests", "golden", "hf"), "corpus": os.path.join(root, "corpus")}
    import random
    for suffix, blob in inputs.corpus_files(random.Random(0), 256, documents=24, length=40).items():
        inputs.write_bytes(t["corpus"] + suffix, blob)
    train = [opts.binary, "train", "--steps", "2", "--seq-len", "32", "--cp", "2", "--eval-samples", "0",
             "--checkpoint-policy", "what=input"]
    reports = {"bench_attention": ["bench-attention", "--backend", "meta", "--strategy", "ulysses,upipe,ring",
                                   "--seq-len", "64,128"],
               "plan": ["plan", "--model", "tiny-llama", "--gpus", "2", "--gpu-memory", "2GiB", "--host-memory",
                        "2GiB"],
               "bench": ["bench", "--layers", "1", "--seq-len", "64", "--repeats", "1", "--cp", "2"],
               "eval": ["eval", "--model", os.path.join(root, "checkpoint"), "--data", t["corpus"], "--seq-len",
                        "32,64", "--samples", "2", "--cp", "1"],
               "niah": ["eval", "--niah", "--model", "tiny-llama", "--lengths", "64", "--samples", "1", "--cp", "1"]}
    # Each template run saves into a run directory; its latest checkpoint is taken out as
    # the template (a checkpoint directory the cases copy and mutate).
    runs = {"checkpoint": train, "checkpoint_data": train + ["--data", t["corpus"]],
            "checkpoint_lora": train + ["--lora", "r=2"]}
    commands = [c + ["--save", os.path.join(root, name + ".run")] for name, c in runs.items()]
    commands += [[opts.binary] + a + ["--json", os.path.join(root, k + ".json")] for k, a in reports.items()
                 if k != "eval"]
    commands += [[opts.binary] + reports["eval"] + ["--json", os.path.join(root, "eval.json")]]
    for c in commands:
        r = subprocess.run(c, capture_output=True, text=True, env=opts.env)
        if r.returncode != 0:
            sys.exit(f"fuzz: a template failed: {' '.join(c)}\n{r.stdout}{r.stderr}")
        for name in runs:
            run_dir = os.path.join(root, name + ".run")
            if os.path.isfile(os.path.join(run_dir, "latest")) and not os.path.exists(os.path.join(root, name)):
                with open(os.path.join(run_dir, "latest")) as f:
                    os.rename(os.path.join(run_dir, f.read().strip()), os.path.join(root, name))
    t["reports"] = {k: os.path.join(root, k + ".json") for k in reports}
    try:
        os.mknod(os.path.join(root, "probe"), 0o666 | 0o020000, os.makedev(1, 3))
        t["can_mknod"] = True
    except (PermissionError, OSError):
        t["can_mknod"] = False
    return t


def summarize(records, seconds):
    classes = {}
    by_family = {}
    for r in records:
        classes[r["class"]] = classes.get(r["class"], 0) + 1
        fam = by_family.setdefault(r["family"], {})
        fam[r["class"]] = fam.get(r["class"], 0) + 1
    order = ["ok", "refused", "oom", "crash", "sanitizer", "internal", "hang", "memory", "bad_exit", "traceback",
             "silent", "spurious", "unnamed", "damaged"]
    print(f"\n{'family':<15}" + "".join(f"{c:>10}" for c in order))
    for fam in sorted(by_family):
        print(f"{fam:<15}" + "".join(f"{by_family[fam].get(c, 0):>10}" for c in order))
    print(f"{'all':<15}" + "".join(f"{classes.get(c, 0):>10}" for c in order))
    bad = sum(n for c, n in classes.items() if c not in GOOD)
    slowest = max(records, key=lambda r: r["seconds"]) if records else None
    print(f"# {len(records)} runs in {seconds:.0f} s, {bad} failing"
          + (f"; slowest case {slowest['case']} ({slowest['seconds']:.1f} s)" if slowest else ""))
    return classes, by_family, bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", required=True, help="the upipe binary")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=300, help="cases 0..N-1 of the seed")
    ap.add_argument("--first", type=int, default=0, help="start at this case")
    ap.add_argument("--case", type=int, action="append", help="run only these cases")
    ap.add_argument("--families", help="comma-separated families only (the regression cases always run)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60, help="seconds before a run is a hang")
    ap.add_argument("--slowdown", type=float, default=1,
                    help="how much slower the binary runs than a release build (a sanitized one: 10); "
                         "every time limit is multiplied by it")
    ap.add_argument("--memory-mib", type=int, default=3072, help="resident memory before a run is a blow-up")
    ap.add_argument("--work", help="scratch directory (default: a temporary one)")
    ap.add_argument("--keep", help="keep failing cases' directories (under --work)")
    ap.add_argument("--report", help="write every record as JSON here")
    ap.add_argument("--quiet", action="store_true")
    opts = ap.parse_args()
    opts.binary = os.path.abspath(opts.binary)
    opts.families = opts.families.split(",") if opts.families else None
    own_work = opts.work is None
    opts.work = os.path.abspath(opts.work or tempfile.mkdtemp(prefix="upipe-fuzz-"))
    os.makedirs(opts.work, exist_ok=True)
    # upipe refuses (exit 3) a run whose planned host memory exceeds UPIPE_MEMORY_LIMIT: a third
    # of the blow-up limit leaves room for what it does not plan (mappings, ASan's shadow).
    opts.env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:allocator_may_return_null=1",
                    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", LC_ALL="C",
                    UPIPE_MEMORY_LIMIT=f"{opts.memory_mib // 3}M")
    start = time.monotonic()
    templates = make_templates(opts)
    indices = opts.case or list(range(opts.first, opts.first + opts.runs))
    records, lock = [], threading.Lock()
    with concurrent.futures.ThreadPoolExecutor(max_workers=opts.jobs) as pool:
        futures = {pool.submit(run_case, i, opts, templates): i for i in indices}
        for done, f in enumerate(concurrent.futures.as_completed(futures), 1):
            r = f.result()
            with lock:
                records.append(r)
            if r["class"] not in GOOD:
                print(f"FAIL {r['class']:<9} case {r['case']} [{r['family']}] {r['what']}\n  upipe {r['command']}\n  "
                      + "\n  ".join((r.get("problems") or []) + [error_text(r.get("output", ""))[-400:]]), flush=True)
            elif not opts.quiet and done % 100 == 0:
                print(f"# {done}/{len(indices)} runs", flush=True)
    records.sort(key=lambda r: r["case"])
    classes, by_family, bad = summarize(records, time.monotonic() - start)
    if opts.report:
        with open(opts.report, "w") as f:
            json.dump({"binary": opts.binary, "seed": opts.seed, "runs": len(records), "classes": classes,
                       "families": by_family, "records": records}, f, indent=1)
    if own_work and not opts.keep:
        shutil.rmtree(opts.work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
