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
  blocks to it, or use --loss-mask all. Those are two renderings per assistant turn, a cost
  that grows with the square of the turns, so a conversation of more than MARKED_TURNS
  assistant turns finds the same spans with markers in at most twelve renderings
  (_marked_spans, for templates that trim the contents too), and renders the prefixes
  only where the markers cannot show that their spans are the prefixes' (generation
  blocks render a row once).

Limits
------
A template is code from a model's folder: TemplateLimits bounds what it may take. A row's
renderings together run for at most `seconds` (an interval timer on the main thread, and a
check between the pieces a rendering yields), and no rendering writes, nor does any
operator, call, filter or namespace assignment make, a value longer than `max_output`
characters (or an integer beyond it, which would make one: a repeat count, a width).
Anything the template raises, RecursionError and MemoryError included, is the row's
RowError; a text with a lone surrogate (JSON allows one) is refused as "bad_unicode".
"""
import bisect
import json
import os
import re
import signal
import threading
import time

ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
DEFAULT_TEMPLATE_SECONDS = 30.0
DEFAULT_TEMPLATE_OUTPUT = 1 << 26  # characters
MAX_TEMPLATE_FILE = 1 << 24  # bytes
MARKED_TURNS = 2  # a conversation with more assistant turns than this finds them by markers


class RowError(Exception):
    """A row that cannot become a training example; str(e) says why (without the row's place) and
    `kind` names the reason in a word, as the manifest counts skipped rows."""

    def __init__(self, message, kind="bad_row"):
        super().__init__(message)
        self.kind = kind


# ----------------------------------------------------------------------------- the template

def _read_template_file(path, what):
    """A template file's text: a regular file (a FIFO would block the read) of at most MAX_TEMPLATE_FILE bytes."""
    if not os.path.isfile(path):
        kind = "does not exist" if not os.path.lexists(path) else "is not a regular file (a folder, a FIFO, a device or a broken link)"
        raise RowError(f"{what} '{path}' {kind}: give a Jinja template file", "no_template")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TEMPLATE_FILE + 1)
    except OSError as e:
        raise RowError(f"cannot read {what} '{path}': {e.strerror}", "no_template") from None
    if len(data) > MAX_TEMPLATE_FILE:
        raise RowError(f"{what} '{path}' is larger than {MAX_TEMPLATE_FILE} bytes, which no chat template needs: "
                       f"give the template itself", "no_template")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RowError(f"{what} '{path}' is not UTF-8 (bad byte at offset {e.start})", "no_template") from None


def load_chat_template(model_dir, override=None):
    """(template text or None, where it came from)."""
    if override is not None:
        return _read_template_file(override, "--chat-template"), override
    jinja_file = os.path.join(model_dir, "chat_template.jinja")
    if os.path.lexists(jinja_file):
        return _read_template_file(jinja_file, "the model's chat template"), jinja_file
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


class TemplateLimits:
    """What one row's renderings may take: `seconds` of time (all its renderings together) and
    `max_output` characters (of one rendering, and of any value the template makes on the way)."""

    def __init__(self, seconds=DEFAULT_TEMPLATE_SECONDS, max_output=DEFAULT_TEMPLATE_OUTPUT):
        self.seconds, self.max_output = seconds, max_output


class _OverLimit(BaseException):
    """Raised inside a rendering (by the alarm, or a value too large): not an Exception, so that
    nothing between the template and render() takes it for the template's own error."""


