"""Tests of prepare-data's instruction and chat rows (upipe_tools.chat_data): the renderer and
its masks against transformers' apply_chat_template, the mask file, the fixture
tests/golden/hf/llama-chat, and rows that are refused or skipped.

run: python3 -m pytest tests/python/test_chat_data.py
"""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "tests" / "golden" / "hf" / "llama-chat"
TEMPLATES = CHAT / "templates"

tokenizers = pytest.importorskip("tokenizers")
np = pytest.importorskip("numpy")
pytest.importorskip("jinja2")
from upipe_tools import chat_data  # noqa: E402
from tool_run import run_tool  # noqa: E402


def run(*args, ok=True):
    p = run_tool("prepare_data", *args, stdin=subprocess.DEVNULL, timeout=120)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def read_output(prefix):
    prefix = str(prefix)
    manifest = json.loads(Path(prefix + ".json").read_text())
    tokens = np.fromfile(prefix + ".tokens", dtype="<u4")
    offsets = np.fromfile(prefix + ".index", dtype="<u8")
    mask = np.fromfile(prefix + ".mask", dtype="u1") if "loss_mask" in manifest else None
    docs = [(tokens[offsets[i]:offsets[i + 1]].tolist(),
             mask[offsets[i]:offsets[i + 1]].tolist() if mask is not None else None) for i in range(len(offsets) - 1)]
    return manifest, docs


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def template(name):
    return (TEMPLATES / name).read_text()


def golden():
    return json.loads((CHAT / "chat.json").read_text())


CONVERSATIONS = [
    [{"role": "user", "content": "Name a fox."}, {"role": "assistant", "content": "The quick brown fox."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  2 + 2?  "},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 + 3?"},
     {"role": "assistant", "content": " 6. "}],
    [{"role": "user", "content": "Add 2 and 3."},
     {"role": "assistant", "content": None,
      "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
     {"role": "tool", "content": "5"}, {"role": "assistant", "content": "The sum is 5."}],
]


def encoder(template_name, loss_mask="auto"):
    tok = tokenizers.Tokenizer.from_file(str(CHAT / "tokenizer.json"))
    special = chat_data.special_token_strings(json.loads((CHAT / "tokenizer_config.json").read_text()))
    t = chat_data.ChatTemplate(template(template_name), special)
    return chat_data.RowEncoder(tok, t, loss_mask, 1, 2), t


# ----------------------------------------------------------------------------- against transformers

@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(CHAT))


@pytest.mark.parametrize("name", ["chatml.jinja", "chatml_generation.jinja", "headers.jinja",
                                  "reasoning_generation.jinja"])
