"""Tokenizes documents, instruction pairs and conversations into upipe's training files
(`upipe prepare-data` runs this).

usage: upipe prepare-data --tokenizer MODEL_DIR --out PREFIX [options] INPUT...

Inputs
------
Each INPUT is a file or a folder. Folders are walked recursively; names starting with "."
(files and folders) are skipped, and the files are taken in path order (compared folder
name by folder name, by Unicode code point). A file's kind comes from its name:

  *.jsonl, *.jsonl.gz  one JSON object per line; blank lines are skipped. A line with
                       "messages", or with "prompt" and "completion", is an example
                       (chat_data.py describes them); any other holds a document in the
                       string field named by --text-field (default "text"). A line that
                       is not an object, or is neither, is an error naming file and line
  *.parquet            a Parquet file as Hugging Face datasets write it, read in
                       row-group batches: examples where it has a "messages" column (or
                       "prompt" and "completion"), else documents in the string column
                       --text-field
  *.json, other *.gz   refused (convert to .jsonl or .jsonl.gz)
  anything else        plain UTF-8 text (.txt, .md, ...): the whole file is ONE document,
                       byte for byte (no newline translation, no BOM stripping); also in
                       a folder of dataset files (a README.md there is a document too:
                       a note on stderr says so)

Documents and examples are numbered in input order from 0 (their "ordinal"), every one
read counting, empty ones included.

Tokens
------
The tokenizer is MODEL_DIR/tokenizer.json, loaded with Hugging Face `tokenizers`. A
document's tokens are `encode(text, add_special_tokens=False).ids`, with the BOS id put
before them and/or the EOS id after them:
- the ids: tokenizer_config.json's "bos_token"/"eos_token" (a string, or an object with
  "content"), looked up in the vocabulary; else config.json's "bos_token_id"/
  "eos_token_id" (the first one where it is a list); else the token the tokenizer's
  post-processor puts before (BOS) or after (EOS) a sample text;
- whether they are added (--bos/--eos auto, the default): BOS where tokenizer_config.json's
  "add_bos_token" says so, else where `encode(sample, add_special_tokens=True)` puts a
  token before the sample's own ids; EOS wherever there is an EOS id, so that packed
  documents are separated even where the tokenizer adds none. --bos yes|no and
  --eos yes|no override this.
A document with no tokens of its own (the empty string, say) counts as an "empty
document"; it is written as a document of just BOS and/or EOS where those are added, and
is skipped otherwise. A conversation's tokens are its chat template's, with nothing added
(templates write their own BOS and EOS); a plain prompt/completion pair gets BOS and EOS
as a document does.

Loss mask
---------
Where an example makes some of its tokens not targets (--loss-mask auto, the default:
the assistant turns of a conversation, the completion of a pair; chat_data.py says
exactly which tokens), PREFIX.mask holds one byte per token, 1 for a target; the tokens of
plain documents are all targets. --loss-mask all makes every token a target (no mask). A
row that is not an example (no assistant turn, an unknown role, a template that fails to
render it, text with a lone surrogate, ...) is an error naming the file and line or row, or
with --bad-rows skip is left out, named on stderr (the first five of each reason) and counted
in the manifest.

A chat template is code from the model's folder, so it runs with limits: only a regular
file is read (never a FIFO), of at most 16 MiB; one row's renderings together may take
--template-seconds (default 30), and a rendering may write, or make as one value (a string,
a repeat count, a width), at most --template-max-output characters (default 2^26). A row
over a limit is a bad row like any other, and a template that cannot be read is an error.

Output
------
PREFIX.tokens, PREFIX.index, PREFIX.json and PREFIX.mask, as corpus_writer.py describes.
With --heldout-fraction F > 0 the held-out documents go to PREFIX-heldout.* (the same
files, "split": "heldout"), the others to PREFIX.*. With the seed S (an integer in
[0, 2^64)), document ordinal i is held out when

    h = splitmix64(splitmix64(S) XOR i)   and   (h >> 11) < ceil(F * 2^53)

where F * 2^53 is computed exactly (F is the IEEE double given; this is the same as the
exact real comparison (h >> 11) < F * 2^53), and splitmix64, all modulo 2^64, is
    x += 0x9E3779B97F4A7C15; z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB;
    return z ^ (z >> 31).
So the split depends only on the seed and the order of the input, not on --workers,
--bos or --eos. Documents keep their input order within each split. With F = 0 (the
default) no held-out files are written (--overwrite removes stale ones of the same
PREFIX). Existing outputs are refused unless --overwrite. The run is deterministic: the
same inputs and options give byte-identical files for any --workers.

Encoding runs in --workers processes (default: every core this process may use), each
loading the tokenizer once and encoding batches of about --batch-bytes of text, one
thread each; the main process reads, hands out batches and writes results in input
order. A tqdm progress bar (input bytes, text MB, documents/s) goes to stderr when it is
a terminal, or always with --progress.

Errors print one line "prepare_data: error: ..." ("upipe: error: prepare-data: ..." when
`upipe prepare-data` runs it) on stderr and exit with status 2. The last line on stdout
sums up the run: documents, tokens, MB of text, seconds, MB/s, and the share of targets
where there is a mask.
"""
import argparse
import gzip
import hashlib
import json
import math
import os
import signal
import sys
import time
import zlib

