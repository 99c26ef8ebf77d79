"""The fuzz corpus's case families (scripts/fuzz/run.py runs them).

A case is a command line over files a setup function writes into the case's own
directory, what the run must end as, and the names a refusal must mention. Case i of a
seed is a pure function of (seed, i), so `run.py --seed S --case I` reproduces it.
"""
import json
import os
import random
import shutil
import stat
import struct

import inputs
from inputs import BAD_FLAG_NUMBERS

# Cheap command lines (each well under a second in a release build) and their flags.
TRAIN_META = ("train --backend meta --steps 2 --stop-after 1 --eval-samples 0 --seq-len 64 --cp 2 "
              "--checkpoint-policy what=input")
TRAIN_CPU = "train --steps 2 --eval-samples 0 --seq-len 32 --cp 2 --checkpoint-policy what=input"
BASES = {
    "train": (TRAIN_META,
              ["--cp", "--seq-len", "--batch", "--steps", "--stop-after", "--head-chunk", "--ring", "--lr",
               "--weight-decay", "--max-grad-norm", "--mlp-tile", "--loss-chunk", "--memory-gib", "--host-memory-gib",
               "--warmup", "--seq-warmup", "--seq-warmup-start", "--seed", "--layers", "--zero", "--save-every",
               "--eval-samples", "--eval-every", "--eval-sequences", "--min-doc-tokens", "--rope-theta",
               "--max-position-embeddings", "--comm-timeout"],
              ["--attention", "--backend", "--checkpoint-policy", "--rope-scaling", "--packing", "--offload", "--comm",
               "--save-dtype", "--max-shard-size", "--model", "--lora", "--attention-dtype"]),
    "train-cpu": (TRAIN_CPU,
                  ["--cp", "--seq-len", "--head-chunk", "--lr", "--weight-decay", "--max-grad-norm", "--mlp-tile",
                   "--loss-chunk", "--memory-gib", "--seed", "--rope-theta", "--eval-samples", "--warmup"],
                  ["--attention", "--checkpoint-policy", "--rope-scaling", "--offload"]),
    "step": ("step --seq-len 32 --cp 2",
             ["--cp", "--seq-len", "--head-chunk", "--ring", "--mlp-tile", "--loss-chunk", "--seed", "--memory-gib",
              "--host-memory-gib", "--layers", "--rope-theta", "--max-position-embeddings"],
             ["--attention", "--backend", "--checkpoint-policy", "--model", "--rope-scaling", "--lora",
              "--attention-dtype"]),
    "step-meta": ("step --backend meta --model llama3-8b --seq-len 64K --cp 8",
                  ["--cp", "--seq-len", "--head-chunk", "--ring", "--mlp-tile", "--loss-chunk", "--memory-gib",
                   "--layers"],
                  ["--attention", "--checkpoint-policy"]),
    "plan": ("plan --model tiny-llama --gpus 2 --gpu-memory 2GiB --host-memory 2GiB",
             ["--gpus", "--gpus-per-node", "--nodes", "--seq-len", "--zero", "--margin", "--layers", "--mlp-tile",
              "--loss-chunk"],
             ["--gpu-memory", "--host-memory", "--attention", "--optimizer", "--offload", "--checkpoint-policy",
              "--model"]),
    "bench-attention": ("bench-attention --backend meta --strategy upipe --seq-len 64",
                        ["--cp", "--heads", "--kv-heads", "--head-dim", "--model-dim", "--head-chunk", "--ring",
                         "--seq-len", "--seed", "--memory-gib", "--rope-theta"],
                        ["--strategy", "--backend", "--attention-dtype"]),
    "bench-attention-cpu": ("bench-attention --strategy upipe,ring --seq-len 32 --cp 2 --heads 4 --kv-heads 2",
                            ["--cp", "--heads", "--kv-heads", "--head-dim", "--model-dim", "--head-chunk", "--seq-len",
                             "--rope-theta"],
                            ["--strategy"]),
    "bench": ("bench --layers 1 --seq-len 64 --repeats 1 --attention upipe --cp 2",
              ["--layers", "--cp", "--emulate-cp", "--head-chunk", "--seq-len", "--zero", "--mlp-tile", "--loss-chunk",
               "--repeats", "--single-pass-from", "--warmup-seq-len", "--memory-gib", "--host-memory-gib",
               "--peak-tflops", "--seed"],
              ["--attention", "--optimizer", "--checkpoint-policy", "--backend"]),
    "bench-comm": ("bench-comm --cp 2 --seq-len 64 --repeats 1",
                   ["--cp", "--head-chunk", "--seq-len", "--repeats", "--memory-gib"], ["--backend"]),
    "eval-niah": ("eval --niah --model tiny-llama --lengths 64 --samples 1 --cp 1",
                  ["--lengths", "--samples", "--depths", "--mlp-tile", "--loss-chunk", "--memory-gib", "--seed", "--cp",
                   "--head-chunk"],
                  ["--niah-vocab", "--attention", "--backend"]),
    "model-config": ("model-config --model tiny-llama", ["--layers"], ["--model"]),
}
BAD_STRINGS = ["", " ", "x", "none", "auto", "all", "meta", "cpu", "cuda", "upipe,ring", "ulysses", "hybrid",
               "what=input,every=0", "every=-1", "every=2147483648", "where=", "what=input+attention,every=99999",
               "type=yarn,factor=nan", "type=yarn,factor=0", "type=llama3,factor=8,low_freq_factor=4,high_freq_factor=1",
               "type=linear,factor=1e308", "type=yarn", "factor=4", "type=yarn,original_max_position_embeddings=-1",
               "type=yarn,factor=4,beta_fast=0", "optimizer,params", "80GiB", "0GiB", "-1GiB", "1e300GiB", "nanGiB",
               "1.9TiB", "5GB", "0", "1B", "tiny-qwen3", "llama3-70b", "a" * 300, "\u00e9", "x\ny"]


