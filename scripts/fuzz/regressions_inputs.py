"""Issue #39's held-out fuzz, the input side: prepare-data's chat templates and rows, the
metrics tools, and the data and model fields the engine reads (regressions.py lists them
with the others)."""
import json
import os
import random

import inputs

CHAT = "prepare-data --tokenizer {hf}/llama-chat --workers 1 --out {w}/out"
TURN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
PADDED_TURN = [{"role": "user", "content": " hi\n"}, {"role": "assistant", "content": "\n\nyo "}]
TRIMMING = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
            "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
            "{% endif %}")


def files(**blobs):
    """{w}/NAME holding each blob (str: its UTF-8; None: a FIFO)."""
    def setup(w, t):
        for name, blob in blobs.items():
            path = os.path.join(w, name.replace("__", "."))
            if blob is None:
                os.mkfifo(path)
            else:
                with open(path, "wb") as f:
                    f.write(blob.encode("utf-8", "surrogatepass") if isinstance(blob, str) else blob)
    return setup


def rows(*objects):
    return "".join(json.dumps(o) + "\n" for o in objects)


def chat_cases():
    conversation = rows({"messages": TURN})
    with_template = CHAT + " --chat-template {w}/t.jinja {w}/c.jsonl"
    return [
        ("prepare-data: a lone surrogate was a traceback", CHAT + " {w}/c.jsonl", "refuse", ["c.jsonl:1", "Unicode"],
         files(c__jsonl=rows({"prompt": "a\ud800", "completion": "b"}))),
        ("prepare-data: an empty prompt and completion were a traceback", CHAT + " {w}/c.jsonl", "ok", [],
         files(c__jsonl=rows({"prompt": "", "completion": ""}))),
        ("prepare-data: an empty template was a traceback", with_template, "refuse", ["no target"],
         files(c__jsonl=conversation, t__jinja="")),
        ("prepare-data: a recursive template was a traceback", with_template, "refuse", ["RecursionError"],
         files(c__jsonl=conversation, t__jinja="{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}")),
        ("prepare-data: a template looping 10^10 times hung", with_template + " --template-seconds 1", "refuse",
         ["--template-seconds"], files(c__jsonl=conversation, t__jinja="{% for i in range(100000) %}"
                                       "{% for j in range(100000) %}{% endfor %}{% endfor %}")),
        ("prepare-data: 5,000 turns without generation blocks overran --template-seconds (a square cost)",
         CHAT + " --template-seconds 10 {w}/c.jsonl", "ok", [], files(c__jsonl=rows({"messages": TURN * 5000}))),
        ("prepare-data: 5,000 padded turns of a template that trims them overran --template-seconds",
         with_template + " --template-seconds 10", "ok", [],
         files(c__jsonl=rows({"messages": PADDED_TURN * 5000}), t__jinja=TRIMMING)),
        ("prepare-data: a template that is a FIFO hung", with_template, "refuse", ["t.jinja"],
         files(c__jsonl=conversation, t__jinja=None)),
        ("prepare-data: a template writing gigabytes took gigabytes", with_template, "refuse", ["--template-max-output"],
         files(c__jsonl=conversation, t__jinja="{% for i in range(100000) %}{{ 'x' * 60000 }}{% endfor %}")),
        ("prepare-data: a template doubling a string took gigabytes", with_template, "refuse", ["--template-max-output"],
         files(c__jsonl=conversation, t__jinja="{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                                               "{% set ns.s = ns.s ~ ns.s %}{% endfor %}")),
    ]


def metrics_cases():
    deep = "[" * 100000 + "]" * 100000
    return [
        ("report on deep JSON lines was a traceback", "report --out {w}/plots {w}/m.jsonl", "refuse", ["m.jsonl"],
         files(m__jsonl='{"step": ' + deep + "}\n")),
    ]


def corpus_of_another_tokenizer(w, t):
    """{w}/corpus.*: a valid corpus whose manifest names a tokenizer that is not llama-chat's."""
    files = inputs.corpus_files(random.Random(3), 256, documents=8, length=60)
    manifest = json.loads(files[".json"])
    manifest.update(tokenizer_sha256="0" * 64, tokenizer="another/model")
    files[".json"] = json.dumps(manifest).encode()
    for suffix, blob in files.items():
        inputs.write_bytes(os.path.join(w, "corpus" + suffix), blob)


def tokens_of(name, count):
    return lambda w, t: inputs.write_bytes(os.path.join(w, name), inputs.token_bytes([7 + i % 200 for i in range(count)]))


def family_config(fixture, **fields):
    """{w}/m/config.json: the fixture's, `fields` set."""
    def setup(w, t):
        os.makedirs(os.path.join(w, "m"))
        c = json.load(open(os.path.join(t["hf"], fixture, "config.json")))
        c.update(fields)
        json.dump(c, open(os.path.join(w, "m", "config.json"), "w"))
    return setup


def data_cases():
    chat = "--model {hf}/llama-chat --seq-len 32 --cp 1"
    train = "train --steps 1 --eval-samples 0 --checkpoint-policy what=input "
    return [
        ("eval --data of another tokenizer was read", "eval " + chat + " --samples 1 --data {w}/corpus", "refuse",
         ["--allow-tokenizer-mismatch"], corpus_of_another_tokenizer),
        ("train --eval-data of another tokenizer was read", train + chat + " --data {w}/t.bin --eval-every 1 "
         "--eval-data {w}/corpus", "refuse", ["--allow-tokenizer-mismatch"],
         lambda w, t: (corpus_of_another_tokenizer(w, t), tokens_of("t.bin", 400)(w, t))),
        ("train --eval-data shorter than --seq-len was repeated", train + "--seq-len 64 --cp 2 --data {w}/t.bin "
         "--eval-every 1 --eval-data {w}/h.bin", "refuse", ["--eval-data"],
         lambda w, t: (tokens_of("t.bin", 400)(w, t), tokens_of("h.bin", 50)(w, t))),
        ("a corpus of odd length at cp 2 was told a --seq-len then refused", train + "--seq-len 128 --cp 2 "
         "--data {w}/t.bin", "refuse", ["--seq-len 100"], tokens_of("t.bin", 101)),
        ("gemma3 layer_types [] ran every layer full", "model-config --config {w}/m", "refuse", ["layer_types"],
         family_config("gemma3-text", layer_types=[])),
        ("gemma3 sliding_window 0 ran every layer full", "model-config --config {w}/m", "refuse", ["sliding_window"],
         family_config("gemma3-text", sliding_window=0)),
    ]


def input_fuzz_cases():
    return chat_cases() + metrics_cases() + data_cases()
