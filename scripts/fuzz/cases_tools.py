"""Fuzz case families over the files around a model (issue #30's second fuzz): LoRA adapter
directories, the members of a model directory (tokenizer files, config, index) that are not
what they claim, and prepare-data's inputs (deep JSON, corrupt gzip and Parquet, text that
is not UTF-8) and flags."""
import json
import os
import shutil

import inputs
from cases import TRAIN_CPU, Case, make_special, words

ADAPTER_FIELDS = ["r", "lora_alpha", "target_modules", "peft_type", "lora_dropout", "use_dora", "bias",
                  "base_model_name_or_path", "rank_pattern"]
ADAPTER_COMMANDS = [
    TRAIN_CPU + " --stop-after 1 --init-adapter {w}/ad",
    "step --seq-len 32 --cp 2 --adapter {w}/ad",
    "export {golden}/tiny-llama {w}/merged --merge-adapter {w}/ad",
    "train --steps 4 --seq-len 32 --eval-samples 0 --checkpoint-policy what=input --cp 2 --resume {w}/ad",
]


def adapter_case(rng, t):
    """A LoRA run's checkpoint (tiny-llama, r=2) with its adapter_config.json or its weights
    mutated, read by every command that takes adapters."""
    config = json.load(open(os.path.join(t["root"], "checkpoint_lora", "adapter_config.json")))
    weights = os.path.join(t["root"], "checkpoint_lora", "adapter_model.safetensors")
    kind = rng.choice(["field", "field", "field", "whole", "special", "weights", "poison"])
    expect, names, text, blob, special = "handled", ["adapter", "ad"], None, None, None
    if kind == "field":
        key = rng.choice(ADAPTER_FIELDS)
        config[key] = rng.choice(inputs.BAD_JSON_VALUES + [4.9, 4294967300, -4, "LOHA", ["q_proj", "q_proj"]])
        text, what = json.dumps(config), f"adapter_config.json {key} = {str(config[key])[:30]}"
        names += [key]
        if key == "r" and config[key] != 2:
            expect = "refuse"  # the shapes are r=2's: any other r, or a number that is no rank, is refused
    elif kind == "whole":
        text = rng.choice(["", "[]", "{", "null", inputs.nested(100000, ""), json.dumps(config)[:-2]])
        what, expect = f"adapter_config.json is {text[:20]!r}", "refuse"
    elif kind == "special":
        special = rng.choice(["fifo", "dir", "loop", "dangling"])
        what, expect = f"adapter_config.json is a {special}", "refuse"
    else:
        header, data = inputs.read_safetensors(weights)
        if kind == "poison":
            what, data = inputs.poison_value(rng, header, data)
            blob, expect = inputs.safetensors_bytes(header, data), "refuse"
        else:
            what, blob, more = inputs.mutate_safetensors(rng, header, data)
            names += more
        what = f"adapter_model.safetensors: {what}"
        names += ["adapter_model.safetensors"]

    def setup(w):
        ad = os.path.join(w, "ad")
        shutil.copytree(os.path.join(t["root"], "checkpoint_lora"), ad)
        if text is not None:
            with open(os.path.join(ad, "adapter_config.json"), "w", encoding="utf-8", errors="surrogatepass") as f:
                f.write(text)
        if special:
            make_special(os.path.join(ad, "adapter_config.json"), special)
        if blob is not None:
            inputs.write_bytes(os.path.join(ad, "adapter_model.safetensors"), blob)
    command = rng.choice(ADAPTER_COMMANDS).replace("{golden}", t["golden"])
    return Case("adapters", what, words(command), setup, expect=expect, names=names + ["adapter_config.json"],
                timeout=30, protect=["ad"] if "--resume" in command else [])


MEMBERS = ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json",
           "model.safetensors.index.json", "special_tokens_map.json"]
MODEL_DIR_COMMANDS = [
    "step --seq-len 16 --cp 1 --model {w}/model",
    "eval --niah --lengths 64 --samples 1 --cp 1 --model {w}/model",
    TRAIN_CPU + " --stop-after 1 --model {w}/model --save {w}/out",
    "model-config --model {w}/model",
    "step --seq-len 16 --cp 1 --config {w}/model/config.json",
]


def model_dir_member_case(rng, t):
    """A model directory one of whose members (a tokenizer file, the config, the index) is a
    FIFO, a directory, a symbolic link loop, a dangling link, empty or JSON nested too deep."""
    member = rng.choice(MEMBERS)
    kind = rng.choice(["fifo", "dir", "loop", "dangling", "empty", "deep"])
    # A FIFO, a loop or a folder where a file must be is refused; what an empty or a deep
    # file does depends on whether the command reads it.
    expect = "refuse" if kind in ("fifo", "dir", "loop") else "handled"

    def setup(w):
        d = os.path.join(w, "model")
        shutil.copytree(os.path.join(t["hf"], "llama-yarn-shards"), d)
        path = os.path.join(d, member)
        if kind == "deep":
            with open(path, "w") as f:
                f.write(inputs.nested(100000, ""))
        else:
            make_special(path, kind)
    command = rng.choice(MODEL_DIR_COMMANDS)
    if "--config" in command and member not in ("config.json",) + tuple(MEMBERS[:3]):
        expect = "handled"  # --config reads the config and the tokenizer's files, not the weights' index
    return Case("model_dir", f"{member} is {kind}", words(command), setup, expect=expect,
                names=[member, "model"], timeout=30)


