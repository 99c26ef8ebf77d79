"""What the check scripts share (check_hf_checkpoint.py, check_lora_adapter.py): running
upipe, failing loudly where it fails, and counting the checks that fail."""
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

failures = []


def upipe(binary, *args):
    """upipe's stdout; exits naming the command and its output where it fails."""
    r = subprocess.run([binary, *map(str, args)], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"upipe {' '.join(map(str, args))} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def train_into(binary, run_dir, *args):
    """`upipe train ARGS --save RUN_DIR` into a fresh run directory; returns the checkpoint its
    `latest` names (a model directory, or a PEFT adapter directory with --lora)."""
    run_dir = Path(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    upipe(binary, "train", *args, "--save", run_dir)
    return run_dir / (run_dir / "latest").read_text().strip()


def check(ok, what):
    """Prints one check's outcome; a failed one is kept in `failures`."""
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def fixed_inputs(work):
    """The checks' inputs under `work`: 64 fixed token ids (tokens.bin, also as a torch batch)
    and a 4096-token training file (data.bin)."""
    work.mkdir(parents=True, exist_ok=True)
    tokens = work / "tokens.bin"
    ids = np.random.default_rng(5).integers(0, 256, size=64, dtype=np.uint32)
    ids.tofile(tokens)
    data = work / "data.bin"
    np.random.default_rng(6).integers(3, 256, size=4096, dtype=np.uint32).tofile(data)
    return tokens, torch.tensor(ids.astype(np.int64))[None], data
