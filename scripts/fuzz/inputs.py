"""The files upipe reads, built and mutated for the fuzz corpus (scripts/fuzz/run.py).

Every mutator takes a random.Random and returns (what it did, the mutated thing), so that
a case names its mutation and a seed reproduces it. Standard library only.
"""
import base64
import gzip
import json
import os
import struct

# Integers and reals that break arithmetic: zero, negatives, the edges of 32 and 64 bits,
# products that overflow, non-numbers.
BAD_INTEGERS = [0, -1, -5, 1, 2, 3, 7, 2**31 - 1, 2**31, 2**32 + 4, 2**53 + 1, 2**61, 2**62, 2**63 - 1, 2**64,
                -(2**63), 10**30]
BAD_REALS = [0.0, -1.0, 1e-300, 1e300, -1e300, 3.5, 0.5, 1e-45]
BAD_JSON_VALUES = BAD_INTEGERS + BAD_REALS + ["text", "", None, [], {}, True, [4], {"a": 1}]

# Flag values: the same numbers as text, and text that is no number at all.
BAD_FLAG_NUMBERS = ["0", "-1", "-5", "1", "2", "2147483647", "2147483648", "4294967300", "9223372036854775807",
                    "9223372036854775808", "99999999999999999999", "18446744073709551616", "-9223372036854775809",
                    "1" + "0" * 40, "1e300", "-1e300", "1e-300", "nan", "-nan",
                    "inf", "-inf", "", " ", "abc", "3.5", "1K", "1M", "1024M", "2048M", "0x10", "010", "+3", "1e3",
                    "7e", "1,2", "--", "\u00b5"]


# ---------------------------------------------------------------------------------------
# safetensors