def _too_big(value, limit):
    """Whether a value the template hands on is longer than `limit`, or an integer that would
    make one (a width, a repeat count)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) > limit
    return isinstance(value, (str, list, tuple, dict)) and len(value) > limit


def _guarded(function, limits):
    import functools

    @functools.wraps(function)  # keeps jinja's marks (pass_environment, ...)
    def call(*args, **kwargs):
        _check_values(limits, args, kwargs.values())
        return function(*args, **kwargs)
    return call


def _check_values(limits, *groups):
    for group in groups:
        for v in group:
            if _too_big(v, limits.max_output):
                raise _OverLimit(f"the chat template makes a value larger than --template-max-output "
                                 f"{limits.max_output} characters")


def _environment(limits):
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
            _check_values(limits, (value,))  # a value doubled in a loop (ns.s ~ ns.s) stops at the limit
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

    class Environment(ImmutableSandboxedEnvironment):
        # A template's values are bounded before they are made: an operator, a call or a filter
        # with an operand beyond the output limit (a repeat count, a width, a long string) is
        # refused, since a C-level allocation of gigabytes is interrupted by no alarm.
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def call_binop(self, context, operator, left, right):
            limit = limits.max_output
            _check_values(limits, (left, right))
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
                    and abs(left) > 1 and right * abs(left).bit_length() > 8 * limit:
                raise _OverLimit(f"the chat template computes {left} ** {right}, a number beyond "
                                 f"--template-max-output {limit} characters")
            if operator == "%" and isinstance(left, str) and any(int(w) > limit for w in re.findall(r"\d+", left)):
                raise _OverLimit(f"the chat template formats a width beyond --template-max-output {limit} characters")
            value = self.binop_table[operator](left, right)
            _check_values(limits, (value,))
            return value

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            _check_values(limits, args, kwargs.values())
            value = ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs)
            _check_values(limits, (value,))
            return value

    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationSpans, jinja2.ext.loopcontrols])
    env.upipe_render = None
    env.filters["tojson"] = tojson
    env.filters = {name: _guarded(f, limits) for name, f in env.filters.items()}
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=MakeDict(),
                       namespace=Namespace)
    return env


class ChatTemplate:
    """A compiled chat template, the variables every rendering gets, and its limits. start_row()
    begins a row's time budget; each rendering after it spends from that budget."""

    def __init__(self, text, special_tokens, limits=None):
        import jinja2
        self.text = text
        self.special_tokens = dict(special_tokens)
        self.limits = limits or TemplateLimits()
        self.env = _environment(self.limits)
        try:
            self.template = self.env.from_string(text)
        except jinja2.exceptions.TemplateError as e:
            raise RowError(f"the chat template does not compile: {e}", "render_failed") from None
        except (RecursionError, MemoryError) as e:
            raise RowError(f"the chat template does not compile ({type(e).__name__})", "render_failed") from None
        except _OverLimit as e:  # a constant jinja folds as it compiles
            raise RowError(f"the chat template does not compile: {e}", "render_failed") from None
        self.has_generation = re.search(r"\{%-?\s*generation\s*-?%\}", text) is not None
        self.deadline = None

    def start_row(self):
        self.deadline = time.monotonic() + self.limits.seconds

    def render(self, messages, add_generation_prompt=False, tools=None, kwargs=None, track=False):
        """The rendered text, and with `track` the spans of its generation blocks."""
        variables = dict(self.special_tokens)
        variables.update(kwargs or {})
        variables.update(messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt)
        state = {"length": 0, "spans": []}
        self.env.upipe_render = state if track else None
        if self.deadline is None:
            self.start_row()
        try:
            with _Alarm(self.deadline, self.timeout_message()):
                return self._generate(variables, state), state["spans"]
        except _OverLimit as e:
            raise RowError(str(e), "template_limit") from None
        except Exception as e:  # noqa: BLE001 (any failure of the template's code is the row's)
            raise RowError(_render_failure(e), "render_failed") from None
        finally:
            self.env.upipe_render = None

    def _generate(self, variables, state):
        limit, deadline = self.limits.max_output, self.deadline
        pieces = []
        for piece in self.template.generate(**variables):
            pieces.append(piece)
            state["length"] += len(piece)
            if state["length"] > limit:
                raise _OverLimit(f"the chat template writes more than --template-max-output {limit} characters")
            if time.monotonic() > deadline:  # also checked here where no alarm can ring (another thread)
                raise _OverLimit(self.timeout_message())
        return "".join(pieces)

    def timeout_message(self):
        why = "" if self.has_generation else (" (without {% generation %} blocks, where markers around the assistant "
                                               "contents cannot place the turns, each one renders the conversation's "
                                               "prefix, so a long one costs the square of its turns: add the blocks, "
                                               "or raise the limit)")
        return f"the chat template runs longer than --template-seconds {self.limits.seconds:g} s on it{why}"


def _render_failure(e):
    import jinja2
    if isinstance(e, jinja2.exceptions.TemplateError):
        return f"the chat template fails to render it: {e}"
    detail = f": {e}" if not isinstance(e, (RecursionError, MemoryError)) else ""
    return f"the chat template fails to render it ({type(e).__name__}{detail})"[:2000]