from . import chat_data, error_line, program
from .corpus_writer import SplitWriter
from .prepare_encode import Consumer, PrepareError, encode_all, quiet_tokenizers_threads  # noqa: F401

FORMAT = "upipe-tokens"
VERSION = 1
SAMPLE_TEXT = "Hello world, this is a sample."
DEFAULT_BATCH_BYTES = 1 << 20
MAX_WORKERS_PER_CORE = 4
MAX_BATCH_DOCS = 4096
M64 = (1 << 64) - 1


# ----------------------------------------------------------------------------- split hash

def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class Splitter:
    """Decides, from (seed, ordinal) alone, whether a document is held out."""

    def __init__(self, fraction, seed):
        self.key = splitmix64(seed & M64)
        # fraction * 2^53 is exact in double precision; for an integer h, h < x <=> h < ceil(x).
        self.threshold = math.ceil(fraction * (1 << 53))

    def heldout(self, ordinal):
        if self.threshold == 0:
            return False
        return (splitmix64(self.key ^ ordinal) >> 11) < self.threshold


# ----------------------------------------------------------------------------- inputs

def input_kind(path):
    name = os.path.basename(path).lower()
    if name.endswith(".jsonl.gz"):
        return "jsonl.gz"
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".json") or name.endswith(".json.gz"):
        raise PrepareError(f"input '{path}' is a .json file, which is not read: give JSON Lines "
                           f"(.jsonl or .jsonl.gz, one object per line), Parquet, or plain text")
    if name.endswith(".gz"):
        raise PrepareError(f"input '{path}' is gzip-compressed, which is read only for JSON Lines "
                           f"(.jsonl.gz): decompress it, or convert it to .jsonl.gz")
    return "text"


