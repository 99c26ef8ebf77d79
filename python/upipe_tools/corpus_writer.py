"""The files of one split of a prepared corpus (prepare_data.py writes them), all integers
little-endian:

  PREFIX.tokens  uint32 token ids, every document's tokens one after another, nothing in
                 between, no header: (tokens) * 4 bytes
  PREFIX.index   uint64 offsets into PREFIX.tokens, counted in tokens, documents + 1 of
                 them, no header: offsets[0] = 0, document i is
                 tokens[offsets[i] : offsets[i+1]], offsets[documents] = tokens; every
                 document has at least one token
  PREFIX.mask    only where an example masks a token: one uint8 per token of
                 PREFIX.tokens, 1 where the token is a target of the loss (the model is
                 trained to predict it from the tokens before it), else 0
  PREFIX.json    the manifest, a JSON object:
    "format": "upipe-tokens", "version": 1, "dtype": "uint32",
    "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True) (every id < it),
    "tokenizer": MODEL_DIR as given, "tokenizer_sha256": hex SHA-256 of tokenizer.json,
    "bos_id", "eos_id": ints or null, "add_bos", "add_eos": booleans,
    "documents": documents in this file set (the index holds documents + 1 offsets),
    "tokens": tokens in it (PREFIX.tokens holds tokens * 4 bytes),
    "empty_documents": empty documents of this split (kept or skipped),
    "text_bytes": UTF-8 bytes of the text of this split's documents, skipped ones included,
    "length_histogram": {"edges": [1, 2, 4, ..., 2^n], "counts": [c0, ..., c(n-1)]}:
        counts[k] documents have edges[k] <= length < edges[k+1] tokens; 2^n is the first
        power of two above max_length (no documents: edges [1], counts []),
    "min_length", "max_length": ints, "mean_length": tokens / documents (null when there
        are no documents),
    "split": "train" or "heldout", "heldout_fraction": F, "seed": S,
    "sources": the INPUT paths as given,
    "rows": {"text": n, "messages": n, "prompt_completion": n}: the documents of each kind,
    "skipped_rows": {reason: n} left out under --bad-rows skip (both splits together),
    "loss_mask_rule": which tokens are targets, "chat_template_sha256": where there is one,
    "loss_mask": only with PREFIX.mask: {"format": "upipe-loss-mask", "version": 1,
        "dtype": "uint8", "file": the mask's file name, "targets": its ones}.
Every file is written under a temporary name in the same folder, flushed to disk, and
renamed into place at the end, the manifest last (a reader should open PREFIX.json first;
its counts give the sizes of the other files). A reader that finds no "loss_mask" takes
every token as a target and ignores any PREFIX.mask (a stale one is removed).
"""
import json
import os
import sys
from array import array

OFFSET_TYPECODE = "Q"
assert array(OFFSET_TYPECODE).itemsize == 8
BIG_ENDIAN = sys.byteorder == "big"
MASK_FORMAT = "upipe-loss-mask"
MASK_VERSION = 1
SKIPPED = -1  # an `own` length marking a row left out (counted by the caller, not here)


class SplitWriter:
    """Writes one split's files under temporary names, and counts for its manifest."""

    def __init__(self, prefix, split):
        self.prefix = prefix
        self.split = split
        self.finals = [prefix + ".tokens", prefix + ".index", prefix + ".json", prefix + ".mask"]
        folder = os.path.dirname(prefix)
        self.temps = [os.path.join(folder, f".{os.path.basename(p)}.tmp-{os.getpid()}") for p in self.finals]
        self.tokens_f = open(self.temps[0], "wb")
        self.index_f = open(self.temps[1], "wb")
        self.mask_f = None  # opened by the first example that masks a token
        self.documents = 0
        self.tokens = 0
        self.targets = 0
        self.empty = 0
        self.text_bytes = 0
        self.buckets = []
        self.min_len = None
        self.max_len = 0
        self.rows = {"text": 0, "messages": 0, "prompt_completion": 0}
        self._write_offsets(array(OFFSET_TYPECODE, [0]))

    def _write_offsets(self, offsets):
        if BIG_ENDIAN:
            offsets.byteswap()
        self.index_f.write(offsets.tobytes())

    def _write_ones(self, n):
        block = b"\x01" * min(n, 1 << 20)
        while n > 0:
            self.mask_f.write(block[:n])
            n -= len(block)

    def add(self, data, lengths, own, text_bytes, mask=None, kinds=None):
        """Appends documents: data is their tokens, lengths[i] with specials, own[i] without
        (SKIPPED for a row left out), mask their targets (None: every token is one) and
        kinds[i] each one's row kind ("text" where not given)."""
        offsets = array(OFFSET_TYPECODE)
        total = self.tokens
        for i, (n, m, tb) in enumerate(zip(lengths, own, text_bytes)):
            if m == SKIPPED:
                continue
            self.text_bytes += tb
            if m == 0:
                self.empty += 1
            if n == 0:
                continue
            self.rows[kinds[i] if kinds else "text"] += 1
            total += n
            offsets.append(total)
            k = n.bit_length() - 1
            while len(self.buckets) <= k:
                self.buckets.append(0)
            self.buckets[k] += 1
            if self.min_len is None or n < self.min_len:
                self.min_len = n
            if n > self.max_len:
                self.max_len = n
        added = total - self.tokens
        if mask is not None and self.mask_f is None:
            self.mask_f = open(self.temps[3], "wb")
            self._write_ones(self.tokens)  # every earlier token was a target
        if mask is not None:
            assert len(mask) == added
            self.mask_f.write(mask)
            self.targets += sum(mask)
        else:
            if self.mask_f is not None:
                self._write_ones(added)
            self.targets += added
        self.tokens_f.write(data)
        self._write_offsets(offsets)
        self.documents += len(offsets)
        self.tokens = total

    def manifest(self, common, extra):
        n = len(self.buckets)
        m = dict(common)
        m.update({
            "documents": self.documents,
            "tokens": self.tokens,
            "empty_documents": self.empty,
            "text_bytes": self.text_bytes,
            "length_histogram": {"edges": [1 << k for k in range(n + 1)], "counts": list(self.buckets)},
            "min_length": self.min_len,
            "max_length": self.max_len if self.documents else None,
            "mean_length": self.tokens / self.documents if self.documents else None,
            "split": self.split,
            "rows": dict(self.rows),
        })
        m.update(extra)
        if self.mask_f is not None:
            m["loss_mask"] = {"format": MASK_FORMAT, "version": MASK_VERSION, "dtype": "uint8",
                              "file": os.path.basename(self.finals[3]), "targets": self.targets}
        return m

    def finish(self, common, extra):
        for f in (self.tokens_f, self.index_f, self.mask_f):
            if f is None:
                continue
            f.flush()
            os.fsync(f.fileno())
            f.close()
        with open(self.temps[2], "w", encoding="utf-8") as f:
            json.dump(self.manifest(common, extra), f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())

    def commit(self):
        # The mask before the manifest that names it; a stale mask of an earlier run goes.
        order = [0, 1, 3, 2]
        for i in order:
            if i == 3 and self.mask_f is None:
                if os.path.lexists(self.finals[3]):
                    os.remove(self.finals[3])
                continue
            os.replace(self.temps[i], self.finals[i])

    def discard(self):
        for f in (self.tokens_f, self.index_f, self.mask_f):
            if f is None:
                continue
            try:
                f.close()
            except OSError:
                pass
        for tmp in self.temps:
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass
