"""Tests of upipe_tools.prepare_data (`upipe prepare-data`): token files against the tokenizer itself, the manifest,
the held-out split, determinism across --workers, and the error paths.

run: python3 -m pytest tests/python/test_prepare_data.py
"""
import gzip
import hashlib
import json
import os
import random
from fractions import Fraction
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QWEN = ROOT / "tests" / "golden" / "hf" / "qwen3-tied"
LLAMA = ROOT / "tests" / "golden" / "hf" / "llama-yarn-shards"

tokenizers = pytest.importorskip("tokenizers")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
np = pytest.importorskip("numpy")


from upipe_tools import prepare_data as pd  # noqa: E402
from tool_run import run_tool  # noqa: E402


def run(*args, ok=True):
    p = run_tool("prepare_data", *args, stdin=subprocess.DEVNULL, timeout=120)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def read_output(prefix):
    prefix = str(prefix)
    with open(prefix + ".json") as f:
        manifest = json.load(f)
    tokens = np.fromfile(prefix + ".tokens", dtype="<u4")
    offsets = np.fromfile(prefix + ".index", dtype="<u8")
    docs = [tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]
    return manifest, tokens, offsets, docs


def tokenizer(model_dir):
    return tokenizers.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def histogram(lengths):
    if not lengths:
        return {"edges": [1], "counts": []}
    n = max(lengths).bit_length()
    counts = [0] * n
    for x in lengths:
        k = 0
        while (1 << (k + 1)) <= x:
            k += 1
        counts[k] += 1
    return {"edges": [1 << k for k in range(n + 1)], "counts": counts}


# ----------------------------------------------------------------------------- the corpus