def expand_inputs(inputs):
    """The files to read, in order, as (path, kind)."""
    files = []
    for given in inputs:
        if os.path.isdir(given):
            found = []
            for root, dirs, names in os.walk(given):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                for n in names:
                    if n.startswith("."):
                        continue
                    full = os.path.join(root, n)
                    if os.path.isfile(full):
                        rel = os.path.relpath(full, given)
                        found.append((tuple(rel.split(os.sep)), full))
            if not found:
                raise PrepareError(f"input folder '{given}' holds no files (names starting with '.' "
                                   f"are skipped): give a folder with text, .jsonl or .parquet files")
            found.sort()
            kinds = [(full, input_kind(full)) for _, full in found]
            texts = [full for full, kind in kinds if kind == "text"]
            if texts and len(texts) < len(kinds):
                shown = ", ".join(f"'{t}'" for t in texts[:3]) + (", ..." if len(texts) > 3 else "")
                print(f"prepare_data: note: folder '{given}' mixes dataset files with {len(texts)} other "
                      f"file(s) ({shown}), each of which is read as one plain-text document",
                      file=sys.stderr)
            files.extend(kinds)
        elif os.path.isfile(given):
            files.append((given, input_kind(given)))
        elif os.path.exists(given):
            raise PrepareError(f"input '{given}' is neither a regular file nor a folder: give a text, "
                               f".jsonl, .jsonl.gz or .parquet file, or a folder of them")
        else:
            raise PrepareError(f"input '{given}' does not exist: give a text, .jsonl, .jsonl.gz or "
                               f".parquet file, or a folder of them")
    return files


def utf8_len(text, where):
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise PrepareError(f"{where}: the text is not valid Unicode ({e.reason} at character "
                           f"{e.start}; lone surrogates cannot be tokenized)") from None


