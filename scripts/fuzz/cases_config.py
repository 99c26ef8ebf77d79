"""Fuzz cases for the run configuration (issue #30): `--config-file` TOML files mutated, and a
checkpoint's stored trainer/run.toml damaged before `train --resume` reads it. Each run must
end as a success or a refusal naming the file or the key, with nothing already saved lost."""
import os
import random

from cases import Case, make_special, words

# The base configuration every mutation starts from: a short, valid run.
BASE = """[data]
seq_len = 32

[parallel]
cp = 2

[optimizer]
steps = 2
lr = 0.001

[eval]
samples = 0

[system]
checkpoint_policy = "what=input"
"""

# Every run stops after one step, whatever the file asks for (a flag overrides the file).
CONFIGURED = "train --stop-after 1 --eval-samples 0"

KEYS = ["optimizer.lr", "optimizer.steps", "parallel.cp", "data.seq_len", "data.batch", "model.model",
        "checkpoint.keep_last", "system.memory_gib", "parallel.attention", "data.packing"]
VALUES = ["-1", "0", "1e400", "99999999999999999999", "nan", "inf", "'x'", "''", "true", "[1, 2]", "{a = 1}",
          "1979-05-27T07:32:00Z", "0x10", "0o7", "1_000", "-0.0", "'../../etc/passwd'", "'" + "a" * 5000 + "'"]


def mutate(rng, text):
    """One mutation of a TOML text, and the words a refusal should name."""
    kind = rng.choice(["value", "unknown_key", "typo_key", "truncate", "garbage", "duplicate", "nested", "deep",
                       "empty", "section_value", "unicode"])
    if kind == "value":
        key = rng.choice(KEYS)
        section, name = key.split(".")
        return text + f"\n[{section}]\n{name} = {rng.choice(VALUES)}\n", [name, section], kind
    if kind == "unknown_key":
        return text + "\n[optimizer]\nbetas = 0.9\n", ["betas"], kind
    if kind == "typo_key":
        return text.replace("lr =", "lrr ="), ["lrr"], kind
    if kind == "truncate":
        return text[:rng.randrange(1, len(text))], ["run.toml"], kind
    if kind == "garbage":
        data = bytearray(text.encode())
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return data.decode("latin-1"), ["run.toml"], kind
    if kind == "duplicate":
        return text + "\n[optimizer]\nlr = 0.5\n", ["run.toml"], kind
    if kind == "nested":
        return text + "\n[optimizer.inner]\nlr = 1\n", ["optimizer.inner"], kind
    if kind == "deep":
        return "a = " + "[" * 5000 + "]" * 5000 + "\n", ["run.toml"], kind
    if kind == "empty":
        return "", [], kind
    if kind == "section_value":
        return "optimizer = 3\n", ["optimizer"], kind
    return text + "\n[data]\nseq_len = '\u00e9\u00e9'\n", ["seq_len"], kind


def run_config_case(rng, t):
    """--config-file mutated (or not a regular file), or a checkpoint's run.toml damaged."""
    where = rng.choice(["file", "file", "file", "special", "stored"])
    if where == "special":
        kind = rng.choice(["fifo", "dir", "loop", "dangling", "empty"])

        def setup(w):
            make_special(os.path.join(w, "run.toml"), kind)
        return Case("run_config", f"--config-file as {kind}", words(CONFIGURED + " --config-file {w}/run.toml"),
                    setup, names=["run.toml"])
    text, names, kind = mutate(rng, BASE)
    if where == "file":
        def setup(w):
            with open(os.path.join(w, "run.toml"), "w", encoding="latin-1", errors="replace") as f:
                f.write(text)
        return Case("run_config", f"--config-file mutated: {kind}",
                    words(CONFIGURED + " --config-file {w}/run.toml"), setup, names=names + ["run.toml"])

    from cases_runs import copy_checkpoint  # the shared template checkpoint

    def setup_stored(w):
        copy_checkpoint(t, w)
        path = os.path.join(w, "ck", "trainer", "run.toml")
        with open(path, "w", encoding="latin-1", errors="replace") as f:
            f.write(text)
    save = rng.choice(["", " --save {w}/ck"])
    return Case("run_config", f"a checkpoint's run.toml damaged: {kind}",
                words("train --resume {w}/ck --steps 4 --stop-after 3" + save), setup_stored,
                names=names + ["run.toml", "ck"],
                protect=["ck"])
