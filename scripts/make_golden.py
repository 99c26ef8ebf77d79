#!/usr/bin/env python3
"""Golden reference for upipe's model tests, produced by Hugging Face transformers.

usage: make_golden.py CONFIG_DIR OUT_DIR

Loads CONFIG_DIR/config.json (written by `upipe model-config --out`) with transformers,
initializes the model at random in float32 (linear weights N(0, 1/fan_in), embeddings
N(0, 1), every norm weight 1 + N(0, 0.1) so that no weight is symmetric), draws 62
random tokens, computes the causal-LM loss (labels = tokens, shifted inside) and its
backward, and writes OUT_DIR/model.safetensors (weights), OUT_DIR/grads.safetensors
(gradients, same names) and OUT_DIR/golden.json (tokens, loss, versions).
Runs on the CPU; eager attention keeps it deterministic.
"""
import json
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

SEED = 20261129
TOKENS = 62  # not a multiple of 4 or 8: upipe must pad under CP


def main():
    config_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    config = transformers.AutoConfig.from_pretrained(config_dir)
    model = transformers.AutoModelForCausalLM.from_config(
        config, torch_dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    tokens = torch.randint(0, config.vocab_size, (1, TOKENS))
    out = model(input_ids=tokens, labels=tokens)
    out.loss.backward()
    params = dict(model.named_parameters())
    save_file({n: p.detach().contiguous() for n, p in params.items()}, str(out_dir / "model.safetensors"))
    save_file({n: p.grad.contiguous() for n, p in params.items()}, str(out_dir / "grads.safetensors"))
    rope = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None)
    golden = {
        "tokens": tokens[0].tolist(),
        "loss": float(out.loss.item()),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seed": SEED,
        "rope": rope,
        "tied": bool(model.config.tie_word_embeddings),
        "parameters": sorted(params),
    }
    (out_dir / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    print(config_dir, "loss", golden["loss"], "rope", rope, "params", len(params))


if __name__ == "__main__":
    main()