def read_text_file(path):
    """Yields (text, text_bytes, input_bytes) for the file's one document."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise PrepareError(f"cannot read input '{path}': {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PrepareError(f"{path}: not UTF-8 text (bad byte at offset {e.start}); plain-text inputs "
                           f"must be UTF-8, datasets must be .jsonl, .jsonl.gz or .parquet") from None
    yield text, len(raw), len(raw)


def describe_json_type(v):
    return chat_data.describe_value(v, "array")


def read_jsonl(path, field, compressed):
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise PrepareError(f"cannot read input '{path}': {e.strerror}") from None
    with raw:
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if compressed else raw
        lineno = 0
        last = 0
        try:
            for line in stream:
                lineno += 1
                pos = raw.tell()
                consumed, last = pos - last, pos
                if not line.strip():
                    if consumed:
                        yield None, 0, consumed
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise PrepareError(f"{where}: not a valid JSON line ({e}); each line must be one "
                                       f"JSON object such as {{\"{field}\": \"...\"}}") from None
                except RecursionError:
                    raise PrepareError(f"{where}: the JSON nests deeper than Python reads; each line must be "
                                       f"one JSON object such as {{\"{field}\": \"...\"}}") from None
                if not isinstance(obj, dict):
                    raise PrepareError(f"{where}: the line is {describe_json_type(obj)}, not a JSON "
                                       f"object such as {{\"{field}\": \"...\"}}")
                if chat_data.row_kind(obj) is not None:
                    yield (where, obj), chat_data.row_text_bytes(obj), consumed
                    continue
                if field not in obj:
                    keys = ", ".join(f"'{k}'" for k in list(obj)[:20]) or "none"
                    raise PrepareError(f"{where}: no field '{field}' (the line has: {keys}), nor 'messages' "
                                       f"or 'prompt' and 'completion'; choose the text field with --text-field")
                text = obj[field]
                if not isinstance(text, str):
                    raise PrepareError(f"{where}: field '{field}' is {describe_json_type(text)}, "
                                       f"not a string")
                yield text, utf8_len(text, where), consumed
        except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:  # zlib.error: a corrupt deflate stream
            raise PrepareError(f"{path}: cannot read line {lineno + 1}: {e} (is the file damaged?)") from None


def read_parquet(path, field):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(f"reading '{path}' needs pyarrow: pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise PrepareError(f"{path}: not a readable Parquet file ({e})") from None
    with pf:
        schema = pf.schema_arrow
        names = schema.names
        example = chat_data.row_kind({n: None for n in names})
        columns = [field]
        if example is not None:  # examples: their columns, and the optional ones beside them
            wanted = ["messages"] if example == "messages" else ["prompt", "completion"]
            columns = wanted + [n for n in ("tools", "chat_template_kwargs") if n in names]
        elif field not in names:
            cols = ", ".join(f"'{n}'" for n in names) or "none"
            raise PrepareError(f"{path}: the Parquet file has no column '{field}' (its columns: "
                               f"{cols}), nor 'messages' or 'prompt' and 'completion'; choose the text "
                               f"column with --text-field")
        else:
            check_string_column(pa, path, field, schema.field(field).type)
        size = os.path.getsize(path)
        total_rows = max(pf.metadata.num_rows, 1)
        row = 0
        reported = 0
        try:
            for batch in pf.iter_batches(batch_size=1024, columns=columns, use_threads=False):
                values = batch.to_pylist() if example is not None else batch.column(0).to_pylist()
                for value in values:
                    where = f"{path}: row {row}"
                    row += 1
                    target = size * row // total_rows
                    consumed, reported = target - reported, target
                    if example is not None:
                        yield (where, value), chat_data.row_text_bytes(value), consumed
                        continue
                    if value is None:
                        raise PrepareError(f"{where}: column '{field}' is null, not a string")
                    yield value, utf8_len(value, where), consumed
        except (pa.ArrowException, OSError) as e:  # OSError: a corrupt page (snappy, zstd, ...)
            raise PrepareError(f"{path}: cannot read row {row}: {e} (is the file damaged?)") from None
        except UnicodeDecodeError as e:
            raise PrepareError(f"{path}: row {row}: column '{field}' is not valid UTF-8 (bad byte at offset "
                               f"{e.start}); the file is damaged or was written without checking its strings") from None


def check_string_column(pa, path, field, ftype):
    string_types = [pa.types.is_string, pa.types.is_large_string]
    if hasattr(pa.types, "is_string_view"):
        string_types.append(pa.types.is_string_view)
    if not any(t(ftype) for t in string_types):
        raise PrepareError(f"{path}: column '{field}' holds {ftype}, not strings; choose the text "
                           f"column with --text-field")


def read_documents(files, field):
    """Yields (item, text_bytes, input_bytes): item a document's text, a row (where, object) of an
    example, or None for input consumed without a document."""
    for path, kind in files:
        if kind == "text":
            yield from read_text_file(path)
        elif kind == "parquet":
            yield from read_parquet(path, field)
        else:
            yield from read_jsonl(path, field, kind == "jsonl.gz")


def batches(docs, batch_bytes):
    """Groups documents into lists of about batch_bytes of text: (items, text_bytes, input_bytes)."""
    texts, nbytes, consumed, size = [], [], 0, 0
    for text, tb, ib in docs:
        consumed += ib
        if text is None:
            continue
        texts.append(text)
        nbytes.append(tb)
        size += tb
        if size >= batch_bytes or len(texts) >= MAX_BATCH_DOCS:
            yield texts, nbytes, consumed
            texts, nbytes, consumed, size = [], [], 0, 0
    if texts or consumed:
        yield texts, nbytes, consumed


# ----------------------------------------------------------------------------- tokenizer

def load_tokenizer(model_dir):
    if not os.path.isdir(model_dir):
        raise PrepareError(f"--tokenizer '{model_dir}' is not a folder: give a model folder holding "
                           f"tokenizer.json (a Hugging Face model directory)")
    path = os.path.join(model_dir, "tokenizer.json")
    if os.path.lexists(path) and not os.path.isfile(path):
        raise PrepareError(f"--tokenizer '{model_dir}': its tokenizer.json is not a regular file (a folder, a FIFO, "
                           f"a symbolic link loop or a link to nothing); put the tokenizer's file there")
    if not os.path.isfile(path):
        raise PrepareError(f"--tokenizer '{model_dir}' has no tokenizer.json: give a model folder "
                           f"saved with a fast (Hugging Face tokenizers) tokenizer")
    from tokenizers import Tokenizer
    try:
        with open(path, "rb") as f:
            data = f.read()
        tok = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises plain Exception on a bad file
        raise PrepareError(f"cannot load '{path}' with tokenizers: {e}") from None
    return tok, hashlib.sha256(data).hexdigest()


def check_vocab_size(n):
    if n > (1 << 32):
        raise PrepareError(f"the tokenizer's vocabulary has {n} tokens, more than the 2^32 that uint32 "
                           f"token files can hold; use a tokenizer with at most 4294967296 tokens")
    return n


def read_json_object(path):
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, "rb") as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:
        raise PrepareError(f"cannot read '{path}' as JSON: {e}") from None
    if not isinstance(obj, dict):
        raise PrepareError(f"'{path}' does not hold a JSON object")
    return obj


def token_content(value):
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def wrapper_ids(tok):
    """The ids the post-processor puts before and after a sample's own ids."""
    plain = tok.encode(SAMPLE_TEXT, add_special_tokens=False).ids
    full = tok.encode(SAMPLE_TEXT, add_special_tokens=True).ids
    n = len(plain)
    for k in range(len(full) - n + 1):
        if full[k:k + n] == plain:
            return full[:k], full[k + n:]
    return [], []


