"""Encoding for prepare_data.py: the worker processes (a tokenizer and a chat template each),
the batches they encode, and the main process's side that takes their results in order.
"""
import os
import signal
import sys
import time
from array import array
from collections import deque

from . import chat_data
from .corpus_writer import SKIPPED

# An array typecode of exactly 4 bytes for the token ids (uint32).
TOKEN_TYPECODE = next(c for c in "IL" if array(c).itemsize == 4)
BIG_ENDIAN = sys.byteorder == "big"


class PrepareError(Exception):
    """A problem with the user's input or options: reported as one line, exit status 2."""


def quiet_tokenizers_threads():
    # Each process encodes on one thread; parallelism comes from the worker processes.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"


_WORKER = {}


def multiprocessing_child():
    import multiprocessing
    return multiprocessing.parent_process() is not None


def init_encoder(model_dir, bos_id, eos_id, chat=None):
    """Loads the tokenizer once per process (the worker initializer); chat is (template text or
    None, the special tokens' strings, --loss-mask, the template's limits) for the rows of examples."""
    quiet_tokenizers_threads()
    if multiprocessing_child():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    _WORKER["tok"] = tok
    _WORKER["encode"] = getattr(tok, "encode_batch_fast", tok.encode_batch)
    _WORKER["bos"] = bos_id
    _WORKER["eos"] = eos_id
    _WORKER["chat"] = chat
    _WORKER["rows"] = None  # the RowEncoder, made at the first example


def row_encoder():
    if _WORKER["rows"] is None:
        text, special, loss_mask, limits = _WORKER["chat"]
        template = chat_data.ChatTemplate(text, special, limits) if text is not None else None
        _WORKER["rows"] = chat_data.RowEncoder(_WORKER["tok"], template, loss_mask, _WORKER["bos"], _WORKER["eos"])
    return _WORKER["rows"]


def encode_items(items):
    """Encodes a batch of documents and examples. Returns (uint32 little-endian bytes, lengths
    with specials, own lengths (SKIPPED for a row left out), the loss mask of the batch's tokens
    or None when every one is a target, each item's row kind, and the rows left out as
    (index, where, reason kind, message))."""
    rejects, texts, rendered, examples = [], [], [], {}
    for i, item in enumerate(items):  # documents as they are, examples rendered first
        if isinstance(item, str):
            texts.append((i, item))
            continue
        try:
            examples[i] = row_encoder().render(item[1])
            rendered.append((i, examples[i].text))
        except chat_data.RowError as e:
            rejects.append((i, item[0], e.kind, str(e)))
    encoded = {}
    # One call for the documents (without offsets, the fast way) and one for the examples,
    # whose masks need their tokens' offsets.
    for batch, encode in ((texts, _WORKER["encode"]), (rendered, _WORKER["tok"].encode_batch)):
        if batch:
            for (i, _), enc in zip(batch, encode([t for _, t in batch], add_special_tokens=False)):
                encoded[i] = enc
    bos, eos = _WORKER["bos"], _WORKER["eos"]
    buf = array(TOKEN_TYPECODE)
    lengths, own = array("q"), array("q")
    mask, kinds, rejected = None, [], {r[0] for r in rejects}
    for i, item in enumerate(items):
        start = len(buf)
        kinds.append("text" if isinstance(item, str) else chat_data.row_kind(item[1]))
        targets = None
        if i in rejected:
            lengths.append(0)
            own.append(SKIPPED)
            continue
        if isinstance(item, str):
            ids = encoded[i].ids
            if bos is not None:
                buf.append(bos)
            buf.extend(ids)
            if eos is not None:
                buf.append(eos)
        else:
            try:
                ids, targets = row_encoder().finish(examples[i], encoded[i])
            except chat_data.RowError as e:
                rejects.append((i, item[0], e.kind, str(e)))
                lengths.append(0)
                own.append(SKIPPED)
                continue
            buf.extend(ids)
        if targets is not None and mask is None:
            mask = bytearray(b"\x01" * start)
        if mask is not None:
            mask.extend(targets if targets is not None else b"\x01" * (len(buf) - start))
        lengths.append(len(buf) - start)
        own.append(len(ids))
    if BIG_ENDIAN:
        buf.byteswap()
    rejects.sort()
    return buf.tobytes(), lengths, own, (bytes(mask) if mask is not None else None), kinds, rejects


class Consumer:
    """Takes the encoded batches in input order: splits them between the writers, leaves out
    (--bad-rows skip) or refuses the rows that are not examples, and keeps the progress bar."""

    def __init__(self, writers, splitter, bad_rows, bar, t0):
        self.writers, self.splitter, self.bad_rows, self.bar, self.t0 = writers, splitter, bad_rows, bar, t0
        self.ordinal = self.docs_done = self.text_done = 0
        self.skipped = {}  # reason kind -> rows

    def __call__(self, result, nbytes, consumed):
        data, lengths, own, mask, kinds, rejects = result
        for i, where, kind, message in rejects:
            if self.bad_rows == "error":
                raise PrepareError(f"{where}: {message} (--bad-rows skip leaves such rows out, counted)")
            self.skipped[kind] = self.skipped.get(kind, 0) + 1
            if self.skipped[kind] <= 5:
                print(f"prepare_data: skipped {where}: {message}", file=sys.stderr)
        n = len(lengths)
        if len(self.writers) == 1:
            self.writers[0].add(data, lengths, own, nbytes, mask, kinds)
        else:
            self._split(data, lengths, own, nbytes, mask, kinds)
        self.ordinal += n
        self.docs_done += n
        self.text_done += sum(nbytes)
        if self.bar is not None:
            self.bar.update(consumed)
            elapsed = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"text {self.text_done / 1e6:.1f} MB, {self.docs_done / elapsed:.0f} docs/s",
                                     refresh=False)

    def _split(self, data, lengths, own, nbytes, mask, kinds):
        view = memoryview(data)
        n = len(lengths)
        side = [self.splitter.heldout(self.ordinal + i) for i in range(n)]
        start_doc, start_tok = 0, 0
        while start_doc < n:
            end_doc, end_tok = start_doc, start_tok
            while end_doc < n and side[end_doc] == side[start_doc]:
                end_tok += lengths[end_doc]
                end_doc += 1
            self.writers[1 if side[start_doc] else 0].add(
                view[start_tok * 4:end_tok * 4], lengths[start_doc:end_doc], own[start_doc:end_doc],
                nbytes[start_doc:end_doc], mask[start_tok:end_tok] if mask is not None else None,
                kinds[start_doc:end_doc])
            start_doc, start_tok = end_doc, end_tok


def encode_all(a, source, consume, initargs):
    """Encodes every batch of `source` (in --workers processes) and consumes the results in order."""
    if a.workers == 1:
        init_encoder(*initargs)
        for items, nbytes, consumed in source:
            consume(encode_items(items), nbytes, consumed)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    pool = ProcessPoolExecutor(max_workers=a.workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=init_encoder, initargs=initargs)
    pending = deque()
    window = 2 * a.workers + 1
    try:
        for items, nbytes, consumed in source:
            pending.append((pool.submit(encode_items, items), nbytes, consumed))
            while len(pending) >= window:
                fut, nb, c = pending.popleft()
                consume(fut.result(), nb, c)
        while pending:
            fut, nb, c = pending.popleft()
            consume(fut.result(), nb, c)
        pool.shutdown()
    except BrokenProcessPool:
        pool.shutdown(wait=True, cancel_futures=True)
        raise PrepareError("an encoding worker process died (out of memory?); try fewer --workers "
                           "or a smaller --batch-bytes") from None
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise


