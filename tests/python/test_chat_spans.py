"""The assistant spans of a chat template without {% generation %} blocks, found by markers in
a number of renderings that does not grow with the turns (chat_data._marked_spans), against
the spans found from the renderings of each turn's prefixes (chat_data._prefix_span), on the
fixture's templates and on templates in the styles of real model families
(tests/python/chat_templates).

run: python3 -m pytest tests/python/test_chat_spans.py
"""
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "tests" / "golden" / "hf" / "llama-chat"
FAMILIES = Path(__file__).resolve().parent / "chat_templates"

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
from upipe_tools import chat_data  # noqa: E402

TEMPLATES = sorted(CHAT.glob("templates/*.jinja")) + sorted(FAMILIES.glob("*.jinja"))
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


def turns(n, pad=False, system=True):
    """A conversation of n user/assistant pairs (contents padded with spaces where `pad`)."""
    out = [{"role": "system", "content": "Be brief."}] if system else []
    for k in range(n):
        p = "  " if pad and k % 2 else ""
        out += [{"role": "user", "content": f"{p}Question {k}: what is {k} + {k}?{p}"},
                {"role": "assistant", "content": f"{p}It is {2 * k}.{p}"}]
    return out


def fixture_rows():
    rows = [json.loads(line) for line in (CHAT / "chat.jsonl").read_text().splitlines()]
    return [r for r in rows if "messages" in r]