def resolve_special(model_dir, tok, vocab_size, bos_opt, eos_opt):
    """Decides BOS/EOS ids and whether to add them; returns a dict and a line explaining it."""
    tcfg_path = os.path.join(model_dir, "tokenizer_config.json")
    cfg_path = os.path.join(model_dir, "config.json")
    tcfg = read_json_object(tcfg_path)
    cfg = read_json_object(cfg_path)
    before, after = wrapper_ids(tok)
    out = {}
    notes = []
    for name, opt, wrap in (("bos", bos_opt, before), ("eos", eos_opt, after)):
        tid, source = None, None
        content = token_content(tcfg.get(f"{name}_token"))
        if content is not None:
            tid = tok.token_to_id(content)
            if tid is None:
                raise PrepareError(f"{tcfg_path}: {name}_token '{content}' is not in the tokenizer's "
                                   f"vocabulary; fix the file or pass --{name} no")
            source = f"tokenizer_config.json {name}_token"
        if tid is None and cfg.get(f"{name}_token_id") is not None:
            v = cfg[f"{name}_token_id"]
            if isinstance(v, list) and v:
                v = v[0]
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < vocab_size:
                raise PrepareError(f"{cfg_path}: {name}_token_id {cfg[f'{name}_token_id']!r} is not a "
                                   f"token id below the vocabulary size {vocab_size}; fix the file or "
                                   f"pass --{name} no")
            tid, source = v, f"config.json {name}_token_id"
        wrap_id = (wrap[0] if name == "bos" else wrap[-1]) if wrap else None
        if tid is None and wrap_id is not None:
            tid, source = wrap_id, "tokenizer post-processor"
        key = f"add_{name}_token"
        if opt == "yes":
            add, why = True, f"--{name} yes"
        elif opt == "no":
            add, why = False, f"--{name} no"
        elif name == "eos":  # packed documents need a separator whatever the tokenizer adds
            add, why = tid is not None, "auto: a separator between packed documents" if tid is not None else \
                "auto: the tokenizer has no EOS"
        elif isinstance(tcfg.get(key), bool):
            add, why = tcfg[key], f"tokenizer_config.json {key}"
        else:
            add, why = bool(wrap), "tokenizer post-processor"
        if add and tid is None:
            raise PrepareError(f"{why} asks for a {name.upper()} token, but the tokenizer has none "
                               f"(no {name}_token in tokenizer_config.json, no {name}_token_id in "
                               f"config.json, none from the post-processor); pass --{name} no")
        if add and opt == "auto" and wrap_id is not None and wrap_id != tid:
            print(f"prepare_data: note: the post-processor adds id {wrap_id} where {source} names "
                  f"{name.upper()} id {tid}; using {tid}", file=sys.stderr)
        out[f"{name}_id"] = tid
        out[f"add_{name}"] = add
        shown = f"id {tid} ({tok.id_to_token(tid)!r}, from {source})" if tid is not None else "none"
        notes.append(f"{name.upper()} {shown}: {'added' if add else 'not added'} ({why})")
    return out, "; ".join(notes)


