"""Fuzz case families over runs that keep state: trainer states and resumes, input paths
that are not what they claim, output paths (checkpoints, JSON, safetensors) that must
never be replaced, report inputs; and the registry of every family (the fixed regression
cases are in regressions.py)."""
import json
import os
import random
import shutil
import stat

import inputs
from cases_config import run_config_case  # noqa: E402
from cases import (TRAIN_CPU, TRAIN_META, Case, chat_case, config_case, corpus_case, flag_case,
                   hf_dir_case,
                   make_special, safetensors_case, tokens_case, words)
from cases_tools import adapter_case, model_dir_member_case, prepare_case
from regressions import RESUME, regression_case, regression_cases

MANIFEST_FIELDS = ["step", "data_position", "seed", "total_steps", "data", "data_bytes", "packing", "min_doc_tokens",
                   "ranks", "zero", "strategy", "head_chunk", "seq_len", "model_dtype", "units", "files", "format",
                   "version"]


def copy_checkpoint(t, w, name="checkpoint"):
    shutil.copytree(os.path.join(t["root"], name), os.path.join(w, "ck"), symlinks=True)


def trainer_state_case(rng, t):
    data_run = rng.random() < 0.3
    template = "checkpoint_data" if data_run else "checkpoint"
    manifest = json.load(open(os.path.join(t["root"], template, "trainer", "manifest.json")))
    kind = rng.choice(["manifest", "manifest", "manifest", "shard", "shard_special", "config", "weights",
                       "contradict"])
    extra, expect, names, mutate = "", "handled", ["ck"], None
    poisoned_moment = False
    if kind == "manifest":
        key = rng.choice(MANIFEST_FIELDS)
        value = rng.choice(inputs.BAD_JSON_VALUES + ["passkey", "documents", "stream", "3", "ring"])
        manifest[key] = value
        what = f"manifest {key} = {str(value)[:30]}"
        names += [key, "manifest"]
        if key == "step" and isinstance(value, int) and value < 0:
            expect = "refuse"

        def mutate(ck):
            with open(os.path.join(ck, "trainer", "manifest.json"), "w") as f:
                json.dump(manifest, f)
    elif kind in ("shard", "weights"):
        file = (os.path.join("trainer", f"rank-{rng.randrange(2):05d}-of-00002.safetensors") if kind == "shard"
                else "model.safetensors")
        header, data = inputs.read_safetensors(os.path.join(t["root"], template, file))
        if rng.random() < 0.5:
            what, data = inputs.poison_value(rng, header, data)
            blob = inputs.safetensors_bytes(header, data)
            # A resume reads the fp32 master and the moments from the trainer state; export
            # reads the master alone; the bf16 model file is neither's (docs/reliability.md).
            expect = "refuse" if kind == "shard" and "master" in what else "handled"
            poisoned_moment = kind == "shard" and "master" not in what
            names += [what.split(" in ")[-1].split("[")[0], os.path.basename(file)]
        else:
            what, blob, more = inputs.mutate_safetensors(rng, header, data)
            names += more + [os.path.basename(file)]
        what = f"{file}: {what}"

        def mutate(ck):
            inputs.write_bytes(os.path.join(ck, file), blob)
    elif kind == "shard_special":
        file = os.path.join("trainer", "rank-00001-of-00002.safetensors")
        special = rng.choice(["fifo", "dir", "loop", "empty", "dangling"])
        what, expect = f"{file} is a {special}", "refuse"
        names += ["rank-00001-of-00002"]

        def mutate(ck):
            make_special(os.path.join(ck, file), special)
    elif kind == "config":
        config = json.load(open(os.path.join(t["root"], template, "config.json")))
        what, text, more = inputs.mutate_config(rng, config)
        names += more + ["config.json"]

        def mutate(ck):
            with open(os.path.join(ck, "config.json"), "w", encoding="utf-8", errors="surrogatepass") as f:
                f.write(text)
    else:
        extra = rng.choice(["--seed 2", "--steps 1", "--steps 2", "--stop-after 2", "--data {w}/ck/config.json",
                            "--model tiny-qwen3", "--layers 1", "--packing stream", "--min-doc-tokens 7",
                            "--rope-theta 20000", "--zero 3", "--cp 4", "--cp 1", "--attention ring", "--init {w}/ck"])
        what = f"resume with {extra}"
        if extra in ("--seed 2", "--steps 1", "--steps 2", "--model tiny-qwen3", "--layers 1", "--init {w}/ck") or \
                (data_run and extra in ("--packing stream", "--min-doc-tokens 7")):
            expect = "refuse"
        names += extra.replace("{w}/", "").split()
    data = " --data " + t["corpus"] if data_run and "--data" not in extra else ""
    save = rng.choice(["", "", " --save {w}/ck", " --save {w}/other"])
    command = RESUME + " --cp " + rng.choice(["1", "2", "4"]) + data + " " + extra + save
    if kind != "contradict" and rng.random() < 0.15:
        command = "export {w}/ck {w}/exported"
    elif poisoned_moment:
        expect = "refuse"  # a resume reads the moments

    def setup(w):
        copy_checkpoint(t, w, template)
        if mutate:
            mutate(os.path.join(w, "ck"))
    return Case("trainer_state", f"{template}: {what}", words(command), setup, expect=expect, names=names,
                protect=["ck"] if "--save {w}/ck" in command else [])