WORDS = ["the", "quick", "brown", "fox", "日本語", "中文字符", "한국어", "😀", "👍🏽", "🏳️‍🌈", "café",
         "e\u0301", "n\u0303", "a\u0308\u0323", "Москва", "λόγος", "मानक", "عربى", "12345", "\t", "\n", "  "]


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Inputs of every kind, and the documents they hold, in the order they are read."""
    rng = random.Random(7)
    d = tmp_path_factory.mktemp("corpus")
    docs = []

    def text_file(path, text):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8"))

    a = d / "a.txt"
    text_file(a, "Hello 世界, naïve café 😀👍🏽 e\u0301\r\nline two\n")
    docs.append(a.read_bytes().decode())
    long_line = words(rng, 40000)[:200_000] + "x" * 5000  # one 200 KB line, no newline
    lf = d / "long.md"
    text_file(lf, long_line)
    docs.append(long_line)
    empty = d / "empty.txt"
    text_file(empty, "")
    docs.append("")

    folder = d / "folder"
    entries = {"b/2.txt": words(rng, 30), "a.txt": words(rng, 5), "b/1.md": "# title\n\n" + words(rng, 50),
               "b-c.txt": "🏳️‍🌈", "z/empty": ""}
    for rel, text in entries.items():
        text_file(folder / rel, text)
    text_file(folder / ".hidden.txt", "must be skipped")
    text_file(folder / ".git" / "HEAD", "must be skipped too")
    for rel in ["a.txt", "b/1.md", "b/2.txt", "b-c.txt", "z/empty"]:  # component-wise order
        docs.append(entries[rel])

    jl_docs = [words(rng, rng.randint(0, 80)) for _ in range(60)] + ["", "中文 only", "\u00e9\u0301"]
    jl = d / "data.jsonl"
    with open(jl, "w", encoding="utf-8") as f:
        for i, t in enumerate(jl_docs):
            f.write(json.dumps({"id": i, "text": t}, ensure_ascii=(i % 2 == 0)) + "\n")
            if i == 10:
                f.write("\n")  # a blank line is skipped
    docs.extend(jl_docs)
    gz_docs = [words(rng, rng.randint(1, 40)) for _ in range(25)]
    gz = d / "more.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        for t in gz_docs:
            f.write(json.dumps({"text": t, "meta": {"x": 1}}) + "\n")
    docs.extend(gz_docs)

    pq_docs = [words(rng, rng.randint(0, 60)) for _ in range(70)] + ["", "😀" * 100]
    pqf = d / "train-00000-of-00001.parquet"
    table = pa.table({"id": list(range(len(pq_docs))), "text": pq_docs})
    pq.write_table(table, pqf, row_group_size=16)
    assert pq.ParquetFile(pqf).num_row_groups > 1
    docs.extend(pq_docs)

    inputs = [a, lf, empty, folder, jl, gz, pqf]
    return {"dir": d, "inputs": inputs, "docs": docs}


@pytest.fixture(scope="module")
def qwen_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "w2" / "corpus"
    p = run("--tokenizer", QWEN, "--out", out, "--workers", 2, "--batch-bytes", 4096, *corpus["inputs"])
    return out, p


# ----------------------------------------------------------------------------- tests

def test_every_document_matches_the_tokenizer(corpus, qwen_run):
    out, p = qwen_run
    manifest, tokens, offsets, docs = read_output(out)
    tok = tokenizer(QWEN)
    # BOS as the post-processor adds it, and EOS to separate packed documents
    expected = [[1] + tok.encode(t, add_special_tokens=False).ids + [2] for t in corpus["docs"]]
    assert len(docs) == len(expected)  # BOS is added, so empty documents are kept
    for i, (got, want) in enumerate(zip(docs, expected)):
        assert got == want, f"document {i}"
    assert offsets[0] == 0 and offsets[-1] == len(tokens)
    lengths = [len(x) for x in expected]
    texts = corpus["docs"]
    assert manifest == {
        "format": "upipe-tokens", "version": 1, "dtype": "uint32", "vocab_size": 256,
        "tokenizer_sha256": hashlib.sha256((QWEN / "tokenizer.json").read_bytes()).hexdigest(),
        "tokenizer": str(QWEN), "bos_id": 1, "eos_id": 2, "add_bos": True, "add_eos": True,
        "heldout_fraction": 0.0, "seed": 1, "sources": [str(x) for x in corpus["inputs"]],
        "documents": len(texts), "tokens": sum(lengths),
        "empty_documents": sum(1 for t in texts if t == ""),
        "text_bytes": sum(len(t.encode("utf-8")) for t in texts),
        "length_histogram": histogram(lengths),
        "min_length": 2, "max_length": max(lengths), "mean_length": sum(lengths) / len(lengths),
        "split": "train", "rows": {"text": len(texts), "messages": 0, "prompt_completion": 0}, "skipped_rows": {},
        "loss_mask_rule": "assistant turns of conversations, completions of prompt/completion rows, every token of text",
    }
    assert max(lengths) > 100_000  # the 200 KB line
    assert not Path(str(out) + "-heldout.json").exists()
    summary = p.stdout.strip().splitlines()[-1]
    assert f"{len(texts)} documents" in summary and f"{sum(lengths)} tokens" in summary and "MB/s" in summary
    assert "Traceback" not in p.stderr
    # nothing temporary is left behind
    assert sorted(os.listdir(out.parent)) == ["corpus.index", "corpus.json", "corpus.tokens"]


def test_one_worker_and_two_give_identical_files(corpus, qwen_run, tmp_path):
    out2, _ = qwen_run
    out1 = tmp_path / "w1"
    run("--tokenizer", QWEN, "--out", out1, "--workers", 1, *corpus["inputs"])
    for ext in (".tokens", ".index", ".json"):
        assert Path(str(out1) + ext).read_bytes() == Path(str(out2) + ext).read_bytes(), ext


def test_bos_eos_overrides_and_skipped_empty_documents(corpus, tmp_path):
    tok = tokenizer(LLAMA)
    texts = corpus["docs"]
    out = tmp_path / "eos"
    run("--tokenizer", LLAMA, "--out", out, "--workers", 2, "--bos", "no", "--eos", "yes", *corpus["inputs"])
    m, _, _, docs = read_output(out)
    assert docs == [tok.encode(t, add_special_tokens=False).ids + [2] for t in texts]
    assert (m["add_bos"], m["add_eos"], m["bos_id"], m["eos_id"]) == (False, True, 1, 2)

    out = tmp_path / "bare"
    run("--tokenizer", LLAMA, "--out", out, "--workers", 1, "--bos", "no", "--eos", "no", *corpus["inputs"])
    m, _, _, docs = read_output(out)
    kept = [t for t in texts if t != ""]
    assert docs == [tok.encode(t, add_special_tokens=False).ids for t in kept]
    assert m["documents"] == len(kept) and m["empty_documents"] == len(texts) - len(kept)
    assert m["text_bytes"] == sum(len(t.encode()) for t in texts)
    assert m["length_histogram"] == histogram([len(x) for x in docs])


def copy_tokenizer(tmp_path, name, tokenizer_config=None, config=None):
    d = tmp_path / name
    d.mkdir()
    shutil.copy(QWEN / "tokenizer.json", d / "tokenizer.json")
    if tokenizer_config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return d


def resolve(d, bos="auto", eos="auto"):
    tok, _ = pd.load_tokenizer(str(d))
    special, _ = pd.resolve_special(str(d), tok, tok.get_vocab_size(True), bos, eos)
    return special


def test_bos_eos_decisions(tmp_path):
    # The fixtures: ids from tokenizer_config.json, no add_*_token keys, so the post-processor
    # (TemplateProcessing "<s> $A") decides BOS: added; EOS separates packed documents: added.
    for d in (QWEN, LLAMA):
        assert resolve(d) == {"bos_id": 1, "eos_id": 2, "add_bos": True, "add_eos": True}
    # tokenizer.json alone: the BOS id comes from the post-processor, there is no EOS.
    bare = copy_tokenizer(tmp_path, "bare")
    assert resolve(bare) == {"bos_id": 1, "eos_id": None, "add_bos": True, "add_eos": False}
    with pytest.raises(pd.PrepareError, match="--eos no"):
        resolve(bare, eos="yes")
    # explicit keys win over the post-processor; token objects are understood; EOS is added
    # wherever there is one, even where the tokenizer's config says it adds none itself
    cfg = copy_tokenizer(tmp_path, "cfg", tokenizer_config={
        "add_bos_token": False, "add_eos_token": False,
        "bos_token": {"content": "<s>", "special": True}, "eos_token": {"content": "</s>"}})
    assert resolve(cfg) == {"bos_id": 1, "eos_id": 2, "add_bos": False, "add_eos": True}
    assert resolve(cfg, bos="yes", eos="no") == {"bos_id": 1, "eos_id": 2, "add_bos": True, "add_eos": False}
    # config.json ids (an EOS list takes its first) when tokenizer_config.json names none
    ids = copy_tokenizer(tmp_path, "ids", tokenizer_config={"add_eos_token": True},
                         config={"bos_token_id": 1, "eos_token_id": [2, 0]})
    assert resolve(ids) == {"bos_id": 1, "eos_id": 2, "add_bos": True, "add_eos": True}
    bad = copy_tokenizer(tmp_path, "bad", tokenizer_config={"eos_token": "<nope>"})
    with pytest.raises(pd.PrepareError, match="<nope>"):
        resolve(bad)


def splitmix64(x):
    # written from the module docstring's description, independently of the script
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_heldout_split(tmp_path):
    rng = random.Random(3)
    texts = [f"doc {i} " + words(rng, rng.randint(0, 12)) for i in range(400)] + [""]
    jl = tmp_path / "d.jsonl"
    jl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    tok = tokenizer(QWEN)
    encoded = [[1] + tok.encode(t, add_special_tokens=False).ids + [2] for t in texts]
    fraction = 0.3  # not a multiple of 2^-53: the comparison is exact all the same

    def split(name, seed, workers):
        out = tmp_path / name
        run("--tokenizer", QWEN, "--out", out, "--heldout-fraction", fraction, "--seed", seed,
            "--workers", workers, "--batch-bytes", 512, jl)
        train, held = read_output(out), read_output(str(out) + "-heldout")
        return out, train, held

    out_a, train_a, held_a = split("a", 5, 2)
    out_b, train_b, held_b = split("b", 5, 1)
    _, train_c, held_c = split("c", 6, 2)
    for ext in (".tokens", ".index", ".json"):  # same seed: the same files
        assert Path(str(out_a) + ext).read_bytes() == Path(str(out_b) + ext).read_bytes()
        assert Path(str(out_a) + "-heldout" + ext).read_bytes() == Path(str(out_b) + "-heldout" + ext).read_bytes()

    for seed, (train, held) in ((5, (train_a, held_a)), (6, (train_c, held_c))):
        key = splitmix64(seed)
        is_held = [Fraction(splitmix64(key ^ i) >> 11) < Fraction(fraction) * 2 ** 53 for i in range(len(texts))]
        assert train[3] == [e for e, h in zip(encoded, is_held) if not h]
        assert held[3] == [e for e, h in zip(encoded, is_held) if h]
        assert train[0]["documents"] + held[0]["documents"] == len(texts)
        assert train[0]["tokens"] + held[0]["tokens"] == sum(map(len, encoded))
        assert 80 < held[0]["documents"] < 160
        for m, s in ((train[0], "train"), (held[0], "heldout")):
            assert (m["split"], m["heldout_fraction"], m["seed"]) == (s, fraction, seed)
    assert held_a[3] != held_c[3]  # another seed, another split


def test_existing_output_is_refused(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text("some text")
    out = tmp_path / "o"
    run("--tokenizer", QWEN, "--out", out, "--workers", 1, src)
    before = Path(str(out) + ".tokens").read_bytes()
    src.write_text("other text, longer")
    p = run("--tokenizer", QWEN, "--out", out, "--workers", 1, src, ok=False)
    assert p.returncode == 2 and "already exists" in p.stderr and "--overwrite" in p.stderr
    assert "Traceback" not in p.stderr
    assert Path(str(out) + ".tokens").read_bytes() == before
    run("--tokenizer", QWEN, "--out", out, "--workers", 1, "--overwrite", src)
    assert Path(str(out) + ".tokens").read_bytes() != before
    # a held-out set is refused too when it exists
    run("--tokenizer", QWEN, "--out", tmp_path / "h", "--workers", 1, "--heldout-fraction", 0.5, src)
    for ext in (".tokens", ".index", ".json"):
        os.remove(tmp_path / ("h" + ext))
    p = run("--tokenizer", QWEN, "--out", tmp_path / "h", "--workers", 1, "--heldout-fraction", 0.5, src, ok=False)
    assert p.returncode == 2 and "h-heldout.tokens" in p.stderr


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "notok").mkdir()
    (d / "ok.txt").write_text("fine")
    (d / "broken.jsonl").write_text('{"text": "a"}\n{"text": "b"\n')
    (d / "nofield.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"content": "c", "id": 3}\n')
    (d / "number.jsonl").write_text('{"text": 5}\n')
    (d / "array.jsonl").write_text('["text"]\n')
    (d / "data.json").write_text('[{"text": "a"}]')
    (d / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (d / "empty_dir").mkdir()
    pq.write_table(pa.table({"content": ["a"], "id": [1]}), d / "nofield.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), d / "ints.parquet")
    (d / "fake.parquet").write_bytes(b"not parquet at all")
    return d


BAD = [
    # (arguments after the tokenizer, the words the message must hold)
    (["{d}/ok.txt"], "no tokenizer.json", "notok"),
    (["{d}/missing.txt"], "does not exist", None),
    (["{d}/broken.jsonl"], "broken.jsonl:2: not a valid JSON line", None),
    (["{d}/nofield.jsonl"], "nofield.jsonl:3: no field 'text' (the line has: 'content', 'id'), nor 'messages'", None),
    (["--text-field", "body", "{d}/ok.txt", "{d}/nofield.jsonl"], "nofield.jsonl:1: no field 'body'", None),
    (["{d}/number.jsonl"], "number.jsonl:1: field 'text' is a number", None),
    (["{d}/array.jsonl"], "array.jsonl:1: the line is an array", None),
    (["{d}/data.json"], "give JSON Lines", None),
    (["{d}/latin1.txt"], "not UTF-8 text (bad byte at offset 3)", None),
    (["{d}/empty_dir"], "holds no files", None),
    (["{d}/nofield.parquet"], "no column 'text' (its columns: 'content', 'id'), nor 'messages'", None),
    (["{d}/ints.parquet"], "column 'text' holds int64", None),
    (["{d}/fake.parquet"], "not a readable Parquet file", None),
    (["--heldout-fraction", "1.5", "{d}/ok.txt"], "--heldout-fraction 1.5 is outside [0, 1)", None),
    (["--workers", "0", "{d}/ok.txt"], "--workers 0 must lie between 1 and 4 per usable core", None),
    (["--seed", "-1", "{d}/ok.txt"], "--seed -1", None),
    (["--out", "{d}/", "{d}/ok.txt"], "names a folder", None),
]


@pytest.mark.parametrize("args,message,tokdir", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_input_exits_2_with_a_message(bad_inputs, args, message, tokdir, tmp_path):
    d = bad_inputs
    tok = d / tokdir if tokdir else QWEN
    args = [a.format(d=d) for a in args]
    if "--out" not in args:
        args = ["--out", str(tmp_path / "o")] + args
    p = run("--tokenizer", tok, "--workers", 1, *args, ok=False)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("prepare_data: error: ")
    assert not any(n.startswith("o.") or ".tmp-" in n for n in os.listdir(tmp_path))


def test_bad_jsonl_with_workers_leaves_nothing(bad_inputs, tmp_path):
    p = run("--tokenizer", QWEN, "--out", tmp_path / "o", "--workers", 2, bad_inputs / "ok.txt",
            bad_inputs / "nofield.jsonl", ok=False)
    assert p.returncode == 2 and "nofield.jsonl:3" in p.stderr and "Traceback" not in p.stderr
    assert os.listdir(tmp_path) == []


def test_vocabulary_above_uint32_is_refused():
    assert pd.check_vocab_size(1 << 32) == 1 << 32
    with pytest.raises(pd.PrepareError, match="2\\^32"):
        pd.check_vocab_size((1 << 32) + 1)


def test_progress_bar_on_request(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text("some text " * 100)
    p = run("--tokenizer", QWEN, "--out", tmp_path / "o", "--workers", 1, "--progress", src)
    assert "prepare-data" in p.stderr and "docs/s" in p.stderr
    p = run("--tokenizer", QWEN, "--out", tmp_path / "q", "--workers", 1, src)
    assert "docs/s" not in p.stderr  # stderr is a pipe here: no bar