def read_safetensors(path):
    """(header dict, data bytes) of a safetensors file."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def safetensors_bytes(header, data, length=None):
    """A file from a header (dict, or text/bytes taken as they are) and a data section; `length`
    overrides the 8-byte header length."""
    if isinstance(header, dict):
        text = json.dumps(header).encode()
    elif isinstance(header, str):
        text = header.encode("utf-8", "surrogatepass")
    else:
        text = header
    return struct.pack("<Q", len(text) if length is None else length % 2**64) + text + data


def write_bytes(path, blob):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(blob)


def nested(depth, leaf="4"):
    return "[" * depth + leaf + "]" * depth


def tensor_names(header):
    return [k for k in header if k != "__metadata__"]


def poison_value(rng, header, data):
    """A NaN or an Inf written into one element of a float tensor."""
    name = rng.choice(tensor_names(header))
    t = header[name]
    begin, end = t["data_offsets"]
    size = {"F32": 4, "BF16": 2, "F16": 2}.get(t["dtype"])
    if size is None or end <= begin:
        return "nothing to poison", data
    element = rng.randrange((end - begin) // size)
    bits = {("F32", "nan"): struct.pack("<I", 0x7FC00000), ("F32", "inf"): struct.pack("<I", 0x7F800000),
            ("BF16", "nan"): struct.pack("<H", 0x7FC0), ("BF16", "inf"): struct.pack("<H", 0xFF80),
            ("F16", "nan"): struct.pack("<H", 0x7E00), ("F16", "inf"): struct.pack("<H", 0x7C00)}
    kind = rng.choice(["nan", "inf"])
    at = begin + element * size
    return f"{kind} in {name}[{element}]", data[:at] + bits[(t["dtype"], kind)] + data[at + size:]


def mutate_safetensors(rng, header, data):
    """One mutation of a safetensors file: (what, file bytes, names a refusal should mention)."""
    header = json.loads(json.dumps(header))
    names = tensor_names(header)
    name = rng.choice(names)
    kind = rng.choice(["dtype", "shape", "offsets", "length", "truncate", "junk", "header_text", "drop", "rename",
                       "metadata", "poison", "flip", "duplicate", "entry"])
    if kind == "dtype":
        v = rng.choice(["Q4", "F64", "I8", "BOOL", "", 7, None, ["F32"], "f32", "BF16", "F16", "F32", "F8_E4M3"])
        header[name]["dtype"] = v
        return f"{name}.dtype = {v!r}", safetensors_bytes(header, data), [name]
    if kind == "shape":
        v = rng.choice([[-1, 4], [2**62, 2], [2**63 - 1], "4", [], [0], [1] * 1000, [[4]], [4.5], [2**32, 2**32],
                        [2**64], ["4"], None, [1, -1], [3]])
        header[name]["shape"] = v
        return f"{name}.shape = {str(v)[:40]}", safetensors_bytes(header, data), [name]
    if kind == "offsets":
        n = len(data)
        v = rng.choice([[0, 2**60], [8, 4], [0], [], [-8, 0], [0, n + 1], [n, n], ["0", "4"], [0, 2**64 - 1],
                        [0, 2**64], [1, 1 + header[name]["data_offsets"][1] - header[name]["data_offsets"][0]],
                        None, [0.0, 4.0]])
        header[name]["data_offsets"] = v
        return f"{name}.data_offsets = {v}", safetensors_bytes(header, data), [name]
    if kind == "length":
        text = json.dumps(header).encode()
        v = rng.choice([0, 1, 7, len(text) - 1, len(text) + 1, len(text) + len(data) + 1, 2**63, 2**64 - 1,
                        100 << 20, (100 << 20) + 1])
        return f"header length {v}", safetensors_bytes(text, data, v), ["header length", "header"]
    if kind == "truncate":
        blob = safetensors_bytes(header, data)
        cut = rng.choice([0, 1, 7, 8, 9, len(blob) // 3, len(blob) - len(data), len(blob) - 1])
        return f"cut at byte {cut}", blob[:cut], ["truncated", "bytes", "header", "short"]
    if kind == "junk":
        extra = bytes(rng.randrange(256) for _ in range(rng.choice([1, 7, 4096])))
        return f"{len(extra)} bytes appended", safetensors_bytes(header, data) + extra, []
    if kind == "header_text":
        v = rng.choice(["[]", "1", '"x"', "{", '{"a": ', nested(100000, ""), "{" + '"k":{' * 5000 + "}" * 5001,
                        "\x00" * 16, '{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}\x00',
                        "\ud800", "null", json.dumps(header)[:-1]])
        return f"header text {v[:30]!r}", safetensors_bytes(v, data), ["header", "JSON", "tensor"]
    if kind == "drop":
        del header[name]
        return f"{name} removed", safetensors_bytes(header, data), [name.split(".")[-2] if "." in name else name]
    if kind == "rename":
        v = rng.choice(["", "__metadata__", "x" * 10000, "model.layers.99999999999999999999.mlp.up_proj.weight",
                        "model.layers.-1.mlp.up_proj.weight", "\u00e9\u00e8", "model.layers.7.x"])
        header[v] = header.pop(name)
        return f"{name} renamed {v[:30]!r}", safetensors_bytes(header, data), []
    if kind == "metadata":
        v = rng.choice([[], 1, {"a": 1}, {"a": None}, "x", {"format": "pt"}, {"k" * 1000: "v"}])
        header["__metadata__"] = v
        return f"__metadata__ = {str(v)[:30]}", safetensors_bytes(header, data), ["__metadata__"]
    if kind == "poison":
        what, data = poison_value(rng, header, data)
        return what, safetensors_bytes(header, data), [name for name in names if name in what]
    if kind == "flip":
        blob = bytearray(safetensors_bytes(header, data))
        n = struct.unpack("<Q", bytes(blob[:8]))[0]
        at = rng.randrange(8, 8 + n)
        blob[at] ^= 1 << rng.randrange(8)
        return f"bit flipped at byte {at}", bytes(blob), []
    if kind == "duplicate":
        text = json.dumps(header)
        entry = json.dumps({name: header[name]})[1:-1]
        return f"{name} twice", safetensors_bytes(text[:-1] + ", " + entry + "}", data), [name]
    v = rng.choice([1, "x", [], None, {"dtype": "F32"}])
    header[name] = v
    return f"{name} = {v!r}", safetensors_bytes(header, data), [name]


# ---------------------------------------------------------------------------------------
# config.json

CONFIG_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                 "tie_word_embeddings", "model_type", "hidden_act", "torch_dtype", "attention_bias", "rope_scaling"]
ROPE_FIELDS = ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "rope_type",
               "beta_fast", "beta_slow", "mscale", "attention_factor", "truncate"]


def mutate_config(rng, config):
    """One or two mutations of a config.json: (what, file text, names a refusal should mention)."""
    c = json.loads(json.dumps(config))
    kind = rng.choice(["field", "field", "field", "rope", "delete", "product", "whole", "two"])
    if kind in ("field", "two"):
        whats, names = [], []
        for _ in range(1 if kind == "field" else 2):
            key = rng.choice(CONFIG_FIELDS)
            v = rng.choice(BAD_JSON_VALUES + ["llama", "qwen3", "gelu", "bfloat16"])
            c[key] = v
            whats.append(f"{key} = {str(v)[:20]}")
            names.append(key)
        return ", ".join(whats), json.dumps(c), names
    if kind == "rope":
        scaling = c.get("rope_scaling") or {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        key = rng.choice(ROPE_FIELDS)
        v = rng.choice(BAD_JSON_VALUES + ["yarn", "linear", "dynamic", "longrope"])
        scaling[key] = v
        c["rope_scaling"] = scaling
        return f"rope_scaling.{key} = {str(v)[:20]}", json.dumps(c), [key, "rope"]
    if kind == "delete":
        key = rng.choice(CONFIG_FIELDS)
        c.pop(key, None)
        return f"{key} removed", json.dumps(c), [key]
    if kind == "product":
        # Every size plausible alone, the products not.
        big = rng.choice([2**20, 2**24, 2**30, 2**31 - 1])
        keys = rng.sample(["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "head_dim"], 2)
        for key in keys:
            c[key] = big
        if "num_attention_heads" in keys:
            c["num_key_value_heads"] = big
        return f"{' and '.join(keys)} = {big}", json.dumps(c), keys
    v = rng.choice(["", "[]", "1", "null", '"x"', "{", nested(100000, ""), json.dumps(c)[:-3], "\ufeff" + json.dumps(c),
                    json.dumps(c).replace("64", "NaN", 1), json.dumps(c).replace("64", "Infinity", 1),
                    json.dumps(c)[:-1] + ', "hidden_size": 64}', b"\xff\xfe".decode("latin-1") + json.dumps(c)])
    return f"whole file {v[:30]!r}", v, ["config"]


# ---------------------------------------------------------------------------------------
# token files and corpora

def token_bytes(ids):
    return struct.pack(f"<{len(ids)}I", *ids)


def mutate_tokens(rng, vocab):
    """A token file: (what, bytes, names)."""
    kind = rng.choice(["size", "ids", "int64", "empty", "valid"])
    if kind == "size":
        n = rng.choice([1, 2, 3, 5, 129, 16 * 1024 + 1])
        return f"{n} bytes", bytes(n), ["multiple of 4", "bytes"]
    if kind == "ids":
        ids = [rng.randrange(vocab) for _ in range(rng.choice([64, 256, 4096]))]
        bad = rng.choice([vocab, vocab + 1, 2**31 - 1, 2**31, 2**32 - 1])
        ids[rng.randrange(len(ids))] = bad
        return f"id {bad} among {len(ids)}", token_bytes(ids), [str(bad)]
    if kind == "int64":
        ids = [rng.randrange(1, vocab) for _ in range(128)]
        return "int64 ids", struct.pack(f"<{len(ids)}q", *ids), ["int64", "64-bit", "zero"]
    if kind == "empty":
        return "empty", b"", ["empty", "0 tokens", "no token"]
    n = rng.choice([2, 31, 32, 33, 64, 4096])
    return f"{n} valid tokens", token_bytes([rng.randrange(vocab) for _ in range(n)]), []


def corpus_files(rng, vocab, documents=6, length=40, masked=False):
    """A valid corpus as prepare-data writes it: {suffix: bytes}; `masked` adds a loss mask
    (prompt tokens 0, the answer at each document's end 1)."""
    lengths = [rng.randrange(1, length) for _ in range(documents)]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    ids = [rng.randrange(vocab) for _ in range(offsets[-1])]
    manifest = {"format": "upipe-tokens", "version": 1, "dtype": "uint32", "vocab_size": vocab,
                "documents": documents, "tokens": offsets[-1]}
    files = {".tokens": token_bytes(ids), ".index": struct.pack(f"<{len(offsets)}Q", *offsets)}
    if masked:
        mask = bytes(1 if i >= n // 2 else 0 for n in lengths for i in range(n))
        files[".mask"] = mask
        manifest["loss_mask"] = {"format": "upipe-loss-mask", "version": 1, "dtype": "uint8",
                                 "file": "corpus.mask", "targets": sum(mask)}
    files[".json"] = json.dumps(manifest).encode()
    return files


def mutate_mask(rng, files, manifest):
    """One mutation of a masked corpus's mask: (what, files, names)."""
    kind = rng.choice(["size", "bytes", "manifest", "missing", "none"])
    if kind == "size":
        files[".mask"] = files[".mask"][:rng.choice([0, 1, len(files[".mask"]) - 1])] + rng.choice([b"", b"\x01" * 9])
        return "mask cut", files, [".mask"]
    if kind == "bytes":
        mask = bytearray(files[".mask"])
        mask[rng.randrange(len(mask))] = rng.choice([2, 255])
        files[".mask"] = bytes(mask)
        return "mask byte past 1", files, [".mask"]
    if kind == "manifest":
        key = rng.choice(["format", "version", "dtype"])
        manifest["loss_mask"][key] = rng.choice(BAD_JSON_VALUES + ["upipe-tokens", 2, "uint16"])
        files[".json"] = json.dumps(manifest).encode()
        return f"loss_mask {key} changed", files, ["loss_mask", ".json"]
    if kind == "missing":
        del files[".mask"]
        return "mask missing", files, [".mask"]
    files[".mask"] = bytes(len(files[".mask"]))  # valid: no target anywhere, every step skipped
    return "every token masked", files, [".mask", "target"]


def mutate_corpus(rng, files):
    """One mutation of a corpus's files: (what, files, names)."""
    files = dict(files)
    manifest = json.loads(files[".json"])
    if ".mask" in files and rng.random() < 0.6:
        return mutate_mask(rng, files, manifest)
    offsets = list(struct.unpack(f"<{len(files['.index']) // 8}Q", files[".index"]))
    kind = rng.choice(["manifest", "manifest", "offsets", "index_size", "tokens_size", "missing", "manifest_text"])
    if kind == "manifest":
        key = rng.choice(["dtype", "vocab_size", "documents", "tokens"])
        v = rng.choice(BAD_JSON_VALUES + [2**61, 2**62 + 1, 2**63 // 4, "uint16", "int64"])
        manifest[key] = v
        files[".json"] = json.dumps(manifest).encode()
        return f"manifest {key} = {str(v)[:20]}", files, [key, ".json", ".index", ".tokens"]
    if kind == "offsets":
        i = rng.randrange(len(offsets))
        v = rng.choice([0, 1, offsets[-1] + 1, 2**63, 2**64 - 1, offsets[max(i - 1, 0)] - 1 if i else 5])
        offsets[i] = v % 2**64
        files[".index"] = struct.pack(f"<{len(offsets)}Q", *offsets)
        return f"offset {i} = {v}", files, [".index", "document"]
    if kind == "index_size":
        files[".index"] = files[".index"][:rng.choice([0, 1, 8, len(files[".index"]) - 1])]
        return "index cut", files, [".index"]
    if kind == "tokens_size":
        files[".tokens"] = files[".tokens"][:rng.choice([0, 3, 4, len(files[".tokens"]) - 4])]
        return "tokens cut", files, [".tokens"]
    if kind == "missing":
        key = rng.choice([".tokens", ".index", ".json"])
        del files[key]
        return f"{key} missing", files, [key]
    files[".json"] = rng.choice([b"", b"[]", b"{", b"null", nested(100000, "").encode()])
    return "manifest text", files, [".json"]


# ---------------------------------------------------------------------------------------
# documents for prepare-data

# Parquet files as pyarrow writes them (embedded, so that the corpus needs no pyarrow to
# build them): eight rows of text, snappy-compressed; and two rows whose string column
# holds bytes that are not UTF-8 (written without pyarrow's check).
PARQUET_TEXT = base64.b64decode(
    "UEFSMRUEFZACFW5MFRAVABIAAIgBQA0AAABoZWxsbyB3b3JsZCAwPhEAADE+EQAAMj4RAAAzPhEAADQ+EQAANT4RAAA2PhEAADcV"
    "ABUWFRosFRAVEBUGFQYcNgAoDWhlbGxvIHdvcmxkIDcYDWhlbGxvIHdvcmxkIDAREQAAAAsoAgAAABABAwOIxvoVBBksNQAYBnNj"
    "aGVtYRUCABUMJQIYBHRleHQlAEwcAAAAFhAZHBkcJgAcFQwZNQAGEBkYBHRleHQVAhYQFq4DFpACJpQBJggcNgAoDWhlbGxvIHdv"
    "cmxkIDcYDWhlbGxvIHdvcmxkIDAREQAZLBUEFQAVAgAVABUQFQIAPBbQARkGGSYAEAAAABauAxYQJggWkAIAGRwYDEFSUk9XOnNj"
    "aGVtYRigAS8vLy8vM0FBQUFBUUFBQUFBQUFLQUF3QUJnQUZBQWdBQ2dBQUFBQUJCQUFNQUFBQUNBQUlBQUFBQkFBSUFBQUFCQUFB"
    "QUFFQUFBQVVBQUFBRUFBVUFBZ0FCZ0FIQUF3QUFBQVFBQkFBQUFBQUFBRUZFQUFBQUJ3QUFBQUVBQUFBQUFBQUFBUUFBQUIwWlho"
    "MEFBQUFBQVFBQkFBRUFBQUEAGCBwYXJxdWV0LWNwcC1hcnJvdyB2ZXJzaW9uIDI2LjAuMRkcHAAAAHABAABQQVIx")
PARQUET_SNAPPY_BYTE = 11  # a byte of PARQUET_TEXT's compressed page: flipped, snappy fails
PARQUET_BAD_UTF8 = base64.b64decode(
    "UEFSMRUEFRoVGkwVBBUAEgAAAgAAAG9rAwAAAP/+ehUAFRIVEiwVBBUQFQYVBhw2ACgD//56GAJvaxERAAAAAgAAAAQBAQMCFQQZ"
    "LDUAGAZzY2hlbWEVAgAVDCUCGAR0ZXh0JQBMHAAAABYEGRwZHCYAHBUMGTUABhAZGAR0ZXh0FQAWBBaIARaIASY+JggcNgAoA//+"
    "ehgCb2sREQAZLBUEFQAVAgAVABUQFQIAPBYKGQYZJgAEAAAAFogBFgQmCBaIAQAZHBgMQVJST1c6c2NoZW1hGKABLy8vLy8zQUFB"
    "QUFRQUFBQUFBQUtBQXdBQmdBRkFBZ0FDZ0FBQUFBQkJBQU1BQUFBQ0FBSUFBQUFCQUFJQUFBQUJBQUFBQUVBQUFBVUFBQUFFQUFV"
    "QUFnQUJnQUhBQXdBQUFBUUFCQUFBQUFBQUFFRkVBQUFBQndBQUFBRUFBQUFBQUFBQUFRQUFBQjBaWGgwQUFBQUFBUUFCQUFFQUFB"
    "QQAYIHBhcnF1ZXQtY3BwLWFycm93IHZlcnNpb24gMjYuMC4xGRwcAAAAWQEAAFBBUjE=")


def jsonl_bytes(documents):
    return b"".join(json.dumps({"text": d}).encode() + b"\n" for d in documents)


def gzip_bytes(blob):
    return gzip.compress(blob, mtime=0)


def corrupt(rng, blob, flips):
    """`blob` with `flips` random bytes replaced."""
    out = bytearray(blob)
    for _ in range(flips):
        out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)