# ---------------------------------------------------------------------------------------
# Input paths that are not what the flag expects

PATH_FLAGS = [  # (command, flag, wants: "file" or "dir" or "either")
    ("step --seq-len 32 --cp 1", "--config", "file"), ("step --seq-len 32 --cp 1", "--model", "dir"),
    ("step --seq-len 32 --cp 1", "--weights", "either"), ("step --seq-len 32 --cp 1", "--tokens", "file"),
    (TRAIN_CPU, "--init", "either"), (TRAIN_CPU, "--data", "file"), (TRAIN_CPU, "--resume", "dir"),
    (TRAIN_META + " --eval-every 1", "--eval-data", "file"), ("plan --gpus 2 --gpu-memory 2GiB", "--config", "file"),
    ("eval --model tiny-llama --seq-len 32 --samples 1 --cp 1", "--data", "file"),
    ("eval --niah --lengths 64 --samples 1 --cp 1", "--model", "dir"), ("export", "", "dir"),
    (TRAIN_CPU + " --stop-after 1", "--init-adapter", "dir"), ("step --seq-len 32 --cp 1", "--adapter", "dir"),
    ("eval --seq-len 32 --samples 1 --cp 1 --data {t}/corpus", "--config", "file"),
    ("report --out {w}/plots", "@", "file"),
]
PATH_KINDS = ["fifo", "dir", "loop", "empty", "dangling", "missing", "long", "file_as_dir", "null_device", "blank"]


def input_path_case(rng, t):
    command, flag, wants = rng.choice(PATH_FLAGS)
    kind = rng.choice(PATH_KINDS)
    if kind == "dir" and wants == "dir":
        kind = "file_as_dir"
    if kind == "null_device" and not t["can_mknod"]:
        kind = "fifo"
    name = {"long": "n" * 300, "blank": ""}.get(kind, "input")
    path = "" if kind == "blank" else "{w}/" + name
    if kind == "file_as_dir":
        path = "{w}/input/"

    def setup(w):
        target = os.path.join(w, "input")
        if kind == "file_as_dir":
            open(target, "w").write("{}")
        elif kind in ("fifo", "dir", "loop", "empty", "dangling"):
            make_special(target, kind)
        elif kind == "null_device":
            make_special(target, "null_device")
    # flag "": export's CHECKPOINT OUT; "@": the path alone, last (report's inputs)
    args = words(command) + ([path] if flag == "@" else [flag, path] if flag else [path, "{w}/out"])
    return Case("input_paths", f"{command.split()[0]} {flag or 'CHECKPOINT'} as {kind}", args, setup, expect="refuse",
                names=[name, flag, "empty", "''"] if name else [flag, "empty"], timeout=30)