# Flags of comma-separated key=value items: each key's names (the first is the one messages
# use) and values that break parsers. A key given twice, under any name, must be refused.
KEY_VALUE_FLAGS = {
    "--lora": {("r", "rank"): ["4", "0x4", "4.9", "-4", "4294967300", "1e3", ""],
               ("alpha", "lora_alpha"): ["8", "1e30", "0", "nan", "0x10", "-1"],
               ("dropout", "lora_dropout"): ["0", "0.1", "x"],
               ("targets", "target_modules"): ["q,v", "", "q,q", "all", "qkv_proj", "lm_head"]},
    "--rope-scaling": {("type", "rope_type"): ["yarn", "llama3", "linear", "default", "", "none"],
                       ("factor",): ["4", "0", "-1", "1e300", "0x4"],
                       ("original_max_position_embeddings",): ["32", "4.9", "99999999999999999999", "-1", "0"],
                       ("beta_fast",): ["32", "nan"], ("truncate",): ["true", "yes"]},
    "--checkpoint-policy": {("what",): ["input", "input+attention", "x"], ("every",): ["1", "0", "2147483648", "0x2"],
                            ("where",): ["device", "host-pinned", "disk"]},
}


def key_value_text(rng, flag):
    """A random value of a key=value flag, and whether it names a key twice (then refused)."""
    keys = KEY_VALUE_FLAGS[flag]
    items, seen, twice = [], set(), False
    for _ in range(rng.choice([1, 2, 2, 3])):
        names = rng.choice(sorted(keys))
        twice |= names in seen
        seen.add(names)
        items.append(f"{rng.choice(names)}={rng.choice(keys[names])}")
    if flag == "--lora" and ("r", "rank") not in seen and rng.random() < 0.7:
        items.insert(0, "r=4")
    return ",".join(items), twice


class Case:
    """One run: `args` may hold {w} (the case directory) and {t} (the shared templates)."""

    def __init__(self, family, what, args, setup=None, expect="handled", names=(), check=None, timeout=60,
                 protect=()):
        self.family, self.what, self.args = family, what, args
        self.setup = setup or (lambda w: None)
        self.expect, self.names, self.check, self.timeout = expect, list(names), check, timeout
        self.protect = list(protect)  # paths in the case directory a failed run must leave as they were


def words(text):
    return text.split()


# ---------------------------------------------------------------------------------------
# Flags

