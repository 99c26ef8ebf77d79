#!/usr/bin/env python3
"""Golden reference for packed documents, produced by Hugging Face transformers.

usage: make_document_golden.py GOLDEN_DIR [GOLDEN_DIR ...]

For each directory written by make_golden.py or make_hf_fixtures.py (a model directory
and golden.json with 62 tokens), splits its tokens into documents of uneven length (9, 1, 23, 5, 20, 4:
one of a single token, one longer than a rank's shard at C = 4) and runs transformers on
each document by itself, in float32 with eager attention. A packed sequence's loss is the
mean over every target inside a document (a document of L tokens has L - 1), so the
reference is sum_i L_i_loss_sum / sum_i (L_i - 1), and its gradients the gradients of that.
Writes GOLDEN_DIR/documents.json (starts, loss, the per-document loss sums, each target's
loss in the packed sequence's order with null where a target would cross a boundary,
versions)
and GOLDEN_DIR/documents_grads.safetensors.
"""
import json
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

LENGTHS = [9, 1, 23, 5, 20, 4]


def main():
    for d in map(Path, sys.argv[1:]):
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        tokens = json.loads((d / "golden.json").read_text())["tokens"]
        assert sum(LENGTHS) == len(tokens)
        starts, total, sums, targets = [], 0.0, [], 0
        per_target = [None] * (len(tokens) - 1)  # the packed sequence's target t = token t + 1
        at = 0
        for length in LENGTHS:
            starts.append(at)
            ids = torch.tensor(tokens[at:at + length])[None]
            at += length
            if length < 2:
                sums.append(0.0)
                continue
            logits = model(input_ids=ids).logits[0, :-1]
            row = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
            for i, v in enumerate(row.tolist()):
                per_target[at - length + i] = v
            loss_sum = row.sum()
            total = total + loss_sum
            sums.append(loss_sum.item())
            targets += length - 1
        loss = total / targets
        loss.backward()
        params = dict(model.named_parameters())
        save_file({n: p.grad.contiguous() for n, p in params.items()}, str(d / "documents_grads.safetensors"))
        out = {"starts": starts, "lengths": LENGTHS, "loss": float(loss), "targets": targets, "loss_sums": sums,
               "per_target_loss": per_target,
               "transformers": transformers.__version__, "torch": torch.__version__}
        (d / "documents.json").write_text(json.dumps(out, indent=1) + "\n")
        print(d, "loss", out["loss"], "targets", targets)


if __name__ == "__main__":
    main()
