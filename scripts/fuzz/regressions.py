"""The fuzz corpus's fixed regression cases: every bug a fuzz found, kept, each a command
over files a setup writes and what the run must end as (scripts/fuzz/run.py runs them
first in every sample)."""
import json
import os
import random
import shutil
import struct

import inputs
from cases import TRAIN_CPU, TRAIN_META, Case, make_special, words
from regressions_inputs import input_fuzz_cases

RESUME = "train --steps 4 --seq-len 32 --eval-samples 0 --checkpoint-policy what=input --resume {w}/ck"
PREPARE = "prepare-data --tokenizer {hf}/llama-yarn-shards --out {w}/out"


def copy_template(t, w, name):
    shutil.copytree(os.path.join(t["root"], name), os.path.join(w, "ck"), symlinks=True)

def edit_manifest(key, value):
    def setup(w, t):
        path = os.path.join(w, "ck", "trainer", "manifest.json")
        m = json.load(open(path))
        m[key] = value
        json.dump(m, open(path, "w"))
    return setup


def poison(file, tensor=None):
    """A NaN as the first element of `tensor` (default: the first by name) in the checkpoint's `file`."""
    def setup(w, t):
        path = os.path.join(w, "ck", file)
        header, data = inputs.read_safetensors(path)
        at = header[tensor or min(inputs.tensor_names(header))]["data_offsets"][0]
        inputs.write_bytes(path, inputs.safetensors_bytes(header, data[:at] + b"\x00\x00\xc0\x7f" + data[at + 4:]))
    return setup


def corpus_with(offsets=None, documents=None):
    """A valid corpus at {w}/corpus, its index offsets or its manifest's document count replaced."""
    def setup(w, t):
        files = inputs.corpus_files(random.Random(5), 256)
        if offsets:
            index = list(struct.unpack(f"<{len(files['.index']) // 8}Q", files[".index"]))
            for i, v in offsets.items():
                index[i] = v
            files[".index"] = struct.pack(f"<{len(index)}Q", *index)
        if documents is not None:  # one token, an index of one offset: (documents + 1) * 8 wraps to 8 bytes
            files = {".tokens": inputs.token_bytes([7]), ".index": struct.pack("<Q", 0),
                     ".json": json.dumps({"format": "upipe-tokens", "version": 1, "dtype": "uint32",
                                          "vocab_size": 256, "documents": documents,
                                          "tokens": 1}).encode()}
        for suffix, blob in files.items():
            inputs.write_bytes(os.path.join(w, "corpus" + suffix), blob)
    return setup


def config_with(**fields):
    def setup(w, t):
        c = json.load(open(os.path.join(t["hf"], "llama-yarn-shards", "config.json")))
        c.update(fields)
        json.dump(c, open(os.path.join(w, "config.json"), "w"))
    return setup


def link_stays(name):
    def check(w, r):
        return [] if os.path.islink(os.path.join(w, name)) else [f"{name} is no longer a symbolic link"]
    return check


def special(path, kind):
    """{w}/PATH (after the template is copied) replaced by a FIFO, a loop, ..."""
    return lambda w, t: make_special(os.path.join(w, path), kind)


def edit_json(path, **fields):
    """{w}/PATH's JSON object with `fields` set."""
    def setup(w, t):
        full = os.path.join(w, path)
        j = json.load(open(full))
        j.update(fields)
        json.dump(j, open(full, "w"))
    return setup


def model_dir(source, then=None):
    """A copy of tests/golden/SOURCE at {w}/m, then `then(dir)`."""
    def setup(w, t):
        d = os.path.join(w, "m")
        shutil.copytree(os.path.join(t["golden"], source), d)
        if then:
            then(d)
    return setup


def extra_tensor(name):
    """A model directory's model.safetensors with one more (F32, two elements) tensor."""
    def add(d):
        path = os.path.join(d, "model.safetensors")
        header, data = inputs.read_safetensors(path)
        header[name] = {"dtype": "F32", "shape": [2], "data_offsets": [len(data), len(data) + 8]}
        inputs.write_bytes(path, inputs.safetensors_bytes(header, data + bytes(8)))
    return add


def rope_type_null(d):
    path = os.path.join(d, "config.json")
    c = json.load(open(path))
    c["rope_parameters"]["rope_type"] = None
    json.dump(c, open(path, "w"))