# ----------------------------------------------------------------------------- main

def default_workers():
    if hasattr(os, "process_cpu_count"):
        n = os.process_cpu_count()
    elif hasattr(os, "sched_getaffinity"):
        n = len(os.sched_getaffinity(0))
    else:
        n = os.cpu_count()
    return max(1, n or 1)


class ArgumentParser(argparse.ArgumentParser):
    """Bad flags end as every other error does: one error line and status 2."""

    def error(self, message):
        raise PrepareError(f"{message}; see --help")


def parse_args(argv):
    p = ArgumentParser(
        prog=program("prepare_data", "prepare-data"),
        description="Tokenize documents into upipe token files (PREFIX.tokens, PREFIX.index, PREFIX.json).",
        epilog="The file format is described at the top of the module (from a checkout: "
               "PYTHONPATH=python python3 -m pydoc upipe_tools.prepare_data).")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text files (one document each), folders (recursed), .jsonl, .jsonl.gz, .parquet")
    p.add_argument("--tokenizer", required=True, metavar="MODEL_DIR",
                   help="model folder holding tokenizer.json (and tokenizer_config.json, config.json)")
    p.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.tokens, PREFIX.index, PREFIX.json")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="JSONL field / Parquet column holding the text (default: text)")
    p.add_argument("--bos", choices=("yes", "no", "auto"), default="auto",
                   help="put BOS before each document (default auto: as the tokenizer's config says)")
    p.add_argument("--eos", choices=("yes", "no", "auto"), default="auto",
                   help="put EOS after each document (default auto: as the tokenizer's config says)")
    p.add_argument("--heldout-fraction", type=float, default=0.0, metavar="F",
                   help="fraction of documents for PREFIX-heldout.* (default 0: no held-out set)")
    p.add_argument("--seed", type=int, default=1, metavar="S", help="seed of the held-out split (default 1)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help=f"encoding processes (default: all cores, {default_workers()} here)")
    p.add_argument("--batch-bytes", type=int, default=DEFAULT_BATCH_BYTES, metavar="B",
                   help=f"text per batch handed to a worker (default {DEFAULT_BATCH_BYTES})")
    p.add_argument("--loss-mask", choices=("auto", "all"), default="auto",
                   help="the targets: auto (assistant turns of 'messages' rows, the completion of prompt/completion "
                        "rows, every token of text) or all (every token)")
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="a Jinja chat template (default: the model directory's chat_template.jinja or "
                        "tokenizer_config.json's chat_template)")
    p.add_argument("--template-seconds", type=float, default=chat_data.DEFAULT_TEMPLATE_SECONDS, metavar="S",
                   help=f"the chat template's time on one row, all its renderings together (default "
                        f"{chat_data.DEFAULT_TEMPLATE_SECONDS:g}); a row over it is a bad row")
    p.add_argument("--template-max-output", type=int, default=chat_data.DEFAULT_TEMPLATE_OUTPUT, metavar="N",
                   help=f"the most characters the chat template may write for one rendering, or make as one value "
                        f"(default {chat_data.DEFAULT_TEMPLATE_OUTPUT}); a row over it is a bad row")
    p.add_argument("--bad-rows", choices=("error", "skip"), default="error",
                   help="a row that is not an example (no assistant turn, an unknown role, a template that fails "
                        "on it or passes its limits, text that is not Unicode): error (the default) or skip it, "
                        "counted in the manifest")
    p.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    a = p.parse_args(argv)
    if not a.heldout_fraction == a.heldout_fraction or not 0.0 <= a.heldout_fraction < 1.0:
        raise PrepareError(f"--heldout-fraction {a.heldout_fraction} is outside [0, 1): give e.g. 0.01 "
                           f"for 1% held out, or 0 for none")
    if not 0 <= a.seed <= M64:
        raise PrepareError(f"--seed {a.seed} is outside [0, 2^64): give e.g. --seed 1")
    if a.workers is None:
        a.workers = default_workers()
    if not 1 <= a.workers <= MAX_WORKERS_PER_CORE * default_workers():
        raise PrepareError(f"--workers {a.workers} must lie between 1 and {MAX_WORKERS_PER_CORE} per usable core "
                           f"({MAX_WORKERS_PER_CORE * default_workers()} here): each is a process that loads the "
                           f"tokenizer, and more than the cores only contend; give e.g. --workers {default_workers()}")
    if not 0 < a.template_seconds <= 86400:  # also refuses NaN
        raise PrepareError(f"--template-seconds {a.template_seconds} must lie in (0, 86400]: give e.g. "
                           f"--template-seconds {chat_data.DEFAULT_TEMPLATE_SECONDS:g}")
    if not 1 <= a.template_max_output <= 1 << 40:
        raise PrepareError(f"--template-max-output {a.template_max_output} must lie in [1, 2^40] characters: give "
                           f"e.g. --template-max-output {chat_data.DEFAULT_TEMPLATE_OUTPUT}")
    if a.batch_bytes < 1:
        raise PrepareError(f"--batch-bytes {a.batch_bytes} must be at least 1: give e.g. {DEFAULT_BATCH_BYTES}")
    if not a.text_field:
        raise PrepareError("--text-field is empty: give the field name, e.g. --text-field text")
    if not os.path.basename(a.out) or a.out.endswith(os.sep) or os.path.isdir(a.out):
        raise PrepareError(f"--out '{a.out}' names a folder: give a file prefix such as "
                           f"{os.path.join(a.out.rstrip(os.sep) or '.', 'corpus')}")
    return a