@pytest.mark.parametrize("which", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("prompt", [False, True])
def test_rendering_equals_apply_chat_template(hf_tokenizer, name, which, prompt):
    messages = CONVERSATIONS[which]
    if name == "headers.jinja":  # it writes content alone: no tool calls
        messages = [m for m in messages if m.get("content") is not None]
    if name.startswith("reasoning"):  # every message has content there
        messages = [dict(m, content=m.get("content") or "") for m in messages]
    text = template(name)
    tools = [{"type": "function", "function": {"name": "add"}}] if which == 2 else None
    _, t = encoder(name)
    clean = [{k: v for k, v in m.items() if v is not None} for m in messages]
    ours, _ = t.render(clean, add_generation_prompt=prompt, tools=tools)
    theirs = hf_tokenizer.apply_chat_template(messages, tools=tools, chat_template=text, tokenize=False,
                                              add_generation_prompt=prompt)
    assert ours == theirs
    ids = hf_tokenizer.apply_chat_template(messages, tools=tools, chat_template=text, add_generation_prompt=prompt,
                                           return_dict=True)["input_ids"]
    tok = tokenizers.Tokenizer.from_file(str(CHAT / "tokenizer.json"))
    assert tok.encode(ours, add_special_tokens=False).ids == list(ids)


@pytest.mark.parametrize("plain,tagged", [("chatml.jinja", "chatml_generation.jinja"),
                                          ("reasoning.jinja", "reasoning_generation.jinja")])
@pytest.mark.parametrize("which", range(len(CONVERSATIONS)))
def test_masks_equal_transformers_assistant_masks(hf_tokenizer, plain, tagged, which):
    messages = CONVERSATIONS[which]
    if plain.startswith("reasoning"):
        messages = [dict(m, content=m.get("content") or "") for m in messages]
    want = hf_tokenizer.apply_chat_template(messages, chat_template=template(tagged), return_dict=True,
                                            return_assistant_tokens_mask=True)
    for name in (plain, tagged):  # spans from prefixes, and from the generation blocks
        rows, _ = encoder(name)
        ids, mask = rows.encode({"messages": messages})
        assert ids == list(want["input_ids"]), name
        assert list(mask) == list(want["assistant_masks"]), name


def test_a_template_that_rewrites_past_turns_needs_generation_blocks(hf_tokenizer):
    messages = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": "b", "reasoning_content": "think"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "reasoning": "more"}]
    rows, _ = encoder("reasoning.jinja")
    with pytest.raises(chat_data.RowError) as e:
        rows.encode({"messages": messages})
    assert e.value.kind == "template_rewrites_turns" and "generation" in str(e.value)
    want = hf_tokenizer.apply_chat_template(messages, chat_template=template("reasoning_generation.jinja"),
                                            return_dict=True, return_assistant_tokens_mask=True)
    rows, _ = encoder("reasoning_generation.jinja")
    ids, mask = rows.encode({"messages": messages})
    assert (ids, list(mask)) == (list(want["input_ids"]), list(want["assistant_masks"]))


def test_loss_mask_all_gives_the_template_tokens_alone(hf_tokenizer):
    rows, _ = encoder("chatml.jinja", "all")
    ids, mask = rows.encode({"messages": CONVERSATIONS[1]})
    assert mask is None
    assert ids == list(hf_tokenizer.apply_chat_template(CONVERSATIONS[1], return_dict=True)["input_ids"])
    # a conversation without an assistant turn is a document then
    assert rows.encode({"messages": CONVERSATIONS[1][:2]})[1] is None


def test_conversational_prompt_and_completion():
    rows, t = encoder("chatml.jinja")
    prompt, completion = CONVERSATIONS[1][:4], CONVERSATIONS[1][4:]
    ids, mask = rows.encode({"prompt": prompt, "completion": completion})
    full, _ = t.render(CONVERSATIONS[1])
    before, _ = t.render(prompt, add_generation_prompt=True)
    tok = tokenizers.Tokenizer.from_file(str(CHAT / "tokenizer.json"))
    enc = tok.encode(full, add_special_tokens=False)
    assert ids == enc.ids
    end = len(full.rstrip())
    assert list(mask) == [1 if b < end and e > len(before) else 0 for b, e in enc.offsets]
    # the earlier assistant turn is prompt: only the completion is a target
    _, assistant = rows.encode({"messages": CONVERSATIONS[1]})
    assert sum(mask) < sum(assistant)


# ----------------------------------------------------------------------------- prepare-data

def test_the_fixture_rows_prepare_to_transformers_tokens_and_masks(tmp_path):
    g = golden()
    for workers, template_flag in ((1, []), (2, ["--chat-template", TEMPLATES / "chatml_generation.jinja"])):
        out = tmp_path / f"w{workers}"
        p = run("--tokenizer", CHAT, "--out", out, "--workers", workers, *template_flag, CHAT / "chat.jsonl")
        m, docs = read_output(out)
        assert [d[0] for d in docs] == [r["tokens"] for r in g["rows"]]
        assert [d[1] for d in docs] == [r["mask"] for r in g["rows"]]
        assert m["rows"] == {"text": 2, "messages": 3, "prompt_completion": 1}
        assert m["loss_mask"] == {"format": "upipe-loss-mask", "version": 1, "dtype": "uint8",
                                  "file": out.name + ".mask", "targets": sum(map(sum, (r["mask"] for r in g["rows"])))}
        assert m["skipped_rows"] == {} and m["add_eos"] is True
        assert "targets" in p.stdout.strip().splitlines()[-1]
    for ext in (".tokens", ".index", ".mask"):  # the template's generation blocks give the same files
        assert Path(str(tmp_path / "w1") + ext).read_bytes() == Path(str(tmp_path / "w2") + ext).read_bytes()


def test_documents_before_the_first_example_are_targets_and_parquet_reads_examples(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    text = tmp_path / "a.txt"
    text.write_text("The dog sleeps.")
    table = pa.table({"messages": [CONVERSATIONS[0], CONVERSATIONS[1]]})
    pq.write_table(table, tmp_path / "chat.parquet")
    out = tmp_path / "o"
    run("--tokenizer", CHAT, "--out", out, "--workers", 1, text, tmp_path / "chat.parquet")
    m, docs = read_output(out)
    assert docs[0][1] == [1] * len(docs[0][0])
    rows, _ = encoder("chatml.jinja")
    for doc, messages in zip(docs[1:], CONVERSATIONS):
        ids, mask = rows.encode({"messages": messages})
        assert doc == (ids, list(mask))
    assert m["rows"] == {"text": 1, "messages": 2, "prompt_completion": 0}


def test_every_token_a_target_writes_no_mask_and_the_heldout_split_keeps_its_mask(tmp_path):
    rows = [{"messages": CONVERSATIONS[i % 3]} for i in range(40)] + [{"text": f"doc {i}"} for i in range(20)]
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    run("--tokenizer", CHAT, "--out", tmp_path / "all", "--workers", 1, "--loss-mask", "all", src)
    m, docs = read_output(tmp_path / "all")
    assert "loss_mask" not in m and not Path(str(tmp_path / "all") + ".mask").exists()
    run("--tokenizer", CHAT, "--out", tmp_path / "s", "--workers", 2, "--heldout-fraction", 0.3, "--seed", 3, src)
    train, held = read_output(tmp_path / "s"), read_output(str(tmp_path / "s") + "-heldout")
    rows_encoder, _ = encoder("chatml.jinja")
    assert len(train[1]) + len(held[1]) == len(rows)
    for m, docs in (train, held):
        for ids, mask in docs:
            assert len(mask) == len(ids) and (sum(mask) < len(ids) or ids[-1] == 2)
        assert m["loss_mask"]["targets"] == sum(sum(d[1]) for d in docs)
    whole = [d[0] for d in docs]  # the held-out split's tokens are the same with or without a mask
    assert all(ids in [d[0] for d in read_output(tmp_path / "all")[1]] for ids in whole)


BAD_ROWS = [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no_assistant_turn", "has no assistant turn"),
    ({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "unknown_role",
     "unknown role 'wizard'"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"},
                   {"role": "assistant", "content": "x"}]}, "render_failed", "the system message goes first"),
    ({"messages": "hello"}, "bad_row", "must be a non-empty list"),
    ({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}, "bad_row",
     "content of a number"),
    ({"prompt": "a", "completion": ["b"]}, "bad_row", "both be strings or both be lists"),
    ({"prompt": "a\ud800", "completion": "b"}, "bad_unicode", "not valid Unicode"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\udfff"}]}, "bad_unicode",
     "lone surrogate"),
]


@pytest.mark.parametrize("row,kind,words", BAD_ROWS, ids=[b[1] + str(i) for i, b in enumerate(BAD_ROWS)])
def test_bad_rows_are_refused_naming_the_line_or_skipped_and_counted(tmp_path, row, kind, words):
    good = {"messages": CONVERSATIONS[0]}
    src = write_jsonl(tmp_path / "c.jsonl", [good, good, row, good])
    flags = ["--tokenizer", CHAT, "--workers", 1, "--chat-template", TEMPLATES / "headers.jinja"]
    p = run(*flags, "--out", tmp_path / "o", src, ok=False)
    assert p.returncode == 2 and f"c.jsonl:3: " in p.stderr and words in p.stderr, p.stderr
    assert "--bad-rows skip" in p.stderr and "Traceback" not in p.stderr
    assert not list(tmp_path.glob("o.*"))
    p = run(*flags, "--out", tmp_path / "k", "--bad-rows", "skip", src)
    m, docs = read_output(tmp_path / "k")
    assert m["skipped_rows"] == {kind: 1} and len(docs) == 3
    assert "skipped" in p.stderr and "c.jsonl:3" in p.stderr and f"1 {kind.replace('_', ' ')}" in p.stdout


def test_no_template_is_named_and_a_plain_pair_needs_none(tmp_path):
    qwen = ROOT / "tests" / "golden" / "hf" / "qwen3-tied"
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}])
    p = run("--tokenizer", qwen, "--out", tmp_path / "o", "--workers", 1, src, ok=False)
    assert p.returncode == 2 and "no chat template" in p.stderr and "--chat-template" in p.stderr
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "The dog", "completion": " sleeps."}])
    run("--tokenizer", qwen, "--out", tmp_path / "p", "--workers", 1, src)
    m, docs = read_output(tmp_path / "p")
    ids, mask = docs[0]
    assert ids[0] == 1 and ids[-1] == 2 and mask[0] == 0 and mask[-1] == 1 and 0 < sum(mask) < len(mask)
    assert m["rows"]["prompt_completion"] == 1