def swap_shards(w, t):
    trainer = os.path.join(w, "ck", "trainer")
    a, b = (os.path.join(trainer, f"rank-{r:05d}-of-00002.safetensors") for r in (0, 1))
    os.rename(a, a + ".x")
    os.rename(b, a)
    os.rename(a + ".x", b)


def one_token_documents(w, t):
    n = 20
    files = {".tokens": inputs.token_bytes([7] * n), ".index": struct.pack(f"<{n + 1}Q", *range(n + 1)),
             ".json": json.dumps({"format": "upipe-tokens", "version": 1, "dtype": "uint32", "vocab_size": 256,
                                  "documents": n, "tokens": n}).encode()}
    for suffix, blob in files.items():
        inputs.write_bytes(os.path.join(w, "corpus" + suffix), blob)


def corpus_manifest(**fields):
    def setup(w, t):
        files = inputs.corpus_files(random.Random(5), 256)
        manifest = json.loads(files[".json"])
        manifest.update(fields)
        files[".json"] = json.dumps(manifest).encode()
        for suffix, blob in files.items():
            inputs.write_bytes(os.path.join(w, "corpus" + suffix), blob)
    return setup


def file_of(name, blob):
    return lambda w, t: inputs.write_bytes(os.path.join(w, name), blob)


def flipped(blob, at):
    return blob[:at] + bytes([blob[at] ^ 0xFF]) + blob[at + 1:]


