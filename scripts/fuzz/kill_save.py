#!/usr/bin/env python3
"""SIGKILL during checkpoint saves (issue #23): a run that saves every step (keeping the
last one, so that kills also land in removals) is killed at a random moment, again and
again; after each kill the run directory's `latest` must name the previous checkpoint or a
complete new one, and the next save must leave no temporary, no half-removed checkpoint
and one checkpoint.

  scripts/fuzz/kill_save.py --binary build/upipe              # 20 kills (the full check)
  scripts/fuzz/kill_save.py --binary build/upipe --kills 3    # what ctest runs

Every other kill is aimed: it waits for a save to begin and kills a random moment into it.
A checkpoint is complete when its manifest names files that all exist, `upipe export`
reads its whole trainer state, and `upipe step --model` loads its weights. Prints one line
per kill (when it landed, the step found, whether a save was in flight) and a summary;
exits 1 on any failure. Standard library only.
"""
import argparse
import array
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

# A model large enough that a save (a few tens of MB, fsynced) takes a good share of a step.
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 256,
          "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
          "max_position_embeddings": 4096, "tie_word_embeddings": False}
TRAIN = ["train", "--seq-len", "32", "--cp", "2", "--eval-samples", "0", "--checkpoint-policy", "what=input",
         "--seed", "3"]