# Values a user may give that ask for days of work rather than break anything: a million
# sequences or repeats, a million tokens through the cpu backend's attention. The corpus
# leaves them out (a run past the time limit counts as a hang); the limits refuse larger ones.
WORK_FLAGS = {"--samples", "--eval-samples", "--eval-sequences", "--repeats", "--batch", "--steps", "--stop-after",
              "--save-every", "--eval-every", "--warmup", "--seq-warmup"}
LENGTH_FLAGS = {"--seq-len", "--lengths", "--warmup-seq-len", "--seq-warmup-start", "--single-pass-from"}


# How a message may name a flag's value: by the symbol the rule is written in.
FLAG_SYMBOLS = {"--seq-len": ["sequence length", "S ="], "--lengths": ["sequence length", "S =", "length"],
                "--cp": ["C =", "cp C"], "--gpus": ["C =", "GPUs"], "--head-chunk": ["U =", "head chunk"],
                "--heads": ["H ="], "--kv-heads": ["K ="], "--head-dim": ["d ="], "--model-dim": ["D ="],
                "--layers": ["layers"], "--ring": ["R ="]}


def merely_long(base, flag, value):
    on_cpu = "meta" not in BASES[base][0]
    return value == "1M" and (flag in WORK_FLAGS or (on_cpu and flag in LENGTH_FLAGS))


def flag_case(rng, t):
    base = rng.choice(sorted(BASES))
    line, numeric, strings = BASES[base]
    args = words(line)
    picked, twice = [], {}  # twice: a key=value flag's last value names a key twice
    for _ in range(rng.choice([1, 1, 1, 2])):
        if strings and rng.random() < 0.3:
            flag, value = rng.choice(strings), rng.choice(BAD_STRINGS)
            twice[flag] = False
            if flag in KEY_VALUE_FLAGS and rng.random() < 0.6:
                value, twice[flag] = key_value_text(rng, flag)
        else:
            flag, value = rng.choice(numeric), rng.choice(BAD_FLAG_NUMBERS)
            while merely_long(base, flag, value):
                value = rng.choice(BAD_FLAG_NUMBERS)
        aliases = {"--lengths": "--seq-len", "--seq-len": "--lengths"}
        same = [i for i, a in enumerate(args) if a in (flag, aliases.get(flag))]
        if same:
            args[same[0] + 1] = value
        else:
            args += [flag, value]
        picked.append((flag, value))
    names = [f for f, _ in picked] + [v for _, v in picked if v.strip()]
    # A refusal may name the flag as its message's words ("head chunk U = 3") or the value
    # as read ("+007" is 7).
    names += [f.lstrip("-").replace("-", " ") for f, _ in picked] + [f.lstrip("-").replace("-", "_") for f, _ in picked]
    names += [v.lstrip("+0") or "0" for _, v in picked if v.lstrip("+").isdigit()]
    names += [alias for f, _ in picked for alias in FLAG_SYMBOLS.get(f, [])]
    names += [str(int(v[:-1]) << {"K": 10, "M": 20}[v[-1]]) for _, v in picked if v[-1:] in ("K", "M") and v[:-1].isdigit()]
    names += [part.split("=")[0] for _, v in picked for part in v.split(",") if "=" in part]
    expect = "refuse" if any(twice.values()) else "handled"
    return Case("flags", f"{base}: " + " ".join(f"{f} {v!r}" for f, v in picked), args, expect=expect, names=names)


# ---------------------------------------------------------------------------------------
# Model files: config.json, safetensors, model directories and their indexes

