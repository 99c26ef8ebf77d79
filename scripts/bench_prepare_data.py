#!/usr/bin/env python3
"""Data preparation speed: upipe prepare-data (upipe_tools.prepare_data) against a plain `tokenizers` loop.

usage: bench_prepare_data.py OUT_DIR [--tokenizer MODEL_DIR] [--mb 64] [--seed 0]
                             [--workers N] [--skip-one-worker]

Writes OUT_DIR/corpus.jsonl, a synthetic corpus of about --mb MB of text (documents of
lognormal length, 30 bytes to ~200 KB, mixing English-like prose, numbers, code, URLs,
CJK, Cyrillic, Greek, Devanagari, Arabic, emoji and combining accents), unless one of that
size is there already. Then measures, each in a fresh process, one after the other:
  (a) prepare_data.py --workers N (default: all cores) -> OUT_DIR/tokens.*, the time of the
      whole command (start-up, reading, encoding, writing);
  (b) the baseline a user would write: one process reading the JSONL with json.loads and
      calling `Tokenizer.encode_batch(texts, add_special_tokens=False)` on 1000 documents
      at a time (tokenizers' own thread pool on), the ids gathered into one uint32 array
      and written to a file; the time of the whole process as well;
  (c) prepare_data.py --workers 1, for scale (skipped with --skip-one-worker);
  (d) chat data against plain text (skipped with --skip-chat): OUT_DIR/chat.jsonl, about as
      much text as conversations (a system message now and then, one to four user and
      assistant turns of the same sentences), and prepare_data.py --workers N with the chat
      fixture's tokenizer (tests/golden/hf/llama-chat) on the plain corpus, on the
      conversations with its chat template (each assistant turn found by rendering the
      conversation's prefixes), and with the same template's {% generation %} twin (one
      rendering per conversation).
Prints MB/s of text for each and the ratios (a) / (b) and chat / plain, and writes the
numbers to OUT_DIR/bench_prepare_data.json. The two token counts of (a) and (b) are checked
against each other (prepare_data adds the BOS/EOS its manifest records).
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python"  # upipe_tools, run as upipe runs it: python3 -m upipe_tools.prepare_data
DEFAULT_TOKENIZER = ROOT / "tests" / "golden" / "hf" / "qwen3-tied"
CHAT_MODEL = ROOT / "tests" / "golden" / "hf" / "llama-chat"

BASELINE = r"""
import json, sys, time
from array import array
from tokenizers import Tokenizer
t0 = time.perf_counter()
tok = Tokenizer.from_file(sys.argv[1] + "/tokenizer.json")
ids = array("I")
docs = 0
nbytes = 0
def flush(texts):
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
with open(sys.argv[2], "rb") as f:
    texts = []
    for line in f:
        t = json.loads(line)["text"]
        nbytes += len(t.encode("utf-8"))
        texts.append(t)
        docs += 1
        if len(texts) == 1000:
            flush(texts)
            texts = []
    flush(texts)
with open(sys.argv[3], "wb") as f:
    ids.tofile(f)
print(json.dumps({"seconds_inside": time.perf_counter() - t0, "documents": docs, "tokens": len(ids),
                  "text_bytes": nbytes}))