def test_the_date_of_a_template_follows_source_date_epoch(monkeypatch):
    special = {"bos_token": "<s>"}
    t = chat_data.ChatTemplate("{{ strftime_now('%Y-%m-%d') }}", special)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")
    assert t.render([])[0] == "1970-01-01"


def test_a_template_cannot_leave_the_sandbox():
    t = chat_data.ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}", {})
    with pytest.raises(chat_data.RowError) as e:
        t.render([])
    assert e.value.kind == "render_failed"
    t = chat_data.ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(chat_data.RowError):
        t.render([])


def render_row(text, row, limits=None, loss_mask="auto"):
    tok = tokenizers.Tokenizer.from_file(str(CHAT / "tokenizer.json"))
    template = chat_data.ChatTemplate(text, {"bos_token": "<s>"}, limits)
    return chat_data.RowEncoder(tok, template, loss_mask, 1, 2).encode(row)


LIMITED = chat_data.TemplateLimits(seconds=1.0, max_output=1 << 20)
OVER_LIMITS = [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "--template-seconds"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "writes more than"),
    ("{{ 'x' * 3000000000 }}", "larger than"),
    ("{{ 'x'.ljust(3000000000) }}", "larger than"),
    ("{{ 7 ** 7 ** 7 ** 7 }}", "larger than"),
    ("{{ '%3000000000d' % 1 }}", "width"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "larger than"),
    ("{% macro f(s, n) %}{{ f(s ~ s, n - 1) if n else s | length }}{% endmacro %}{{ f('x', 40) }}", "larger than"),
]


