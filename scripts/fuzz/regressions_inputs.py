"""Issue #39's held-out fuzz, the input side: prepare-data's chat templates and rows, the
metrics tools, and the data and model fields the engine reads (regressions.py lists them
with the others)."""
import json
import os

CHAT = "prepare-data --tokenizer {hf}/llama-chat --workers 1 --out {w}/out"
TURN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


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


def input_fuzz_cases():
    return chat_cases() + metrics_cases()