"""

SYLLABLES = ["ka", "to", "ri", "men", "sa", "lo", "ve", "tra", "qui", "por", "est", "an", "el", "ung", "ber",
             "ion", "al", "ing", "th", "sch", "ou", "ea", "str", "pl", "ck"]
SCRIPTS = [
    "日本語のテキストと漢字", "中文文本处理和分词", "한국어 문장입니다", "Москва и Санкт-Петербург", "λόγος και αριθμός",
    "मानक हिन्दी पाठ", "النص العربي", "שלום עולם", "ภาษาไทย", "Ελληνικά", "Türkçe ğüşıöç", "Ünïcödé naïve café",
]
EMOJI = ["😀", "👍🏽", "🏳️‍🌈", "👩‍💻", "🎉", "🚀", "❤️", "🇯🇵", "🤖", "✨"]
COMBINING = ["e\u0301", "a\u0308", "n\u0303", "o\u0302\u0323", "u\u0306", "c\u0327"]
CODE = ["def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { s += a[i]; }\n",
        "SELECT id, name FROM users WHERE age > 30;\n", "{\"key\": [1, 2, 3], \"ok\": true}\n",
        "#include <vector>\nint main() { return 0; }\n"]


def make_sentences(rng, n):
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(4, 24)):
            r = rng.random()
            if r < 0.70:
                w = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
                parts.append(w.capitalize() if rng.random() < 0.1 else w)
            elif r < 0.78:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 9))))
            elif r < 0.88:
                parts.append(rng.choice(SCRIPTS))
            elif r < 0.93:
                parts.append(rng.choice(EMOJI))
            elif r < 0.97:
                parts.append("".join(rng.choice(COMBINING) for _ in range(rng.randint(1, 3))))
            else:
                parts.append(f"https://example.org/{rng.randint(0, 99999)}/page?q={rng.randint(0, 999)}")
        s = " ".join(parts) + rng.choice([".", ".", ".", "!", "?", "。", ":"])
        if rng.random() < 0.03:
            s += "\n" + rng.choice(CODE)
        out.append(s)
    return out


def make_corpus(path, mb, seed):
    target = int(mb * 1e6)
    rng = random.Random(seed)
    sentences = make_sentences(rng, 20000)
    total = docs = 0
    with open(path, "w", encoding="utf-8") as f:
        while total < target:
            size = min(int(rng.lognormvariate(7.5, 1.3)) + 30, 200_000)
            parts, n = [], 0
            while n < size:
                s = rng.choice(sentences)
                parts.append(s)
                n += len(s) + 1
                if rng.random() < 0.15:
                    parts.append("\n\n")
            text = " ".join(parts)
            f.write(json.dumps({"id": docs, "text": text}, ensure_ascii=False) + "\n")
            total += len(text.encode("utf-8"))
            docs += 1
    return total, docs


def make_chat_corpus(path, mb, seed):
    """Conversations of about `mb` MB of message text, from the plain corpus's sentences."""
    target = int(mb * 1e6)
    rng = random.Random(seed + 1)
    sentences = make_sentences(rng, 20000)
    total = rows = 0

    def content(mean):
        size = min(int(rng.lognormvariate(mean, 1.2)) + 10, 100_000)
        parts, n = [], 0
        while n < size:
            parts.append(rng.choice(sentences))
            n += len(parts[-1]) + 1
        return " ".join(parts)

    with open(path, "w", encoding="utf-8") as f:
        while total < target:
            messages = [{"role": "system", "content": content(4.0)}] if rng.random() < 0.3 else []
            for _ in range(rng.randint(1, 4)):
                messages += [{"role": "user", "content": content(6.5)}, {"role": "assistant", "content": content(6.0)}]
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
            total += sum(len(m["content"].encode("utf-8")) for m in messages)
            rows += 1
    return total, rows