@pytest.mark.parametrize("text,words", OVER_LIMITS)
def test_a_template_runs_within_its_time_and_output_limits(text, words):
    with pytest.raises(chat_data.RowError) as e:
        render_row(text, {"messages": CONVERSATIONS[0]}, LIMITED)
    assert e.value.kind == "template_limit" and words in str(e.value)


def test_a_template_constant_over_the_limit_is_refused_as_it_compiles():
    with pytest.raises(chat_data.RowError) as e:
        chat_data.ChatTemplate("{{ 'x' | center(3000000000) }}", {}, LIMITED)
    assert "larger than" in str(e.value)


@pytest.mark.parametrize("text,kind", [("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "render_failed"),
                                       ("", "no_target")])
def test_a_recursive_or_empty_template_is_a_bad_row(text, kind):
    with pytest.raises(chat_data.RowError) as e:
        render_row(text, {"messages": CONVERSATIONS[0]})
    assert e.value.kind == kind


def test_an_empty_prompt_or_completion_is_an_example():
    ids, mask = render_row("", {"prompt": "", "completion": ""})
    assert ids == [1, 2] and list(mask) == [0, 1]  # BOS, then the EOS as the one target
    ids, mask = render_row("", {"prompt": "The dog", "completion": ""})
    assert list(mask) == [0] * (len(ids) - 1) + [1]


def test_a_template_is_read_from_a_regular_file_only(tmp_path):
    fifo = tmp_path / "t.jinja"
    os.mkfifo(fifo)
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}])
    p = run("--tokenizer", CHAT, "--workers", 1, "--chat-template", fifo, "--out", tmp_path / "o", src, ok=False)
    assert p.returncode == 2 and "not a regular file" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_the_limits_are_flags_checked_and_a_row_over_them_is_skipped_and_counted(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}] * 2)
    slow = tmp_path / "t.jinja"
    slow.write_text("{% if messages | length > 0 %}{% for i in range(100000) %}{% for j in range(100000) %}"
                    "{% endfor %}{% endfor %}{% endif %}")
    p = run("--tokenizer", CHAT, "--workers", 1, "--chat-template", slow, "--template-seconds", "0.5",
            "--bad-rows", "skip", "--out", tmp_path / "o", src)
    assert read_output(tmp_path / "o")[0]["skipped_rows"] == {"template_limit": 2}
    for flag, value in (("--template-seconds", "0"), ("--template-seconds", "nan"), ("--template-max-output", "0")):
        p = run("--tokenizer", CHAT, flag, value, "--out", tmp_path / "x", src, ok=False)
        assert p.returncode == 2 and flag in p.stderr and "Traceback" not in p.stderr
    p = run("--help")
    assert "--template-seconds" in p.stdout and "default 30" in p.stdout