TOOL_ROW = {"messages": [{"role": "user", "content": "Add 2 and 3."},
                         {"role": "assistant", "content": "Adding.", "tool_calls": [
                             {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                         {"role": "tool", "content": "5"}, {"role": "assistant", "content": "The sum is 5."},
                         {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "You're welcome."}],
            "tools": [{"type": "function", "function": {"name": "add"}}]}
ROWS = fixture_rows() + [
    {"messages": turns(4)}, {"messages": turns(5, pad=True)}, {"messages": turns(3, system=False)},
    {"messages": turns(3, pad=True, system=False)}, TOOL_ROW,
    {"messages": turns(3, system=False), "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": turns(3, system=False)[:-1] + [{"role": "assistant", "content": "<think>\nsum\n</think>\n\n4."}]},
    {"messages": [dict(m, reasoning_content="why") if m["role"] == "assistant" else m for m in turns(3)]},
    {"messages": turns(3) + [{"role": "user", "content": "last"}]},
]


def padded(n=6):
    """n user/assistant pairs whose contents have leading or trailing whitespace of every kind
    (none in the first answer, whitespace alone in one, whitespace that the template's own
    text ends with in others), no system message (Gemma refuses one)."""
    answers = ["It is 0.", "\n\nIt is 1.", "It is 2.\n", " \t It is 3. \n ", "   ", "", "\nIt is 6.", "It is 7."]
    out = []
    for k in range(n):
        out += [{"role": "user", "content": f" Question {k}?\n" if k % 2 else f"Question {k}?"},
                {"role": "assistant", "content": answers[k % len(answers)]}]
    return out


PADDED = [{"messages": padded()}, {"messages": padded(8)}, {"messages": padded(8)[2:]},
          {"messages": turns(4, pad=True, system=False)}, {"messages": turns(3, system=False)}]
ROWS += PADDED


# the templates where the prefixes place several rows (Phi-3 writes EOS after the last turn alone,
# Qwen3 thinks in the last turn alone, Gemma refuses a system message): the markers must place them
MARKABLE = ("chatml.jinja", "headers.jinja", "reasoning.jinja", "llama3.jinja", "qwen2.jinja", "mistral.jinja",
            "gemma.jinja")


def encoder(text):
    tok = tokenizers.Tokenizer.from_file(str(CHAT / "tokenizer.json"))
    template = chat_data.ChatTemplate(text, SPECIAL)
    return chat_data.RowEncoder(tok, template, "auto", 1, 2), template


def outcome(rows, row):
    try:
        ids, mask = rows.encode(row)
        return ids, list(mask)
    except chat_data.RowError as e:
        return e.kind


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_markers_give_the_prefix_methods_tokens_and_mask(path, monkeypatch):
    rows, template = encoder(path.read_text())
    marked = 0
    for row in ROWS:
        monkeypatch.setattr(chat_data, "MARKED_TURNS", 1 << 30)  # the prefixes alone
        want = outcome(rows, row)
        monkeypatch.setattr(chat_data, "MARKED_TURNS", 0)  # the markers first
        assert outcome(rows, row) == want, (path.name, row)
        if isinstance(want, tuple) and not template.has_generation:
            messages = chat_data._messages(row["messages"], "messages")
            template.start_row()
            text, _ = template.render(messages, tools=row.get("tools"), kwargs=row.get("chat_template_kwargs"))
            turns_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            spans = chat_data._marked_spans(template, messages, turns_at, text, row.get("tools"),
                                            row.get("chat_template_kwargs"))
            marked += spans is not None
    if path.name in MARKABLE:
        assert marked >= 3, path.name  # the markers, not the fallback, placed the rows


class Counting(chat_data.ChatTemplate):
    def render(self, *args, **kwargs):
        self.renders += 1
        return super().render(*args, **kwargs)


def test_ten_thousand_turns_take_a_constant_number_of_renderings():
    tok = tokenizers.Tokenizer.from_file(str(CHAT / "tokenizer.json"))
    plain = Counting((CHAT / "templates" / "chatml.jinja").read_text(), SPECIAL)
    tagged = chat_data.ChatTemplate((CHAT / "templates" / "chatml_generation.jinja").read_text(), SPECIAL)
    row = {"messages": turns(5000)}
    plain.renders = 0
    ids, mask = chat_data.RowEncoder(tok, plain, "auto", 1, 2).encode(row)
    assert plain.renders <= 6
    # the generation blocks of the same template mark the same tokens, in one rendering
    assert (ids, mask) == chat_data.RowEncoder(tok, tagged, "auto", 1, 2).encode(row)
    assert sum(1 for t in range(len(mask)) if mask[t] and (t == 0 or not mask[t - 1])) == 5000


def marked_spans(template, row):
    messages = chat_data._messages(row["messages"], "messages")
    template.start_row()
    text, _ = template.render(messages, tools=row.get("tools"), kwargs=row.get("chat_template_kwargs"))
    at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return chat_data._marked_spans(template, messages, at, text, row.get("tools"), row.get("chat_template_kwargs"))


TRIM = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}<|end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("text", [(FAMILIES / "llama3.jinja").read_text(), (FAMILIES / "gemma.jinja").read_text(),
                                  TRIM, TRIM.replace("| trim", "| trim | trim")],
                         ids=["llama3", "gemma", "trim", "trim_twice"])
def test_a_template_that_trims_contents_takes_the_markers(text, monkeypatch):
    rows, template = encoder(text)
    for row in PADDED:
        monkeypatch.setattr(chat_data, "MARKED_TURNS", 1 << 30)  # the prefixes alone
        want = outcome(rows, row)
        assert isinstance(want, tuple) and any(want[1]), row
        monkeypatch.setattr(chat_data, "MARKED_TURNS", 0)
        assert marked_spans(template, row) is not None, row
        assert outcome(rows, row) == want, row


@pytest.mark.parametrize("filter_", ["upper", "reverse"])
def test_a_template_that_changes_contents_falls_back_to_the_prefixes(filter_, monkeypatch):
    text = TRIM.replace("trim", filter_)
    rows, template = encoder(text)
    row = {"messages": turns(4, pad=True)}
    assert marked_spans(template, row) is None
    got = outcome(rows, row)
    monkeypatch.setattr(chat_data, "MARKED_TURNS", 1 << 30)
    assert got == outcome(rows, row) and isinstance(got, tuple) and any(got[1])


def test_ten_thousand_turns_of_a_trimming_template_take_a_constant_number_of_renderings():
    tok = tokenizers.Tokenizer.from_file(str(CHAT / "tokenizer.json"))
    text = (FAMILIES / "llama3.jinja").read_text()
    plain = Counting(text, SPECIAL)
    # the same template with the assistant turn (from the generation prompt on) in a generation block
    turn = "{%- elif message['role'] in ['tool', 'ipython'] %}"
    assert turn in text
    tagged = chat_data.ChatTemplate(text.replace(turn, (
        "{%- elif message['role'] == 'assistant' %}\n"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% generation %}"
        "{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}\n" + turn)), SPECIAL)
    row = {"messages": turns(5000, pad=True)}
    plain.renders = 0
    ids, mask = chat_data.RowEncoder(tok, plain, "auto", 1, 2).encode(row)
    assert plain.renders <= 6
    assert (ids, mask) == chat_data.RowEncoder(tok, tagged, "auto", 1, 2).encode(row)
    assert sum(1 for t in range(len(mask)) if mask[t] and (t == 0 or not mask[t - 1])) == 5000
