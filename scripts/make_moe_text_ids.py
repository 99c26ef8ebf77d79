#!/usr/bin/env python3
"""Real text for the mixture-of-experts GPU test that counts how often bf16 and fp32 routing
choose differently (tests/gpu/moe_test.cpp): sections 1 to 3 of docs/design.md, tokenized
with the MoE fixtures' byte-level tokenizer (tests/golden/moe/qwen3-moe/tokenizer.json,
written by make_moe_fixtures.py), the first 2048 ids.

usage: make_moe_text_ids.py [ROOT] [--estimate]   (default: the repository)

Writes ROOT/tests/golden/moe/text_ids.json: {"source", "tokenizer", "ids"}. The text is a
snapshot: the file is committed, and rerunning after design.md changed writes other ids.

--estimate also runs each fixture model in transformers on these ids in float32 and in
bfloat16 and prints, per model, the share of (token, sparse layer) rows whose top-k sets
differ: the order of magnitude the GPU test's bound is set from (upipe's bf16 run is not
torch's: its router logits are fp32 from bf16 inputs).
"""
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Tokenizer  # noqa: E402

TOKENS = 2048


def section_text(design):
    start = design.index("## 1. The problem and the idea")
    end = design.index("## 4. ")
    return design[start:end]


def estimate(root, ids):
    import torch
    import transformers

    torch.manual_seed(0)
    for name in ("qwen3-moe", "mixtral", "qwen2-moe"):
        directory = root / "tests" / "golden" / "moe" / name
        choices = {}
        for dtype in (torch.float32, torch.bfloat16):
            model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
            model.eval()
            with torch.no_grad():
                out = model(torch.tensor([ids]), output_router_logits=True)
            k = model.config.num_experts_per_tok
            choices[dtype] = [logits.float().topk(k, dim=-1).indices.sort(dim=-1).values for logits in out.router_logits]
        rows = differing = 0
        for a, b in zip(choices[torch.float32], choices[torch.bfloat16]):
            rows += a.shape[0]
            differing += int((a != b).any(dim=-1).sum())
        print(f"{name}: {differing} of {rows} (token, layer) rows routed differently in bf16 ({differing / rows:.2%})")


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    root = Path(args[0]) if args else Path(__file__).resolve().parent.parent
    tokenizer_path = root / "tests" / "golden" / "moe" / "qwen3-moe" / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    text = section_text((root / "docs" / "design.md").read_text())
    ids = tokenizer.encode(text).ids[:TOKENS]
    assert len(ids) == TOKENS, f"sections 1 to 3 give {len(ids)} ids, fewer than {TOKENS}"
    out = root / "tests" / "golden" / "moe" / "text_ids.json"
    out.write_text(json.dumps({"source": "docs/design.md sections 1 to 3",
                               "tokenizer": "tests/golden/moe/qwen3-moe/tokenizer.json", "ids": ids}) + "\n")
    print(f"make_moe_text_ids: {len(ids)} ids in {out}")
    if "--estimate" in sys.argv:
        estimate(root, ids)


if __name__ == "__main__":
    main()