class _Alarm:
    """Interrupts the Python code of a rendering at `deadline` (the main thread only: elsewhere
    render() checks the time between the pieces it takes)."""

    def __init__(self, deadline, message):
        self.deadline, self.message = deadline, message
        self.armed = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")

    def __enter__(self):
        if self.armed:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise _OverLimit(self.message)
            self.previous = signal.signal(signal.SIGALRM, self._ring)
            signal.setitimer(signal.ITIMER_REAL, remaining)
        return self

    def _ring(self, signum, frame):
        raise _OverLimit(self.message)

    def __exit__(self, *exc):
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
        return False


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
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(turns) > MARKED_TURNS:  # the prefixes cost 1 + 2 * turns renderings, the markers at most 12
        spans = _marked_spans(template, messages, turns, text, tools, kwargs)
        if spans is not None:
            return text, spans
    return text, [_prefix_span(template, messages, i, text, tools, kwargs) for i in turns]


def _prefix_span(template, messages, i, text, tools, kwargs):
    """Assistant turn i's span from the renderings of its prefixes (see the module's notes)."""
    before = _render_prefix(template, messages, i, tools, kwargs)
    through, _ = template.render(messages[:i + 1], tools=tools, kwargs=kwargs)
    if not (through.startswith(before) and text.startswith(through)):
        raise RowError(f"the chat template renders message {i} (an assistant turn) differently inside the "
                       f"whole conversation than after its prefix, so its tokens cannot be told apart; give "
                       f"the template {{% generation %}} blocks (--chat-template FILE), or --loss-mask all",
                       "template_rewrites_turns")
    return _trimmed(through, len(before), len(through))


def _marked_spans(template, messages, turns, text, tools, kwargs):
    """The spans _prefix_span gives every turn, in a number of renderings that does not grow with
    the turns, or None where this cannot be shown (the caller then renders the prefixes).

    The conversation is rendered once more with each assistant content's markers inside its
    own leading and trailing whitespace (see _marked_contents); with the markers taken out,
    that rendering must be `text` itself, which places each content (less that whitespace, which
    a template that trims drops) in `text`. The first turn's prefixes then give what the
    template writes between the generation prompt and the content (`lead`) and between the
    content and the end of the turn (`tail`). A template may write each content's whitespace or
    trim it, so every turn must show around its content the same lead and tail, less the first
    content's whitespace and with its own, or the same lead and tail as they are: each reading
    (of either side) whose text agrees at every turn gives a list of spans (_edge_options), and
    the prefixes of the last turn, and of any turn where the lists still differ, pick the one."""
    contents = _marked_contents(messages, turns, text)
    if contents is None:
        return None
    nonce, marked, pads = contents
    try:
        marked_text, _ = template.render(marked, tools=tools, kwargs=kwargs)
    except RowError as e:
        if e.kind == "template_limit":
            raise
        return None
    del marked, contents  # a long content is held by `text` and `marked_text` alone from here
    places = _unmark(marked_text, text, nonce, len(turns))
    del marked_text
    if places is None:
        return None
    first = turns[0]
    before = _render_prefix(template, messages, first, tools, kwargs)
    through, _ = template.render(messages[:first + 1], tools=tools, kwargs=kwargs)
    start, end = places[0]
    if not (through.startswith(before) and text.startswith(through) and len(before) <= start <= end <= len(through)):
        return None
    lead, tail = text[len(before):start], text[end:len(through)]
    del before, through
    begins = _edge_options(text, [s for s, _ in places], [p for p, _ in pads], lead, after=False)
    stops = _edge_options(text, [e for _, e in places], [p for _, p in pads], tail, after=True)
    options = []
    for b in begins:
        for s in stops:
            spans = [_trimmed(text, x, y) for x, y in zip(b, s)]
            if spans not in options:
                options.append(spans)
    return _confirmed(template, messages, turns, text, tools, kwargs, options)


def _edge_options(text, bounds, pads, seen, after):
    """The distinct lists of where each turn's span begins (after=False: `bounds` are the
    contents' starts in `text`, `pads` their leading whitespace, `seen` the first turn's lead)
    or ends (after=True: the contents' ends, their trailing whitespace, the first turn's tail),
    read as a template that trims each content's whitespace and as one that writes it, where
    the text around every turn's content agrees with that reading."""
    options = []
    for writes in (False, True):
        own = pads[0] if writes else ""
        if not (seen.startswith(own) if after else seen.endswith(own)):
            continue
        fixed = seen[len(own):] if after else seen[:len(seen) - len(own)]  # the template's own text
        edges = []
        for at, pad in zip(bounds, pads):
            around = (pad if writes else "") + fixed if after else fixed + (pad if writes else "")
            edge = at + len(around) if after else at - len(around)
            if edge < 0 or not text.startswith(around, at if after else edge):
                break
            edges.append(edge)
        else:
            if edges not in options:
                options.append(edges)
    return options


