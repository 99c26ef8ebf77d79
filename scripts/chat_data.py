"""Instruction and chat rows for prepare_data.py: chat templates rendered as transformers'
`apply_chat_template` renders them, and the per-token loss mask of each example.

Rows
----
  {"messages": [{"role": ..., "content": ...}, ...], "tools": [...]?, "chat_template_kwargs": {...}?}
      a conversation, rendered with the model's chat template; by default the targets are
      the assistant turns (each with the end-of-turn text the template writes after it)
  {"prompt": "...", "completion": "..."}
      plain text: the tokens of prompt + completion (with BOS before and EOS after as the
      run adds them to documents); by default the targets are the completion and the EOS
  {"prompt": [messages], "completion": [messages]}
      a conversation as above, the targets everything after the prompt's generation prompt

Roles are those of ROLES; the template decides which of them it renders (a template that
raises an exception for a role makes the row fail to render). Keys whose value is null are
dropped from each message, and the reasoning fields are aliased, as transformers does.

The template
------------
MODEL_DIR/chat_template.jinja, else tokenizer_config.json's "chat_template" (a string, or a
list of {"name", "template"} of which "default" is taken), or --chat-template FILE. It runs
in a sandboxed Jinja environment set up as transformers sets up its own: trim_blocks and
lstrip_blocks, the loop controls, `raise_exception`, `strftime_now` (from
SOURCE_DATE_EPOCH when that is set, so that a run can be repeated byte for byte), a
`tojson` that does not escape HTML, and the variables messages, tools, documents (none),
add_generation_prompt, the tokenizer's special tokens (bos_token, eos_token, ...) and the
row's chat_template_kwargs. The rendered text is tokenized with add_special_tokens off: a
conversation is exactly the template's tokens, BOS and EOS included only where the
template writes them.

The mask
--------
A token is a target when its characters overlap a target span of the rendered text (the
rule transformers applies to `{% generation %}` spans). The spans are:
- the template's `{% generation %}` blocks, where it has them (as transformers'
  return_assistant_tokens_mask);
- otherwise, for each assistant message i, the text that rendering messages[:i + 1] adds
  to rendering messages[:i] with add_generation_prompt: the turn and its end-of-turn text,
  less trailing whitespace (a separator the model never generates). Every rendering must
  be a prefix of the next and of the whole conversation; a template that rewrites earlier
  turns (some drop the reasoning of past turns) is refused for that row: add generation
  blocks to it, or use --loss-mask all.
"""
import bisect
import json
import os
import time

ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class RowError(Exception):
    """A row that cannot become a training example; str(e) says why (without the row's place) and
    `kind` names the reason in a word, as the manifest counts skipped rows."""

    def __init__(self, message, kind="bad_row"):
        super().__init__(message)
        self.kind = kind


# ----------------------------------------------------------------------------- the template

def load_chat_template(model_dir, override=None):
    """(template text or None, where it came from)."""
    if override is not None:
        try:
            with open(override, encoding="utf-8") as f:
                return f.read(), override
        except (OSError, UnicodeDecodeError) as e:
            raise RowError(f"cannot read --chat-template '{override}': {e}", "no_template") from None
    jinja_file = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read(), jinja_file
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.isfile(cfg_path):
        return None, None
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    template = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return (template, cfg_path + " chat_template") if isinstance(template, str) else (None, None)