def check_outputs(prefixes, overwrite):
    for prefix in prefixes:
        for ext in (".tokens", ".index", ".json", ".mask"):
            path = prefix + ext
            if os.path.lexists(path) and not overwrite:
                raise PrepareError(f"output '{path}' already exists: pass --overwrite to replace it, "
                                   f"or choose another --out")
            if os.path.isdir(path):
                raise PrepareError(f"output '{path}' is a folder: choose another --out")


def make_progress(enabled, total):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        print("prepare_data: note: no progress bar without tqdm (pip install tqdm)", file=sys.stderr)
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="prepare-data",
                file=sys.stderr, dynamic_ncols=True, smoothing=0.1)


def _terminated(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the clean-up of temporary files


def chat_settings(a):
    """(template text or None, special token strings, --loss-mask) for the workers, and a line saying
    where the template comes from; also the manifest's fields for it."""
    try:
        text, source = chat_data.load_chat_template(a.tokenizer, a.chat_template)
    except (chat_data.RowError, ValueError) as e:
        raise PrepareError(str(e)) from None
    tcfg = read_json_object(os.path.join(a.tokenizer, "tokenizer_config.json"))
    special = chat_data.special_token_strings(tcfg)
    fields = {"loss_mask_rule": "every token" if a.loss_mask == "all" else
              "assistant turns of conversations, completions of prompt/completion rows, every token of text"}
    if text is not None:
        fields["chat_template_sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    line = f"chat template from {source}" if text is not None else "no chat template"
    limits = chat_data.TemplateLimits(a.template_seconds, a.template_max_output)
    return (text, special, a.loss_mask, limits), line, fields


def run(a):
    t0 = time.perf_counter()
    signal.signal(signal.SIGTERM, _terminated)
    quiet_tokenizers_threads()
    tok, sha = load_tokenizer(a.tokenizer)
    vocab_size = check_vocab_size(tok.get_vocab_size(with_added_tokens=True))
    special, explain = resolve_special(a.tokenizer, tok, vocab_size, a.bos, a.eos)
    chat, chat_line, chat_fields = chat_settings(a)
    files = expand_inputs(a.inputs)

    heldout = a.heldout_fraction > 0
    prefixes = [a.out] + ([a.out + "-heldout"] if heldout else [])
    check_outputs(prefixes, a.overwrite)
    folder = os.path.dirname(a.out)
    if folder:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise PrepareError(f"cannot create the output folder '{folder}': {e.strerror}") from None
    print(f"prepare_data: {len(files)} input file(s), {a.workers} worker(s); {explain}; {chat_line}",
          file=sys.stderr)

    bos_id = special["bos_id"] if special["add_bos"] else None
    eos_id = special["eos_id"] if special["add_eos"] else None
    common = {
        "format": FORMAT, "version": VERSION, "dtype": "uint32", "vocab_size": vocab_size,
        "tokenizer_sha256": sha, "tokenizer": a.tokenizer,
        "bos_id": special["bos_id"], "eos_id": special["eos_id"],
        "add_bos": special["add_bos"], "add_eos": special["add_eos"],
        "heldout_fraction": a.heldout_fraction, "seed": a.seed, "sources": list(a.inputs),
    }
    common.update(chat_fields)
    total_input = sum(os.path.getsize(p) for p, _ in files)
    bar = make_progress(a.progress or sys.stderr.isatty(), total_input)
    writers = []
    try:
        writers = [SplitWriter(p, s) for p, s in zip(prefixes, ("train", "heldout"))]
        consume = Consumer(writers, Splitter(a.heldout_fraction, a.seed), a.bad_rows, bar, t0)
        encode_all(a, batches(read_documents(files, a.text_field), a.batch_bytes), consume,
                   (a.tokenizer, bos_id, eos_id, chat))
        for w in writers:
            w.finish(common, {"skipped_rows": dict(sorted(consume.skipped.items()))})
        if not heldout and a.overwrite:
            for ext in (".tokens", ".index", ".json", ".mask"):
                stale = a.out + "-heldout" + ext
                if os.path.isfile(stale):
                    os.remove(stale)
                    print(f"prepare_data: removed stale '{stale}' (no held-out set this run)", file=sys.stderr)
        for w in writers:
            w.commit()
    except BaseException:
        for w in writers:
            w.discard()
        raise
    finally:
        if bar is not None:
            bar.close()
    summarize(a, writers, consume.skipped, time.perf_counter() - t0)
    return 0


def summarize(a, writers, skipped, seconds):
    docs = sum(w.documents for w in writers)
    tokens = sum(w.tokens for w in writers)
    text_mb = sum(w.text_bytes for w in writers) / 1e6
    split = ""
    if len(writers) > 1:
        split = (f" (train {writers[0].documents} documents, heldout {writers[1].documents} documents "
                 f"in {writers[1].prefix}.*)")
    if any(w.mask_f is not None for w in writers):
        targets = sum(w.targets for w in writers)
        split += f"; {targets} targets ({100.0 * targets / max(tokens, 1):.1f}% of the tokens) in the loss mask"
    if skipped:
        split += "; rows left out: " + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in sorted(skipped.items()))
    print(f"prepared {docs} documents, {tokens} tokens, {text_mb:.2f} MB of text in {seconds:.2f} s "
          f"({text_mb / max(seconds, 1e-9):.2f} MB/s) -> {a.out}.tokens{split}", flush=True)


def main(argv=None):
    try:
        return run(parse_args(argv))
    except PrepareError as e:
        fail(str(e))  # run by upipe (UPIPE_COMMAND), the line is upipe's own refusal line
        return 2
    except KeyboardInterrupt:
        print("prepare_data: interrupted; no output written", file=sys.stderr)
        return 130
    except MemoryError:
        fail("out of memory; no output written (fewer --workers, a smaller --batch-bytes, or shorter rows)")
        return 3


def fail(message):
    print(error_line("prepare_data", message), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