def write_weights(model_dir, seed):
    """Random weights of CONFIG under Hugging Face names, as model.safetensors (F32)."""
    D, F, V, L = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"], CONFIG["num_hidden_layers"]
    q = CONFIG["num_attention_heads"] * CONFIG["head_dim"]
    kv = CONFIG["num_key_value_heads"] * CONFIG["head_dim"]
    shapes = {"model.embed_tokens.weight": [V, D], "model.norm.weight": [D], "lm_head.weight": [V, D]}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": [D], p + "post_attention_layernorm.weight": [D],
                       p + "self_attn.q_proj.weight": [q, D], p + "self_attn.k_proj.weight": [kv, D],
                       p + "self_attn.v_proj.weight": [kv, D], p + "self_attn.o_proj.weight": [D, q],
                       p + "mlp.gate_proj.weight": [F, D], p + "mlp.up_proj.weight": [F, D],
                       p + "mlp.down_proj.weight": [D, F]})
    rng = random.Random(seed)
    header, blobs, offset = {}, [], 0
    for name in sorted(shapes):
        n = 1
        for d in shapes[name]:
            n *= d
        values = array.array("f", [1.0] * n if len(shapes[name]) == 1 else
                             [rng.uniform(-0.03, 0.03) for _ in range(n)])
        blobs.append(values.tobytes())
        header[name] = {"dtype": "F32", "shape": shapes[name], "data_offsets": [offset, offset + 4 * n]}
        offset += 4 * n
    text = json.dumps(header).encode()
    with open(os.path.join(model_dir, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def run(binary, args, **kw):
    return subprocess.run([binary] + args, capture_output=True, text=True, **kw)


def latest(run_dir):
    """The checkpoint the run directory's `latest` names."""
    with open(os.path.join(run_dir, "latest")) as f:
        return os.path.join(run_dir, f.read().strip())


def step_of(run_dir):
    with open(os.path.join(latest(run_dir), "trainer", "manifest.json")) as f:
        return json.load(f)["step"]


def complete(binary, run_dir, scratch):
    """Problems with the latest checkpoint of `run_dir` (empty when it is complete)."""
    if not os.path.isfile(os.path.join(run_dir, "latest")):
        return [f"{run_dir} has no latest"]
    ck = latest(run_dir)
    manifest = os.path.join(ck, "trainer", "manifest.json")
    if not os.path.isfile(manifest):
        return [f"{ck} has no trainer/manifest.json"]
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError) as e:
        return [f"the manifest is unreadable: {e}"]
    problems = [f"{name} is missing" for name in files if not os.path.isfile(os.path.join(ck, name))]
    out = os.path.join(scratch, "export")
    shutil.rmtree(out, ignore_errors=True)
    r = run(binary, ["export", run_dir, out])
    if r.returncode != 0:
        problems.append("export failed: " + r.stderr.strip()[-300:])
    r = run(binary, ["step", "--model", run_dir, "--seq-len", "32", "--cp", "1"])
    if r.returncode != 0:
        problems.append("its weights do not load: " + r.stderr.strip()[-300:])
    return problems


def temporaries(*dirs):
    """A save's temporaries and a removal's hidden leftovers (.checkpoint-N.removed-upipe)."""
    return sorted(n for d in dirs if os.path.isdir(d) for n in os.listdir(d)
                  if ".tmp-" in n or n.endswith(".removed-upipe"))


def saving(run_dir):
    """Is a save in flight (a checkpoint's temporary in the run directory)?"""
    return any(n.endswith(".tmp-upipe") for n in temporaries(run_dir))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", required=True)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", help="scratch directory (default: a temporary one, removed)")
    opts = ap.parse_args()
    binary = os.path.abspath(opts.binary)
    rng = random.Random(opts.seed)
    work = opts.work or tempfile.mkdtemp(prefix="upipe-kill-")
    os.makedirs(work, exist_ok=True)
    model = os.path.join(work, "model")
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    write_weights(model, opts.seed)
    ck = os.path.join(work, "ck")
    shutil.rmtree(ck, ignore_errors=True)
    r = run(binary, TRAIN + ["--model", model, "--steps", "1", "--save", ck])
    if r.returncode != 0:
        sys.exit(f"kill_save: the first checkpoint failed:\n{r.stdout}{r.stderr}")
    # How long a run of a few saving steps takes: kills land anywhere in it.
    steps_per_run = 4
    start = time.monotonic()
    r = run(binary, TRAIN + ["--resume", ck, "--steps", str(1 + steps_per_run), "--save", ck, "--save-every", "1"])
    span = time.monotonic() - start
    if r.returncode != 0:
        sys.exit(f"kill_save: the calibration run failed:\n{r.stdout}{r.stderr}")
    failures, in_save = 0, 0
    for k in range(opts.kills):
        before = step_of(ck)
        args = TRAIN + ["--resume", ck, "--steps", str(before + steps_per_run), "--save", ck, "--save-every", "1",
                        "--keep-last", "1"]
        p = subprocess.Popen([binary] + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.monotonic()
        if k % 2 == 0:  # anywhere in the run
            time.sleep(rng.uniform(0.05, span))
        else:  # aimed: a random moment after a save has begun
            while not saving(ck) and p.poll() is None and time.monotonic() - t0 < span:
                time.sleep(0.001)
            time.sleep(rng.uniform(0, 0.3))
        delay = time.monotonic() - t0
        in_flight = saving(ck)
        p.send_signal(signal.SIGKILL)
        p.wait()
        in_save += in_flight
        problems = complete(binary, ck, work)
        after = step_of(ck) if not problems else None
        if after is not None and after < before:
            problems.append(f"the checkpoint went back from step {before} to {after}")
        left = temporaries(work, ck)
        # The next save finishes, removes what the killed one left, and is complete.
        # With --keep-last 1 a kill may also land in the removal of the previous checkpoint.
        nxt = run(binary, TRAIN + ["--resume", ck, "--steps", str((after or before) + 1), "--save", ck,
                                   "--keep-last", "1"])
        if nxt.returncode != 0:
            problems.append("the next save failed: " + nxt.stderr.strip()[-300:])
        problems += complete(binary, ck, work)
        if temporaries(work, ck):
            problems.append(f"temporaries left after the next save: {temporaries(work, ck)}")
        kept = sorted(n for n in os.listdir(ck) if n.startswith("checkpoint-"))
        if len(kept) != 1:
            problems.append(f"--keep-last 1 left {kept}")
        failures += bool(problems)
        print(f"kill {k + 1:2d}: at {delay:5.2f} s of {span:.2f}, {'in a save' if in_flight else 'between saves'}; "
              f"step {before} -> {after}; left {left or 'nothing'}; next save ok: {nxt.returncode == 0}"
              + ("" if not problems else "\n  FAIL: " + "\n  FAIL: ".join(problems)), flush=True)
    print(f"# {opts.kills} kills, {in_save} inside a save: {opts.kills - failures} left a complete checkpoint and "
          f"no temporary after the next save, {failures} failed")
    if not opts.work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