# ---------------------------------------------------------------------------------------
# Output paths: a save or a result written through whatever the path is, never replacing it

OUTPUTS = [  # (command, flag, kind of output)
    (TRAIN_CPU + " --stop-after 1", "--save", "dir"), (TRAIN_META, "--metrics-json", "file"),
    ("step --seq-len 32 --cp 2", "--json", "file"), ("step --seq-len 32 --cp 2", "--save-grads", "file"),
    ("plan --model tiny-llama --gpus 2 --gpu-memory 2GiB --host-memory 2GiB", "--json", "file"),
    ("bench-attention --backend meta --strategy upipe --seq-len 64", "--json", "file"),
    ("bench-attention --strategy upipe --seq-len 32 --cp 2 --heads 4 --kv-heads 2", "--dump", "dir"),
    ("eval --niah --model tiny-llama --lengths 64 --samples 1 --cp 1", "--json", "file"),
    ("model-config --model tiny-llama", "--out", "file"), ("export {t}/checkpoint", "", "dir"),
]
OUTPUT_KINDS = ["link_to_file", "link_to_dir", "dangling", "full_device", "null_device", "fifo", "dir", "file",
                "trailing_slash", "stale", "no_parent", "foreign_dir", "checkpoint", "long"]


def node_kind(path):
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "missing"
    for test, name in [(stat.S_ISLNK, "link"), (stat.S_ISCHR, "chardev"), (stat.S_ISFIFO, "fifo"),
                       (stat.S_ISDIR, "dir"), (stat.S_ISREG, "file")]:
        if test(mode):
            return name
    return "other"


def output_case(rng, t):
    command, flag, output = rng.choice(OUTPUTS)
    kind = rng.choice(OUTPUT_KINDS)
    if kind in ("full_device", "null_device") and not t["can_mknod"]:
        kind = "fifo"
    name = "n" * 300 if kind == "long" else "out"
    path = "{w}/" + ("missing/" if kind == "no_parent" else "") + name + ("/" if kind == "trailing_slash" else "")

    def setup(w):
        p = os.path.join(w, name)
        if kind == "link_to_file":
            open(os.path.join(w, "real"), "w").write("user data\n")
            make_special(p, "link", "real")
        elif kind == "link_to_dir":
            os.mkdir(os.path.join(w, "real"))
            make_special(p, "link", "real")
        elif kind in ("dangling", "full_device", "null_device", "fifo", "dir"):
            make_special(p, kind)
        elif kind == "file":
            open(p, "w").write("user data\n")
        elif kind == "stale":  # what a killed save (a directory) or write (a file) leaves
            if flag == "--save":  # a run directory: a checkpoint's and a pointer's temporaries inside
                os.makedirs(os.path.join(p, "checkpoint-1.tmp-upipe", "trainer"))
                open(os.path.join(p, "latest.tmp-999999999"), "w").write("left by a killed write\n")
            elif output == "dir":
                os.makedirs(p + ".tmp-upipe/trainer")
            if flag != "--save":
                open(p + ".tmp-999999999", "w").write("left by a killed write\n")
        elif kind == "foreign_dir":
            os.mkdir(p)
            open(os.path.join(p, "notes.txt"), "w").write("user data\n")
        elif kind == "checkpoint":
            shutil.copytree(os.path.join(t["root"], "checkpoint"), p)

    before = {"link_to_file": "link", "link_to_dir": "link", "dangling": "link", "full_device": "chardev",
              "null_device": "chardev", "fifo": "fifo", "dir": "dir", "file": "file", "foreign_dir": "dir",
              "checkpoint": "dir"}.get(kind)

    def check(w, result):
        problems = []
        p = os.path.join(w, name)
        if before and node_kind(p) != before:
            problems.append(f"{kind}: the path is now a {node_kind(p)}, was a {before}")
        if kind == "link_to_file" and result.code != 0 and open(os.path.join(w, "real")).read() != "user data\n":
            problems.append("the file behind the link changed in a refused run")
        if kind in ("file", "foreign_dir") and result.code != 0:
            target = p if kind == "file" else os.path.join(p, "notes.txt")
            if not os.path.isfile(target) or open(target).read() != "user data\n":
                problems.append("a refused run changed the user's file")
        if kind == "foreign_dir" and os.path.isfile(os.path.join(p, "notes.txt")) is False:
            problems.append("the user's file is gone")
        if kind == "stale" and result.code == 0 and flag != "--dump":  # a dump writes no temporaries
            left = [n for d in (w, p) if os.path.isdir(d) for n in os.listdir(d) if ".tmp-" in n]
            if left:
                problems.append(f"stale temporaries left after a successful save: {left}")
        return problems
    args = words(command.replace("{t}", t["root"])) + ([flag, path] if flag else [path])
    return Case("output_paths", f"{command.split()[0]} {flag or 'OUT'} as {kind}", args, setup,
                names=[name, flag or "export", "out"], check=check, timeout=60)