def timed(cmd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(PACKAGE), os.environ.get("PYTHONPATH")) if p))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(map(str, cmd))}\n{p.stderr}")
    return seconds, p.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--mb", type=float, default=64.0, help="MB of text in the corpus (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=None, help="prepare_data --workers (default: all cores)")
    ap.add_argument("--skip-one-worker", action="store_true")
    ap.add_argument("--skip-chat", action="store_true", help="leave out (d), chat data against plain text")
    a = ap.parse_args()
    a.out_dir.mkdir(parents=True, exist_ok=True)
    corpus = a.out_dir / "corpus.jsonl"
    info = a.out_dir / "corpus.info.json"
    want = {"mb": a.mb, "seed": a.seed}
    if not (corpus.exists() and info.exists() and json.loads(info.read_text()).get("want") == want):
        t = time.perf_counter()
        text_bytes, docs = make_corpus(corpus, a.mb, a.seed)
        info.write_text(json.dumps({"want": want, "text_bytes": text_bytes, "documents": docs}))
        print(f"corpus: {docs} documents, {text_bytes / 1e6:.1f} MB of text ({time.perf_counter() - t:.1f} s to make)")
    meta = json.loads(info.read_text())
    text_mb = meta["text_bytes"] / 1e6
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = a.workers or cores

    # Read the corpus once so that every run finds it in the page cache.
    with open(corpus, "rb") as f:
        while f.read(1 << 24):
            pass

    def prepare(n, name, tokenizer=a.tokenizer, source=corpus, extra=()):
        seconds, out = timed([sys.executable, "-m", "upipe_tools.prepare_data", "--tokenizer", str(tokenizer), "--out",
                              str(a.out_dir / name), "--workers", str(n), "--overwrite", *extra, str(source)])
        manifest = json.loads((a.out_dir / (name + ".json")).read_text())
        return seconds, manifest, out.strip().splitlines()[-1]

    prep_s, manifest, summary = prepare(workers, "tokens")
    print(f"(a) prepare_data.py --workers {workers}: {prep_s:.2f} s, {text_mb / prep_s:.2f} MB/s   [{summary}]")

    base_s, out = timed([sys.executable, "-c", BASELINE, str(a.tokenizer), str(corpus),
                         str(a.out_dir / "baseline.tokens")])
    base = json.loads(out.strip().splitlines()[-1])
    print(f"(b) plain encode_batch, one process: {base_s:.2f} s, {text_mb / base_s:.2f} MB/s")

    extra = int(manifest["add_bos"]) + int(manifest["add_eos"])
    if base["documents"] != manifest["documents"] or base["tokens"] + extra * base["documents"] != manifest["tokens"]:
        sys.exit(f"token counts disagree: baseline {base}, prepare_data {manifest['documents']} documents "
                 f"{manifest['tokens']} tokens")

    one_s = None
    if not a.skip_one_worker and workers != 1:
        one_s, _, _ = prepare(1, "tokens-1")
        print(f"(c) prepare_data.py --workers 1: {one_s:.2f} s, {text_mb / one_s:.2f} MB/s")

    import tokenizers
    result = {
        "cores": cores, "workers": workers, "tokenizer": str(a.tokenizer),
        "tokenizers_version": tokenizers.__version__, "python": sys.version.split()[0],
        "corpus": {"path": str(corpus), "documents": meta["documents"], "text_mb": text_mb,
                   "file_mb": corpus.stat().st_size / 1e6, "tokens": base["tokens"]},
        "prepare_data": {"seconds": prep_s, "mb_per_s": text_mb / prep_s, "tokens": manifest["tokens"]},
        "baseline_encode_batch": {"seconds": base_s, "mb_per_s": text_mb / base_s,
                                  "seconds_inside": base["seconds_inside"]},
        "ratio": base_s / prep_s,
    }
    if one_s is not None:
        result["prepare_data_one_worker"] = {"seconds": one_s, "mb_per_s": text_mb / one_s}
    if not a.skip_chat:
        result["chat"] = chat_against_plain(a, corpus, text_mb, workers, prepare)
    (a.out_dir / "bench_prepare_data.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"ratio (a)/(b): {result['ratio']:.2f}x   -> {a.out_dir / 'bench_prepare_data.json'}")


def chat_against_plain(a, corpus, text_mb, workers, prepare):
    """(d): the chat fixture's tokenizer on the plain corpus and on as much chat text."""
    chat = a.out_dir / "chat.jsonl"
    info = a.out_dir / "chat.info.json"
    want = {"mb": a.mb, "seed": a.seed}
    if not (chat.exists() and info.exists() and json.loads(info.read_text()).get("want") == want):
        chat_bytes, rows = make_chat_corpus(chat, a.mb, a.seed)
        info.write_text(json.dumps({"want": want, "text_bytes": chat_bytes, "rows": rows}))
    meta = json.loads(info.read_text())
    chat_mb = meta["text_bytes"] / 1e6
    with open(chat, "rb") as f:
        while f.read(1 << 24):
            pass
    plain_s, _, _ = prepare(workers, "plain-chat-tokenizer", CHAT_MODEL)
    print(f"(d) plain text, the chat fixture's tokenizer: {plain_s:.2f} s, {text_mb / plain_s:.2f} MB/s")
    prefix_s, manifest, summary = prepare(workers, "chat", CHAT_MODEL, chat)
    print(f"    {meta['rows']} conversations, their template: {prefix_s:.2f} s, {chat_mb / prefix_s:.2f} MB/s "
          f"[{summary}]")
    tagged = CHAT_MODEL / "templates" / "chatml_generation.jinja"
    tagged_s, _, _ = prepare(workers, "chat-generation", CHAT_MODEL, chat, ("--chat-template", str(tagged)))
    print(f"    the same with {{% generation %}} blocks: {tagged_s:.2f} s, {chat_mb / tagged_s:.2f} MB/s")
    ratio = (chat_mb / prefix_s) / (text_mb / plain_s)
    print(f"chat / plain text: {ratio:.2f}x the MB/s (prefix renderings), "
          f"{(chat_mb / tagged_s) / (text_mb / plain_s):.2f}x (generation blocks)")
    return {"rows": meta["rows"], "text_mb": chat_mb, "targets": manifest["loss_mask"]["targets"],
            "tokens": manifest["tokens"], "plain_mb_per_s": text_mb / plain_s, "chat_mb_per_s": chat_mb / prefix_s,
            "chat_generation_mb_per_s": chat_mb / tagged_s, "ratio": ratio}


if __name__ == "__main__":
    main()