def special_token_strings(tokenizer_config):
    """The special tokens a template sees as variables: {"bos_token": "<s>", ...}."""
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = tokenizer_config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationSpans(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: records where its output lands in the text."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_record"), [], [], body).set_lineno(lineno)

        def _record(self, caller):
            text = caller()
            state = self.environment.upipe_render
            if state is not None:  # the output so far is state["length"] characters long
                state["spans"].append((state["length"], state["length"] + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        epoch = os.environ.get("SOURCE_DATE_EPOCH")
        return time.strftime(fmt, time.gmtime(int(epoch)) if epoch and epoch.isdigit() else time.localtime())

    class Namespace(jinja2.utils.Namespace):
        # No attribute a template sets may start with "_" (the way out of a sandbox).
        def __init__(*args, **kwargs):
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace._refuse(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._refuse(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _refuse(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a template may not set the attribute {name!r}")

    class MakeDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationSpans, jinja2.ext.loopcontrols])
    env.upipe_render = None
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=MakeDict(),
                       namespace=Namespace)
    return env


class ChatTemplate:
    """A compiled chat template and the variables every rendering gets."""

    def __init__(self, text, special_tokens):
        import jinja2
        import re
        self.text = text
        self.special_tokens = dict(special_tokens)
        self.env = _environment()
        try:
            self.template = self.env.from_string(text)
        except jinja2.exceptions.TemplateError as e:
            raise RowError(f"the chat template does not compile: {e}", "render_failed") from None
        self.has_generation = re.search(r"\{%-?\s*generation\s*-?%\}", text) is not None

    def render(self, messages, add_generation_prompt=False, tools=None, kwargs=None, track=False):
        """The rendered text, and with `track` the spans of its generation blocks."""
        import jinja2
        variables = dict(self.special_tokens)
        variables.update(kwargs or {})
        variables.update(messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt)
        state = {"length": 0, "spans": []}
        self.env.upipe_render = state if track else None
        pieces = []
        try:
            for piece in self.template.generate(**variables):
                pieces.append(piece)
                state["length"] += len(piece)
        except jinja2.exceptions.TemplateError as e:
            raise RowError(f"the chat template fails to render it: {e}", "render_failed") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as e:
            raise RowError(f"the chat template fails to render it ({type(e).__name__}: {e})", "render_failed") from None
        finally:
            self.env.upipe_render = None
        return "".join(pieces), state["spans"]


# ----------------------------------------------------------------------------- rows

def _messages(value, what):
    """A checked copy of a list of messages, as transformers hands them to the template."""
    if not isinstance(value, list) or not value:
        raise RowError(f"{what} must be a non-empty list of messages, not {describe_value(value)}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RowError(f"{what}[{i}] is {describe_value(m)}, not a message object with 'role' and 'content'")
        m = {k: v for k, v in m.items() if v is not None}
        role = m.get("role")
        if not isinstance(role, str):
            raise RowError(f"{what}[{i}] has no 'role' string")
        if role not in ROLES:
            raise RowError(f"{what}[{i}] has the unknown role '{role[:40]}'; the roles are {', '.join(ROLES)}",
                           "unknown_role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RowError(f"{what}[{i}] has content of {describe_value(content)}, not a string or a list of parts")
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def describe_value(v, sequence="list"):
    """A JSON value's kind for a message: "null", "a number", "an empty list", ... (a JSON
    array is named `sequence`: prepare-data's line checks say "array")."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        article = "an" if sequence[0] in "aeiou" else "a"
        return f"an empty {sequence}" if not v else f"{article} {sequence}"
    return "an object" if isinstance(v, dict) else type(v).__name__


def row_kind(obj):
    """'messages', 'prompt_completion' or None (a text row or not an example)."""
    if "messages" in obj:
        return "messages"
    if "prompt" in obj and "completion" in obj:
        return "prompt_completion"
    return None


def row_text_bytes(obj):
    """UTF-8 bytes of a row's text (the messages' string contents, or prompt and completion)."""
    total = 0
    stack = [obj.get("messages"), obj.get("prompt"), obj.get("completion")]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v.encode("utf-8", "surrogatepass"))
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.append(v.get("content"))
    return total


def _trimmed(text, begin, end):
    """[begin, end) less trailing whitespace, unless that leaves nothing."""
    stop = end
    while stop > begin and text[stop - 1].isspace():
        stop -= 1
    return (begin, stop if stop > begin else end)


def _render_prefix(template, messages, upto, tools, kwargs):
    """messages[:upto] with the generation prompt (the text before an assistant turn)."""
    return template.render(messages[:upto], add_generation_prompt=True, tools=tools, kwargs=kwargs)[0]


def assistant_spans(template, messages, tools, kwargs):
    """The rendered conversation and the character spans of its assistant turns."""
    if template.has_generation:
        return template.render(messages, tools=tools, kwargs=kwargs, track=True)
    text, _ = template.render(messages, tools=tools, kwargs=kwargs)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render_prefix(template, messages, i, tools, kwargs)
        through, _ = template.render(messages[:i + 1], tools=tools, kwargs=kwargs)
        if not (through.startswith(before) and text.startswith(through)):
            raise RowError(f"the chat template renders message {i} (an assistant turn) differently inside the "
                           f"whole conversation than after its prefix, so its tokens cannot be told apart; give "
                           f"the template {{% generation %}} blocks (--chat-template FILE), or --loss-mask all",
                           "template_rewrites_turns")
        spans.append(_trimmed(through, len(before), len(through)))
    return text, spans


def mask_of(offsets, spans):
    """1 for each token whose characters overlap a span (spans in order), else 0."""
    starts = [b for b, _ in offsets]
    ends = [e for _, e in offsets]
    mask = bytearray(len(offsets))
    if ends != sorted(ends):  # tokens out of order (never seen): token by token
        for t, (begin, end) in enumerate(offsets):
            mask[t] = any(end > a and begin < b for a, b in spans)
        return mask
    for a, b in spans:  # the tokens that end after a and start before b
        lo, hi = bisect.bisect_right(ends, a), bisect.bisect_left(starts, b)
        mask[lo:hi] = b"\x01" * max(0, hi - lo)
    return mask


def mask_of_encoding(enc, spans):
    """mask_of for a tokenizers Encoding, asking only for the tokens at the spans' ends (the
    whole offset list costs a Python tuple a token); the offsets where a character is in no token."""
    n = len(enc.ids)
    mask = bytearray(n)
    for a, b in spans:
        lo, hi = enc.char_to_token(a), enc.char_to_token(b - 1)
        if lo is None or hi is None:
            return mask_of(enc.offsets, spans)
        while lo > 0 and enc.token_to_chars(lo - 1)[1] > a:  # an earlier token shares character a
            lo -= 1
        while hi + 1 < n and enc.token_to_chars(hi + 1)[0] < b:  # a later one shares character b - 1
            hi += 1
        mask[lo:hi + 1] = b"\x01" * (hi + 1 - lo)
    return mask


class Example:
    """A row rendered: its text and the target spans in it (None: every token is a target),
    with BOS and EOS to put around its tokens (a plain pair's)."""

    def __init__(self, text, spans, bos=None, eos=None, why=""):
        self.text, self.spans, self.bos, self.eos, self.why = text, spans, bos, eos, why


class RowEncoder:
    """Turns rows into (ids, mask) in a worker, in two halves so that the texts of a batch are
    encoded together: render(row) -> Example, then finish(example, its encoding)."""

    def __init__(self, tok, template, loss_mask, bos_id, eos_id):
        self.tok = tok
        self.template = template
        self.all_targets = loss_mask == "all"
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode(self, obj):
        """One row's (ids, mask); mask None means every token is a target."""
        example = self.render(obj)
        return self.finish(example, self.tok.encode(example.text, add_special_tokens=False))

    def render(self, obj):
        kind = row_kind(obj)
        if kind == "messages":
            return self._conversation(_messages(obj["messages"], "'messages'"), None, obj)
        prompt, completion = obj["prompt"], obj["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            spans = None if self.all_targets else [(len(prompt), len(prompt) + len(completion))]
            return Example(prompt + completion, spans, self.bos_id, self.eos_id, "its completion has no tokens")
        if isinstance(prompt, list) and isinstance(completion, list):
            return self._conversation(_messages(prompt, "'prompt'") + _messages(completion, "'completion'"),
                                      len(prompt), obj)
        raise RowError(f"'prompt' and 'completion' must both be strings or both be lists of messages, not "
                       f"{describe_value(prompt)} and {describe_value(completion)}")

    def finish(self, example, enc):
        ids = list(enc.ids)
        mask = mask_of_encoding(enc, example.spans) if example.spans is not None else None
        if example.bos is not None:
            ids.insert(0, example.bos)
            if mask is not None:
                mask.insert(0, 0)
        if example.eos is not None:
            ids.append(example.eos)
            if mask is not None:
                mask.append(1)
        if mask is not None and not any(mask):
            raise RowError(f"no target: {example.why}", "no_target")
        return ids, mask

    def _conversation(self, messages, prompt_length, obj):
        if self.template is None:
            raise RowError("the model directory has no chat template (chat_template.jinja or tokenizer_config.json's "
                           "chat_template): pass --chat-template FILE", "no_template")
        tools = obj.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RowError(f"'tools' is {describe_value(tools)}, not a list of tool schemas")
        kwargs = obj.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise RowError(f"'chat_template_kwargs' is {describe_value(kwargs)}, not an object")
        if prompt_length is None and not any(m["role"] == "assistant" for m in messages):
            if not self.all_targets:
                raise RowError("it has no assistant turn, so no token is a target (use --loss-mask all to train on "
                               "every token)", "no_assistant_turn")
        if self.all_targets:
            return Example(self.template.render(messages, tools=tools, kwargs=kwargs)[0], None)
        why = "no token of its assistant turns survives the template (are they empty?)"
        if prompt_length is None:
            return Example(*assistant_spans(self.template, messages, tools, kwargs), why=why)
        text, _ = self.template.render(messages, tools=tools, kwargs=kwargs)
        before = _render_prefix(self.template, messages, prompt_length, tools, kwargs)
        if not text.startswith(before):
            raise RowError("the chat template renders the prompt differently inside the whole conversation, so "
                           "the completion's tokens cannot be told apart; use --loss-mask all",
                           "template_rewrites_turns")
        return Example(text, [_trimmed(text, len(before), len(text))], why=why)