def _confirmed(template, messages, turns, text, tools, kwargs, options):
    """The one of `options` (lists of every turn's span) whose span of the last turn, and of each
    turn where the options left differ, is the prefixes' (_prefix_span); else None."""
    k = len(turns) - 1
    while options:
        span = _prefix_span(template, messages, turns[k], text, tools, kwargs)
        options = [spans for spans in options if spans[k] == span]
        if len(options) <= 1:
            break  # each round leaves out at least one of at most four options
        k = next(j for j, span in enumerate(options[0]) if any(spans[j] != span for spans in options))
    return options[0] if len(options) == 1 else None


def _marked_contents(messages, turns, text):
    """(nonce, messages with markers around each assistant content, [(leading, trailing)
    whitespace of each]), or None where an assistant turn has no string content (a tool call
    alone, a list of parts). The markers go inside the whitespace (as str.strip, and so
    jinja's trim, takes it), so that a template that trims the content trims the same."""
    if any(not isinstance(messages[i].get("content"), str) for i in turns):
        return None
    nonce = f"\x00{os.urandom(12).hex()}:"
    if nonce in text:  # never, short of an attack on os.urandom
        return None
    marked, pads = list(messages), []
    for k, i in enumerate(turns):
        content = messages[i]["content"]
        begin = len(content) - len(content.lstrip())  # strip returns the string itself where it has
        end = len(content.rstrip()) if begin < len(content) else begin  # no such whitespace: no copy
        pads.append((content[:begin], content[end:]))
        marked[i] = dict(messages[i], content=f"{pads[-1][0]}{nonce}{k}<{content[begin:end]}{nonce}{k}>{pads[-1][1]}")
    return nonce, marked, pads


def _unmark(marked_text, text, nonce, count):
    """[(start, end)] of the k-th marked content in `text` for k < count, where `marked_text`
    less its markers (each found once, in order) is `text`; else None."""
    places, at, done = [], 0, 0  # marked_text[at:] is text[done:] with markers
    for k in range(count):
        bounds = []
        for side in "<>":
            marker = f"{nonce}{k}{side}"
            found = marked_text.find(marker, at)
            if found < 0 or not _same(marked_text, at, text, done, found - at):
                return None
            done += found - at
            at = found + len(marker)
            bounds.append(done)
        places.append(tuple(bounds))
    rest = len(marked_text) - at
    return places if rest == len(text) - done and _same(marked_text, at, text, done, rest) else None


def _same(a, a_at, b, b_at, n, piece=1 << 20):
    """a[a_at:a_at + n] == b[b_at:b_at + n], a piece at a time (no copy of a long text)."""
    for k in range(0, n, piece):
        if not b.startswith(a[a_at + k:a_at + min(n, k + piece)], b_at + k):
            return False
    return True


def mask_of(offsets, spans):
    """1 for each token whose characters overlap a span (spans in order), else 0."""
    starts = [b for b, _ in offsets]
    ends = [e for _, e in offsets]
    mask = bytearray(len(offsets))
    if ends != sorted(ends):  # tokens out of order (never seen): token by token
        for t, (begin, end) in enumerate(offsets):
            mask[t] = any(end > a and begin < b for a, b in spans)
        return mask
    for a, b in spans:  # the tokens that end after a and start before b (an empty span has none)
        if b <= a:
            continue
        lo, hi = bisect.bisect_right(ends, a), bisect.bisect_left(starts, b)
        mask[lo:hi] = b"\x01" * max(0, hi - lo)
    return mask


def mask_of_encoding(enc, spans):
    """mask_of for a tokenizers Encoding, asking only for the tokens at the spans' ends (the
    whole offset list costs a Python tuple a token); the offsets where a character is in no token."""
    n = len(enc.ids)
    mask = bytearray(n)
    for a, b in spans:
        if b <= a:  # an empty span (an empty completion, say) holds no token
            continue
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


def _check_unicode(text):
    """Refuses a text the tokenizer cannot take: one with a lone surrogate (JSON allows "\\ud800")."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RowError(f"its text is not valid Unicode ({e.reason} at character {e.start}: a lone surrogate, "
                       f"which JSON's \\u escapes allow and no tokenizer takes)", "bad_unicode") from None


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
        if self.template is not None:
            self.template.start_row()
        example = self._render(obj)
        _check_unicode(example.text)
        return example

    def _render(self, obj):
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