# ---------------------------------------------------------------------------------------
# report: the JSON of bench, bench-attention, plan and eval, mutated

def mutate_json(rng, value, depth=0):
    if isinstance(value, list) and value and depth < 6:
        i = rng.randrange(len(value))
        value[i] = mutate_json(rng, value[i], depth + 1)
        return value
    if isinstance(value, dict) and value and depth < 6:
        key = rng.choice(sorted(value))
        r = rng.random()
        if r < 0.25:
            del value[key]
        elif r < 0.6:
            value[key] = rng.choice(inputs.BAD_JSON_VALUES)
        else:
            value[key] = mutate_json(rng, value[key], depth + 1)
        return value
    return rng.choice(inputs.BAD_JSON_VALUES)


def report_case(rng, t):
    source = rng.choice(sorted(t["reports"]))
    text = open(t["reports"][source]).read()
    r = rng.random()
    if r < 0.15:
        mutated = rng.choice(["", "{", "[]", "null", "1", text[: len(text) // 2], "NaN", "garbage",
                              inputs.nested(100000, ""), "\ufeff" + text])
        what = f"whole file {mutated[:20]!r}"
    else:
        value = mutate_json(rng, json.loads(text))
        mutated, what = json.dumps(value), "a field"

    def setup(w):
        open(os.path.join(w, source + ".json"), "w").write(mutated)
    return Case("report", f"{source}: {what}", ["report", "--out", "{w}/plots", "{w}/" + source + ".json"], setup,
                names=[source, "report"], timeout=90)


FAMILIES = [("flags", 30, flag_case), ("config", 12, config_case), ("safetensors", 12, safetensors_case),
            ("hf_dir", 7, hf_dir_case), ("tokens", 7, tokens_case), ("corpus", 6, corpus_case),
            ("trainer_state", 10, trainer_state_case), ("input_paths", 6, input_path_case),
            ("output_paths", 7, output_case), ("report", 3, report_case), ("run_config", 5, run_config_case),
            ("chat", 3, chat_case), ("adapters", 5, adapter_case), ("model_dir", 4, model_dir_member_case),
            ("prepare_data", 3, prepare_case)]


def make_case(seed, index, t, families=None):
    """Case `index` of the corpus of `seed`: the regression cases first, then random families."""
    count = len(regression_cases())
    if index < count:
        return regression_case(index, t)
    rng = random.Random(f"{seed}:{index}")
    pool = [(name, weight, fn) for name, weight, fn in FAMILIES if not families or name in families]
    total = sum(weight for _, weight, _ in pool)
    pick = rng.uniform(0, total)
    for name, weight, fn in pool:
        pick -= weight
        if pick <= 0:
            return fn(rng, t)
    return pool[-1][2](rng, t)