PREPARE = "prepare-data --tokenizer {hf}/llama-yarn-shards --out {w}/out --workers 1"
CHAT = "prepare-data --tokenizer {hf}/llama-chat --out {w}/out --workers 1"


CHAT_TEMPLATES = [  # each a class of template a model folder may bring: every one ends as a bad row
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{{ 'x' * 60000 }}{% endfor %}",
    "{{ 'x' * 3000000000 }}", "{{ 'x'.ljust(3000000000) }}", "{{ 9 ** 9 ** 9 ** 9 }}", "{{ '%3000000000d' % 1 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "", "{{ messages.__class__ }}", "{% if %}",
    "{{ raise_exception('no') }}", "{{ messages[99] }}{{ 1 / 0 }}",
]
CHAT_ROWS = [{"prompt": "a\ud800", "completion": "b"}, {"prompt": "", "completion": ""},
             {"messages": [{"role": "user", "content": "\udfff"}, {"role": "assistant", "content": "x"}]},
             {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}]


def chat_case(rng, t):
    """prepare-data's chat path: a hostile template (or one in the place of a FIFO), or a bad row."""
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    template = rng.choice(CHAT_TEMPLATES + [None])
    if rng.random() < 0.3:
        rows.append(rng.choice(CHAT_ROWS))
    flags = rng.choice([[], ["--bad-rows", "skip"], ["--template-seconds", rng.choice(["1", "0", "-1", "nan", "1e9"])],
                        ["--template-max-output", rng.choice(["1", "0", "1000", "99999999999999999999"])]])
    blob = "".join(json.dumps(r) + "\n" for r in rows).encode()

    def setup(w):
        inputs.write_bytes(os.path.join(w, "c.jsonl"), blob)
        path = os.path.join(w, "t.jinja")
        if template is None:
            os.mkfifo(path)
        else:
            inputs.write_bytes(path, template.encode())
    args = words(CHAT.replace("{hf}", t["hf"])) + flags + ["--template-seconds", "2"] * ("--template-seconds" not in flags)
    args += ["--chat-template", "{w}/t.jinja", "{w}/c.jsonl"]
    what = f"template {template!r:.40} rows {len(rows)} {' '.join(flags)}"
    return Case("prepare_data", what, args, setup, expect="handled", names=["c.jsonl", "t.jinja", "tokenizers"] + flags[:1],
                timeout=60)


def prepare_case(rng, t):
    """prepare-data on damaged documents, or with bad flags, or its chat path."""
    kind = rng.choice(["jsonl", "gz", "parquet", "parquet", "text", "special", "flags", "chat"])
    if kind == "chat":
        return chat_case(rng, t)
    name, blob, flags, expect, special = "docs.jsonl", None, [], "handled", None
    docs = ["hello world", "a second document", "x" * 100]
    if kind == "jsonl":
        line = rng.choice(['{"text": ' + inputs.nested(100000, '"a"') + '}', "[1]", '{"text": 5}', "{", '{"x": "a"}',
                           '{"text": "\\ud800"}', '{"text": "ok"}'])
        blob = inputs.jsonl_bytes(docs) + line.encode() + b"\n"
        what = f"a line {line[:20]!r}"
    elif kind == "gz":
        name = "docs.jsonl.gz"
        good = inputs.gzip_bytes(inputs.jsonl_bytes(docs * 50))
        blob = rng.choice([inputs.corrupt(rng, good, rng.choice([1, 3, 10])), good[:len(good) // 2], b"\x1f\x8b" + b"x" * 20])
        what = "corrupt gzip"
    elif kind == "parquet":
        name = "docs.parquet"
        blob = rng.choice([inputs.corrupt(rng, inputs.PARQUET_TEXT, rng.choice([1, 3])), inputs.PARQUET_BAD_UTF8,
                           inputs.PARQUET_TEXT[:rng.randrange(len(inputs.PARQUET_TEXT))]])
        what = "corrupt Parquet"
    elif kind == "text":
        name = "doc.txt"
        blob = rng.choice([b"\xff\xfe not utf-8", b"", b"\x00" * 64, "caf\u00e9".encode()])
        what = f"text {blob[:10]!r}"
    elif kind == "special":
        special = rng.choice(["fifo", "dir", "loop", "dangling"])
        what, expect = f"the input is a {special}", ("refuse" if special != "dir" else "handled")
    else:
        flag = rng.choice(["--workers", "--batch-bytes", "--heldout-fraction", "--seed", "--text-field", "--bos"])
        value = rng.choice(["0", "-1", "100000000", "99999999999999999999", "nan", "1.5", "x", "", "yes"])
        flags, what = [flag, value], f"{flag} {value!r}"
        blob = inputs.jsonl_bytes(docs)
        if flag == "--workers" and value in ("0", "-1", "100000000", "99999999999999999999"):
            expect = "refuse"

    def setup(w):
        path = os.path.join(w, name)
        if special:
            make_special(path, special)
        else:
            inputs.write_bytes(path, blob)
    args = words(PREPARE.replace("{hf}", t["hf"]))
    if flags and flags[0] == "--workers":
        args = args[:-2]  # the case's own --workers
    args += flags + ["{w}/" + name]
    # Without Python's tokenizers prepare-data refuses every run, naming them.
    return Case("prepare_data", what, args, setup, expect=expect, names=[name, "tokenizers"] + flags[:1], timeout=60)