def config_case(rng, t):
    config = json.load(open(os.path.join(t["hf"], "llama-yarn-shards", "config.json")))
    what, text, names = inputs.mutate_config(rng, config)

    def setup(w):
        with open(os.path.join(w, "config.json"), "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(text)
    command = rng.choice(["step --backend meta --seq-len 64 --cp 2 --config {w}/config.json",
                          "plan --gpus 2 --gpu-memory 2GiB --host-memory 2GiB --config {w}",
                          TRAIN_META + " --config {w}/config.json",
                          "model-config --config {w}/config.json"])
    return Case("config", what, words(command), setup, names=names + ["config.json"])


def safetensors_case(rng, t):
    source = rng.choice(["tiny-llama", "hf/qwen3-tied", "hf/llama-fp16-linear"])
    header, data = inputs.read_safetensors(os.path.join(t["golden"], source, "model.safetensors"))
    what, blob, names = inputs.mutate_safetensors(rng, header, data)
    config = os.path.join(t["golden"], source, "config.json")

    def setup(w):
        inputs.write_bytes(os.path.join(w, "model", "model.safetensors"), blob)
        shutil.copy(config, os.path.join(w, "model", "config.json"))
    command = rng.choice(["step --seq-len 16 --cp 1 --model {w}/model",
                          "step --seq-len 16 --cp 2 --config {w}/model --weights {w}/model/model.safetensors",
                          TRAIN_CPU + " --model {w}/model --stop-after 1",
                          "eval --niah --lengths 64 --samples 1 --cp 1 --model {w}/model"])
    return Case("safetensors", f"{source}: {what}", words(command), setup,
                names=names + ["model.safetensors"])


def hf_dir_case(rng, t):
    template = os.path.join(t["hf"], "llama-yarn-shards")
    index = json.load(open(os.path.join(template, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    tensor = rng.choice(sorted(index["weight_map"]))
    kind = rng.choice(["map", "map", "index", "shard", "shard_header", "missing_config", "extra"])
    special = None
    what = kind
    if kind == "map":
        v = rng.choice(["../model-00001-of-00003.safetensors", "/etc/passwd", "", ".", "..", "missing.safetensors",
                        "config.json", 7, None, "model-00001-of-00003.safetensors", "a/b.safetensors",
                        "tokenizer.json", "x" * 300])
        index["weight_map"][tensor] = v
        what = f"weight_map[{tensor}] = {str(v)[:40]}"
    elif kind == "index":
        index = rng.choice([[], {}, {"weight_map": []}, {"weight_map": None}, {"metadata": {}},
                            {"weight_map": {}}, "x"])
        what = f"index = {str(index)[:40]}"
    elif kind == "shard":
        special = (rng.choice(shards), rng.choice(["fifo", "dir", "loop", "empty", "dangling"]))
        what = f"{special[0]} is a {special[1]}"
    elif kind == "shard_header":
        shard = rng.choice(shards)
        header, data = inputs.read_safetensors(os.path.join(template, shard))
        sub, blob, _ = inputs.mutate_safetensors(rng, header, data)
        special = (shard, blob)
        what = f"{shard}: {sub}"
    elif kind == "extra":
        index["weight_map"]["model.layers.99.mlp.up_proj.weight"] = shards[0]
        what = "index names a tensor no shard holds"

    def setup(w):
        d = os.path.join(w, "model")
        shutil.copytree(template, d)
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
        if kind == "missing_config":
            os.remove(os.path.join(d, "config.json"))
        if special and isinstance(special[1], bytes):
            inputs.write_bytes(os.path.join(d, special[0]), special[1])
        elif special:
            make_special(os.path.join(d, special[0]), special[1])
    command = rng.choice(["step --seq-len 16 --cp 2 --model {w}/model", TRAIN_CPU + " --init {w}/model --stop-after 1",
                          "step --seq-len 16 --cp 1 --config {w}/model --weights {w}/model/model.safetensors.index.json",
                          "eval --niah --niah-vocab passkey --lengths 64 --samples 1 --cp 1 --model {w}/model"])
    return Case("hf_dir", what, words(command), setup, names=["model", "index", "safetensors", "config"])


def make_special(path, kind, target=None):
    """Replaces `path` by a FIFO, a directory, a symlink loop, an empty file, a dangling link
    or a character device (the null or the full device, made here so that nothing real is
    touched)."""
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        os.mkdir(path)
    elif kind == "loop":
        os.symlink(os.path.basename(path) + ".b", path)
        os.symlink(os.path.basename(path), path + ".b")
    elif kind == "empty":
        open(path, "wb").close()
    elif kind == "dangling":
        os.symlink("nowhere/at/all", path)
    elif kind == "link":
        os.symlink(target, path)
    elif kind in ("full_device", "null_device"):
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 7 if kind == "full_device" else 3))
    else:
        raise ValueError(kind)


# ---------------------------------------------------------------------------------------
# Token files and corpora

def tokens_case(rng, t):
    what, blob, names = inputs.mutate_tokens(rng, 256)
    seq = rng.choice(["32", "64", "512", "1024M", "2"])

    def setup(w):
        inputs.write_bytes(os.path.join(w, "tokens.bin"), blob)
    command = rng.choice([TRAIN_CPU.replace("--seq-len 32", "--seq-len " + seq) + " --data {w}/tokens.bin",
                          TRAIN_META.replace("--seq-len 64", "--seq-len " + seq) + " --data {w}/tokens.bin",
                          f"step --seq-len {seq} --cp 2 --tokens {{w}}/tokens.bin",
                          f"eval --model tiny-llama --data {{w}}/tokens.bin --seq-len {seq} --samples 1 --cp 1",
                          TRAIN_META + " --eval-every 1 --eval-data {w}/tokens.bin"])
    length = {"1024M": "1073741824"}.get(seq, seq)
    return Case("tokens", f"{what}, S {seq}", words(command), setup, names=names + ["tokens.bin", seq, length])


def corpus_case(rng, t):
    files = inputs.corpus_files(rng, 256, masked=rng.random() < 0.4)
    what, files, names = inputs.mutate_corpus(rng, files)

    def setup(w):
        for suffix, blob in files.items():
            inputs.write_bytes(os.path.join(w, "corpus" + suffix), blob)
    command = rng.choice([TRAIN_CPU + " --data {w}/corpus", TRAIN_META + " --data {w}/corpus --packing documents",
                          "eval --model tiny-llama --data {w}/corpus --seq-len 32 --samples 2 --cp 1",
                          TRAIN_CPU + " --data {w}/corpus.tokens --min-doc-tokens 5",
                          TRAIN_META + " --eval-every 1 --eval-data {w}/corpus"])
    return Case("corpus", what, words(command), setup, names=names + ["corpus"])


# ---------------------------------------------------------------------------------------
# Chat rows for prepare-data: one bad row among good ones. Refused naming its line, or with
# --bad-rows skip left out and counted (exit 0).

CHAT_GOOD = [{"messages": [{"role": "user", "content": "Name a fox."}, {"role": "assistant", "content": "A fox."}]},
             {"prompt": "def add(a, b):", "completion": " return a + b"},
             {"text": "The dog sleeps."}]
CHAT_BAD = [
    ("no assistant turn", {"messages": [{"role": "user", "content": "hi"}]}, True),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}, False),
    ("role not a string", {"messages": [{"role": 7, "content": "x"}, {"role": "assistant", "content": "y"}]}, False),
    ("content a number", {"messages": [{"role": "user", "content": 1e308}, {"role": "assistant", "content": "y"}]},
     False),
    ("messages not a list", {"messages": {"role": "user"}}, False),
    ("no messages", {"messages": []}, False),
    ("message not an object", {"messages": ["hi", {"role": "assistant", "content": "y"}]}, False),
    ("pair of mixed types", {"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}, False),
    ("tools not a list", {"tools": "add", "messages": CHAT_GOOD[0]["messages"]}, False),
    ("kwargs not an object", {"chat_template_kwargs": [1], "messages": CHAT_GOOD[0]["messages"]}, False),
    ("template raises", {"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "late"},
                                      {"role": "assistant", "content": "y"}]}, False),
    ("deep content", {"messages": [{"role": "user", "content": [[[[[["x"]]]]]]},
                                   {"role": "assistant", "content": "y"}]}, False),
]


def chat_case(rng, t):
    what, bad, fine_with_all = rng.choice(CHAT_BAD)
    rows = [rng.choice(CHAT_GOOD) for _ in range(rng.randrange(1, 6))]
    line = rng.randrange(len(rows) + 1)
    rows.insert(line, bad)
    mode = rng.choice(["error", "error", "skip", "all"])

    def setup(w):
        with open(os.path.join(w, "c.jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    flags = {"error": "", "skip": " --bad-rows skip", "all": " --loss-mask all"}[mode]
    model = os.path.join(t["hf"], "llama-chat")
    template = f" --chat-template {model}/templates/headers.jinja" if what == "template raises" else ""
    command = f"prepare-data --tokenizer {model} --out {{w}}/o --workers 1" + flags + template + " {w}/c.jsonl"
    expect = "handled" if mode == "skip" or (mode == "all" and fine_with_all) else "refuse"
    return Case("chat", f"{what}, {mode}", words(command), setup, expect=expect, names=[f"c.jsonl:{line + 1}"],
                timeout=120)