def gzip_with_bad_distance():
    """A gzip stream of JSON lines whose deflate data is damaged (zlib: invalid distance)."""
    good = inputs.gzip_bytes(inputs.jsonl_bytes([f"hello {i}" for i in range(300)]))
    return good[:len(good) // 2] + bytes(10) + good[len(good) // 2 + 10:]


def regression_cases():
    """(what was wrong, command, expect, names, setup(w, t) or None, check or None, the template copied to
    {w}/ck first: True for the checkpoint). expect: refuse, ok, or handled (any good end)."""
    fifo = lambda name: lambda w, t: os.mkfifo(os.path.join(w, name))
    resume = RESUME + " --cp 2"
    return [
        ("step --weights FIFO hung in open()", "step --seq-len 32 --cp 1 --weights {w}/f", "refuse", ["f"], fifo("f")),
        ("bench-attention --head-chunk 4294967300 ran as U = 4",
         "bench-attention --backend meta --strategy upipe --seq-len 64 --head-chunk 4294967300", "refuse",
         ["4294967300"], None),
        ("--cp '' ran as 0", "step --seq-len 32 --cp ''", "refuse", ["--cp"], None),
        ("--cp 010 ran as octal 8", "step --backend meta --seq-len 64 --cp 010", "refuse", ["10"], None),
        ("--seed -1 ran as 2^64 - 1", "step --seq-len 32 --seed -1", "refuse", ["--seed"], None),
        ("step --json FIFO hung", "step --seq-len 32 --json {w}/f", "refuse", ["f"], fifo("f")),
        ("model-config --out FIFO hung", "model-config --model tiny-llama --out {w}/f", "refuse", ["f"], fifo("f")),
        ("step --config '' ran the preset", "step --seq-len 32 --config ''", "refuse", ["--config"], None),
        ("eval --model '' ran the default", "eval --niah --lengths 64 --samples 1 --model ''", "refuse", ["--model"],
         None),
        ("--eval-data without --eval-every was never read",
         TRAIN_META + " --eval-data {t}/corpus", "refuse", ["--eval-every"], None),
        ("bench --warmup-seq-len 2^63 - 1 was an internal error",
         "bench --layers 1 --seq-len 64 --repeats 1 --attention upipe --cp 2 --warmup-seq-len 9223372036854775807",
         "refuse", ["--warmup-seq-len"], None),
        ("bench-attention --rope-theta -5 was an internal error",
         "bench-attention --backend meta --strategy upipe --seq-len 64 --rope-theta -5", "refuse", ["--rope-theta"],
         None),
        ("step --seq-len 1024M on the cpu grew past the machine's memory", "step --seq-len 1024M --cp 2", "refuse",
         ["1073741824", "host memory", "out of memory"], None),
        ("step --backend meta --seq-len 1024M held the sequence on the host",
         "step --backend meta --model llama3-8b --seq-len 1024M --cp 8", "handled", [], None),
        ("--json through a dangling link replaced the link", "step --seq-len 32 --json {w}/out", "handled", ["out"],
         lambda w, t: os.symlink("real.json", os.path.join(w, "out")), link_stays("out")),
        ("plan --mlp-tile 1 --loss-chunk 1 ran for minutes",
         "plan --model llama3-8b --gpus 8 --mlp-tile 1 --loss-chunk 1", "handled", [], None),
        ("report showed a traceback for a row without its strategy", "report --out {w}/plots {w}/rows.json", "refuse",
         ["strategy"], lambda w, t: json.dump([{"seq_len": 64}], open(os.path.join(w, "rows.json"), "w"))),
        ("a safetensors shape nested 100,000 deep overflowed the stack", "step --seq-len 16 --cp 1 --weights {w}/m",
         "refuse", ["m"], lambda w, t: inputs.write_bytes(os.path.join(w, "m"), inputs.safetensors_bytes(
             '{"x": {"dtype": "F32", "shape": ' + inputs.nested(100000, "") + ', "data_offsets": [0, 4]}}', b"\0" * 4))),
        ("a trainer shard that is a FIFO hung the resume", resume, "refuse", ["rank-00001"],
         lambda w, t: make_special(os.path.join(w, "ck", "trainer", "rank-00001-of-00002.safetensors"), "fifo"), None,
         True),
        ("a manifest with step -1 was an internal error", resume, "refuse", ["step"], edit_manifest("step", -1), None,
         True),
        ("a manifest whose data position was edited resumed elsewhere in the data", resume, "refuse",
         ["data position"], edit_manifest("data_position", 96), None, True),
        ("a manifest of 2^62 ranks", resume, "refuse", ["ranks"], edit_manifest("ranks", 2**62), None, True),
        ("a resume with another seed", resume + " --seed 2", "refuse", ["--seed"], None, None, True),
        ("export over a stale OUT.tmp-<dead pid> left it", "export {w}/ck {w}/out", "handled", [],
         lambda w, t: open(os.path.join(w, "out.tmp-999999999"), "w").close(), None, True),
        ("export wrote a NaN master weight", "export {w}/ck {w}/out", "refuse", ["model.embed_tokens.weight"],
         poison(os.path.join("trainer", "rank-00000-of-00002.safetensors"), "unit.0.master"), None, True),
        ("bench --repeats 2147483647 overflowed into --steps -2147483648",
         "bench --layers 1 --seq-len 64 --repeats 2147483647 --attention upipe --cp 2", "refuse", ["--repeats"], None),
        ("step --memory-gib 1e300 became an arena of 0 bytes", "step --seq-len 32 --cp 2 --memory-gib 1e300", "refuse",
         ["--memory-gib"], None),
        ("plan --gpu-memory 1e300GiB was cast past 64 bits", "plan --model tiny-llama --gpus 2 --gpu-memory 1e300GiB",
         "refuse", ["--gpu-memory"], None),
        ("a corpus index offset of 2^63 overflowed the epoch's length (UBSan)", TRAIN_CPU + " --data {w}/corpus",
         "refuse", ["corpus.index"], corpus_with(offsets={3: 2**63})),
        ("a manifest of 2^61 documents wrapped to the index's size and read past it",
         TRAIN_CPU + " --data {w}/corpus", "refuse", ["corpus.index"], corpus_with(documents=2**61)),
        ("plan on a vocabulary of 2^31 - 1 held 8 GiB per probe on the host",
         "plan --gpus 2 --gpu-memory 2GiB --host-memory 2GiB --config {w}/config.json", "handled", [],
         config_with(vocab_size=2**31 - 1)),
        ("sizes whose product overflows ran out of memory at 2^61 bytes",
         "step --backend meta --seq-len 64 --cp 2 --config {w}/config.json", "refuse", ["hidden_size"],
         config_with(hidden_size=2**30, vocab_size=2**30)),
    ] + second_fuzz_cases() + input_fuzz_cases() + third_fuzz_cases()


def second_fuzz_cases():
    """Issue #30's second fuzz: each input was accepted, hung, or failed without an upipe: error line."""
    resume = RESUME + " --cp 2"
    lora_resume = (resume, "checkpoint_lora")
    docs = inputs.jsonl_bytes(["hello world", "a second document"])
    return [
        ("step --config DIR/config.json without weights was refused (a config alone is valid)",
         "step --seq-len 32 --cp 2 --config {w}/m/config.json", "ok", [],
         model_dir("hf/llama-yarn-shards", lambda d: [os.remove(os.path.join(d, f)) for f in os.listdir(d)
                                                       if f != "config.json"])),
        ("an adapter_config.json that is a FIFO hung --init-adapter", TRAIN_CPU + " --stop-after 1 --init-adapter {w}/ck",
         "refuse", ["adapter_config.json"], special("ck/adapter_config.json", "fifo"), None, "checkpoint_lora"),
        ("a tokenizer.json symlink loop was an internal error", "eval --niah --lengths 64 --samples 1 --cp 1 --model {w}/m",
         "refuse", ["tokenizer.json"], model_dir("hf/llama-yarn-shards",
                                                 lambda d: make_special(os.path.join(d, "tokenizer.json"), "loop"))),
        ("a corpus of one-token documents was an internal error", TRAIN_CPU + " --data {w}/corpus", "refuse",
         ["two tokens"], one_token_documents),
        ("eval --seq-len 1 reported loss 0 over 0 targets", "eval --model tiny-llama --data {t}/corpus --seq-len 1 "
         "--samples 1 --cp 1", "refuse", ["--seq-len"], None),
        ("export --merge-adapter wrote NaN from a NaN adapter", "export {golden}/tiny-llama {w}/out --merge-adapter {w}/ck",
         "refuse", ["adapter_model.safetensors"], poison("adapter_model.safetensors"), None, "checkpoint_lora"),
        ("swapped trainer shards resumed (the rank in each shard was not checked)", resume, "refuse", ["rank-0000"],
         swap_shards, None, True),
        ("an edited adapter_config.json contradicting the manifest resumed", *lora_resume[:1], "refuse",
         ["adapter_config.json", "alpha=8"], edit_json("ck/adapter_config.json", lora_alpha=8.0), None, lora_resume[1]),
    ] + [
        (f"adapter r = {r} was read as 4", lora_resume[0], "refuse", [f"r = {r}"], edit_json("ck/adapter_config.json", r=r),
         None, lora_resume[1]) for r in (4294967300, 4.9, -4)
    ] + [
        (f"prepare-data printed a traceback on {what}", PREPARE + " {w}/" + name, "refuse", [name, "tokenizers"],
         file_of(name, blob)) for what, name, blob in [
            ("deep JSON", "deep.jsonl", ('{"text": ' + inputs.nested(100000, '"a"') + "}\n").encode()),
            ("corrupt gzip", "docs.jsonl.gz", gzip_with_bad_distance()),
            ("corrupt Parquet", "docs.parquet", flipped(inputs.PARQUET_TEXT, inputs.PARQUET_SNAPPY_BYTE)),
            ("invalid UTF-8 in Parquet", "utf8.parquet", inputs.PARQUET_BAD_UTF8)]
    ] + [
        ("--packing stream never read the corpus manifest", TRAIN_CPU + " --data {w}/corpus --packing stream", "refuse",
         ["corpus.json"], corpus_manifest(version=7)),
        ("a manifest with batch: 0 turned off the data position check", resume + " --data {t}/corpus", "refuse",
         ["batch"], edit_json("ck/trainer/manifest.json", batch=0, data_position=96), None, "checkpoint_data"),
        ("--lora r=4,r=8 ran", "step --seq-len 32 --cp 2 --lora r=4,r=8", "refuse", ["twice"], None),
        ("--lora r=0x4,targets= ran", "step --seq-len 32 --cp 2 --lora r=0x4,targets=", "refuse", ["r=0x4"], None),
        ("a tensor of layer 2^32 was read as layer 0", "step --seq-len 16 --cp 1 --model {w}/m", "refuse",
         ["4294967296"], model_dir("tiny-llama", extra_tensor("model.layers.4294967296.mlp.up_proj.weight"))),
        ("rope_type: null dropped YaRN", "model-config --config {w}/m", "refuse", ["rope_type"],
         model_dir("hf/llama-yarn-shards", rope_type_null)),
        ("bench-attention --seq-chunks on hybrid was ignored",
         "bench-attention --backend meta --strategy hybrid --seq-len 64 --seq-chunks 4", "refuse", ["--seq-chunks"], None),
        ("prepare-data --workers was unbounded", PREPARE + " --workers 100000000 {w}/docs.jsonl", "refuse",
         ["--workers", "tokenizers"], file_of("docs.jsonl", docs)),
        ("--lora alpha=1e30 blamed --lr", TRAIN_CPU + " --lora r=4,alpha=1e30", "refuse", ["alpha"], None),
        ("train --steps 99999999999999999999 ran", "train --steps 99999999999999999999 --seq-len 32 --cp 2", "refuse",
         ["--steps"], None),
        ("report on an empty file exited without an upipe: error line", "report --out {w}/plots {w}/rows.json",
         "refuse", ["rows.json"], file_of("rows.json", b"")),
        ("report on garbage exited without an upipe: error line", "report --out {w}/plots {w}/rows.json", "refuse",
         ["rows.json"], file_of("rows.json", b"garbage\n")),
        # Issue #40: a host budget past the machine was pinned until the OOM killer ended the run;
        # one too small for the offloaded state ran into the pool's limit midway.
        ("a host budget past the machine was taken, not refused", TRAIN_CPU + " --host-memory-gib 100000", "refuse",
         ["--host-memory-gib"], None),
        ("a host budget below the offloaded state was taken", TRAIN_CPU + " --offload optimizer --host-memory-gib 0.01",
         "refuse", ["--host-memory-gib"], None),
        ("--attention-dtype outside bf16|fp8 refused by name", TRAIN_META + " --attention-dtype fp16", "refuse",
         ["--attention-dtype", "fp16"], None),
        ("--head-chunk neither auto nor a count refused by name", TRAIN_META + " --head-chunk most", "refuse",
         ["--head-chunk"], None),
    ] + config_file_cases()


def config_file_cases():
    """Issue #40's run configuration: a bad value in a --config-file unnamed by every command but train, a key the
    command does not take skipped without a word, and paths longer than a path can be an internal error."""
    toml = lambda text: file_of("c.toml", text.encode())
    long_path = "a" * 5000
    return [
        ("eval skipped a [checkpoint] key of a --config-file without a word",
         "eval --niah --lengths 64 --samples 1 --config-file {w}/c.toml", "refuse",
         ["c.toml:2", "checkpoint.keep_last", "train"], toml("[checkpoint]\nkeep_last = 3\n")),
        ("step named neither the file nor the key of a bad value", "step --seq-len 32 --config-file {w}/c.toml",
         "refuse", ["c.toml:2", "system.mlp_tile"], toml("[system]\nmlp_tile = -1\n")),
        ("eval named neither the file nor the key of a bad value",
         "eval --niah --lengths 64 --samples 1 --config-file {w}/c.toml", "refuse", ["c.toml:2", "data.packing"],
         toml("[data]\npacking = 'zip'\n")),
        ("bench named neither the file nor the key of a bad value",
         "bench --layers 1 --seq-len 64 --repeats 1 --config-file {w}/c.toml", "refuse", ["c.toml:3", "parallel.zero"],
         toml("[parallel]\n\nzero = 1\n")),
        ("plan named neither the file nor the key of a bad value", "plan --model tiny-llama --config-file {w}/c.toml",
         "refuse", ["c.toml:2", "system.memory_gib"], toml("[system]\nmemory_gib = -8\n")),
        ("a 5,000-character --init was an internal error", TRAIN_CPU + " --init " + long_path, "refuse",
         ["--init", "4095"], None),
        ("a 5,000-character --config-file was an internal error", "step --config-file " + long_path, "refuse",
         ["--config-file", "4095"], None),
        ("a 5,000-character path in a config file was an internal error", TRAIN_CPU + " --config-file {w}/c.toml",
         "refuse", ["c.toml:2", "model.init", "4095"], toml("[model]\ninit = '" + long_path + "'\n")),
        ("a control character in a path of a config file reached the file system",
         TRAIN_CPU + " --config-file {w}/c.toml", "refuse", ["c.toml:2", "model.init", "control"],
         toml('[model]\ninit = "a\\u0001b"\n')),
        ("--steps had two limits (2^40 and 1e9)", "train --steps 2000000000 --seq-len 32 --cp 2", "refuse",
         ["--steps", "1000000000"], None),
    ]


def regression_case(index, t):
    what, line, expect, names, setup, *rest = regression_cases()[index]
    check = rest[0] if rest else None
    template = rest[1] if len(rest) > 1 else None

    def prepare(w):
        if template:
            copy_template(t, w, "checkpoint" if template is True else template)
        if setup:
            setup(w, t)
    places = {"{t}": t["root"], "{golden}": t["golden"], "{hf}": t["hf"]}
    args = []
    for a in words(line):
        for key, value in places.items():
            a = a.replace(key, value)
        args.append("" if a == "''" else a)
    return Case("regression", what, args, prepare, expect=expect, names=names, check=check)




def in_run_directory(name="checkpoint-2", best=False):
    """The template checkpoint (step 2) as {w}/run/NAME with {w}/run/latest (and best) naming it."""
    def setup(w, t):
        shutil.copytree(os.path.join(w, "ck"), os.path.join(w, "run", name), symlinks=True)
        for pointer in ["latest"] + (["best"] if best else []):
            with open(os.path.join(w, "run", pointer), "w") as f:
                f.write(name + "\n")
    return setup


def only(path, names):
    """{w}/PATH holds exactly `names` (a run wrote there, and nowhere else)."""
    def check(w, r):
        found = sorted(os.listdir(os.path.join(w, path))) if os.path.isdir(os.path.join(w, path)) else None
        return [] if found == sorted(names) else [f"{path} holds {found}, not {sorted(names)}"]
    return check


def exists(path):
    return lambda w, r: [] if os.path.exists(os.path.join(w, path)) else [f"{path} was not written"]


def negative(file, tensor):
    """-1 as the first element of the f32 `tensor` in the checkpoint's `file`."""
    def setup(w, t):
        path = os.path.join(w, "ck", file)
        header, data = inputs.read_safetensors(path)
        at = header[tensor]["data_offsets"][0]
        inputs.write_bytes(path, inputs.safetensors_bytes(header, data[:at] + struct.pack("<f", -1.0) + data[at + 4:]))
    return setup


def emptied(path):
    return lambda w, t: open(os.path.join(w, path), "w").close()


def third_fuzz_cases():
    """Issue #39's held-out fuzz: resume under rotation, runs that wrote elsewhere than told, checkpoints whose
    files disagree, and a new user's paths."""
    resume = RESUME + " --cp 2"
    shard = os.path.join("trainer", "rank-00000-of-00002.safetensors")
    rotate = "train --steps 6 --seq-len 32 --eval-samples 0 --cp 2 --save-every 1 --keep-last 1 --resume {w}/run"
    return [
        ("a resume with --keep-last 1 removed its checkpoint and died at the next save (and saved into the run "
         "directory stored in run.toml, not the one resumed)", rotate, "ok", [], in_run_directory(),
         only("run", ["checkpoint-6", "latest"]), True),
        ("a manifest whose step disagrees with its checkpoint-N name resumed",
         "train --steps 6 --seq-len 32 --eval-samples 0 --cp 2 --resume {w}/run/checkpoint-5", "refuse",
         ["checkpoint-5", "step"], in_run_directory("checkpoint-5"), None, True),
        ("a manifest with total_steps below its step resumed", resume, "refuse", ["total_steps"],
         edit_manifest("total_steps", 1), None, True),
        ("a manifest with total_steps 0 resumed", resume, "refuse", ["total_steps"], edit_manifest("total_steps", 0),
         None, True),
        ("a rank shard of another step's checkpoint resumed", resume, "refuse", ["rank-00000", "step 2"],
         edit_manifest("step", 1), None, True),
        ("an emptied trainer/run.toml was taken for an earlier version's checkpoint", resume, "refuse", ["run.toml"],
         emptied(os.path.join("ck", "trainer", "run.toml")), None, True),
        ("a negative second moment resumed (and the run blamed --lr)", resume, "refuse", ["rank-00000", "negative"],
         negative(shard, "unit.1.exp_avg_sq"), None, True),
        ("--init OTHER on a LoRA resume swapped the frozen base", resume + " --init {golden}/tiny-llama", "refuse",
         ["--init"], None, None, "checkpoint_lora"),
        ("export refused a run directory's best", "export {w}/run/best {w}/new/out", "ok", [],
         in_run_directory(best=True), exists(os.path.join("new", "out", "config.json")), True),
        ("--metrics-json in a missing directory was refused", TRAIN_CPU + " --metrics-json {w}/runs/m.jsonl", "ok", [],
         None, exists(os.path.join("runs", "m.jsonl"))),
    ]
