#!/usr/bin/env python3
"""Golden references for the model families beside Llama and Qwen3 (model/family.hpp),
produced by Hugging Face transformers and PEFT on this machine (no hub access).

usage: make_family_fixtures.py [ROOT]      (default: the repository; writes ROOT/tests/golden)

Writes five model directories under tests/golden/hf/, each saved by transformers' own
`save_pretrained` in bfloat16 with the byte-level tokenizer of make_hf_fixtures.py:

  qwen2-bias/      Qwen2ForCausalLM: biases on q, k and v, no window, untied
  qwen2-window/    Qwen2ForCausalLM: use_sliding_window with max_window_layers 1 (layer 0
                   global, layer 1 a window of 6), tied
  mistral-window/  MistralForCausalLM: a window of 5 on every layer, head_dim 24 (H*d != D)
  phi3-fused/      Phi3ForCausalLM: fused qkv_proj and gate_up_proj, pad_token_id 5
  gemma3-text/     Gemma3ForCausalLM (model_type gemma3_text): three layers (windows of 5 on
                   the first two), per-type RoPE (local base 10000, global 1e6 with linear
                   scaling 2), query_pre_attn_scalar 24 (head_dim 16), GeGLU, sandwich
                   norms, a tied embedding scaled by sqrt(48), pad_token_id 0

Weights are drawn in float32 with fixed seeds (norm weights scaling by 1 + 0.1 N(0, 1):
Gemma stores 0.1 N(0, 1) since it scales by 1 + w; biases 0.5 N(0, 1); embeddings N(0, 1),
or N(0, 1/D) where tied to the head; other matrices N(0, 1) / sqrt(fan_in)) and cast to bfloat16 by the save. 62 random tokens
(not a multiple of 4 or 8), the padding token among them where the model has one.

The references are computed from the saved directory re-loaded and cast to float64 with
eager attention (transformers keeps RMSNorm and the RoPE angles in float32 inside):
  golden.json                 loss, the tokens, the rope parameters, versions, parameter names,
                              the tokenizer's ids of three sample texts
  grads.safetensors           every parameter's gradient (float32), named as named_parameters()
  documents.json, documents_grads.safetensors
                              the same tokens as six packed documents (9, 1, 23, 5, 20, 4), each
                              run by itself, as scripts/make_document_golden.py does
and, under tests/golden/lora/<name>/, PEFT's LoRA on the same base (r 4, alpha 7, every
linear module of the layers: Phi-3's fused qkv_proj and gate_up_proj whole; B drawn
N(0, 0.05^2) so that no gradient is trivially zero): adapter_config.json,
adapter_model.safetensors, grads.safetensors, golden.json (float64 as above).
Runs on the CPU, one thread; deterministic for given versions.
"""
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_hf_fixtures import BOS, EOS, PAD, TEXT_SAMPLES, TOKENS, VOCAB, build_tokenizer, start_fixture_run, jsonable  # noqa: E402

DOCUMENT_LENGTHS = [9, 1, 23, 5, 20, 4]
LORA_SEED, LORA_RANK, LORA_ALPHA = 20261207, 4, 7

COMMON = dict(vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2, bos_token_id=BOS,
              eos_token_id=EOS, initializer_range=0.01, fixture_note="kept")

FIXTURES = [
    dict(name="qwen2-bias", seed=3001, pad=None,
         config=lambda: transformers.Qwen2Config(
             **COMMON, hidden_size=64, intermediate_size=96, num_hidden_layers=2, rms_norm_eps=1e-6,
             max_position_embeddings=128, tie_word_embeddings=False, use_sliding_window=False,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    dict(name="qwen2-window", seed=3002, pad=None,
         config=lambda: transformers.Qwen2Config(
             **COMMON, hidden_size=64, intermediate_size=96, num_hidden_layers=2, rms_norm_eps=1e-6,
             max_position_embeddings=128, tie_word_embeddings=True, use_sliding_window=True,
             sliding_window=6, max_window_layers=1,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    dict(name="mistral-window", seed=3003, pad=None,
         config=lambda: transformers.MistralConfig(
             **COMMON, hidden_size=64, intermediate_size=160, num_hidden_layers=2, head_dim=24,
             rms_norm_eps=1e-5, max_position_embeddings=128, tie_word_embeddings=False, sliding_window=5,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    dict(name="phi3-fused", seed=3004, pad=5,
         config=lambda: transformers.Phi3Config(
             **COMMON, hidden_size=64, intermediate_size=96, num_hidden_layers=2, rms_norm_eps=1e-5,
             max_position_embeddings=128, original_max_position_embeddings=128, tie_word_embeddings=False,
             pad_token_id=5, sliding_window=None,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    dict(name="gemma3-text", seed=3005, pad=PAD,
         config=lambda: transformers.Gemma3TextConfig(
             **COMMON, hidden_size=48, intermediate_size=96, num_hidden_layers=3, head_dim=16,
             rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=PAD,
             sliding_window=5, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
             query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh",
             rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                              "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1000000.0)})),
]


def fill_weights(model, seed, norm_center):
    """Random, non-symmetric weights drawn in float32 in named_parameters order. A tied
    embedding is also the head: N(0, 1/D), so that the logits stay of order one."""
    tied = model.config.tie_word_embeddings
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith(".bias"):
                p.copy_(0.5 * noise)
            elif p.dim() == 1:
                p.copy_(norm_center + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise / math.sqrt(p.shape[1]) if tied else noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))


def tokens_for(fx):
    gen = torch.Generator().manual_seed(fx["seed"] + 7)
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    if fx["pad"] is not None:  # the padding row's lookups must train nothing: make some
        ids[[3, 30, 47]] = fx["pad"]
    return ids


def load_f64(directory):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                              attn_implementation="eager")
    return model.to(torch.float64).eval()


def save_grads(model, path):
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.detach().to(torch.float32).contiguous()
    save_file(grads, str(path), metadata={"format": "pt"})
    return grads


def make_base(out, fx, tokenizer):
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if old.is_file():
            old.unlink()
    config = fx["config"]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gemma = config.model_type == "gemma3_text"
    fill_weights(model, fx["seed"], 0.0 if gemma else 1.0)
    model.generation_config.bos_token_id = BOS
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    model.to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model

    model = load_f64(out)
    ids = tokens_for(fx)[None]
    result = model(input_ids=ids, labels=ids)
    result.loss.backward()
    grads = save_grads(model, out / "grads.safetensors")
    assert len(grads) == len(list(model.named_parameters())), "every parameter has a gradient"
    golden = {
        "model": fx["name"],
        "architecture": type(model).__name__,
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "dtype": "bfloat16",
        "reference_dtype": "float64",
        "tokens": ids[0].tolist(),
        "loss": result.loss.item(),
        "rope": jsonable(dict(model.config.rope_parameters)),
        "layer_types": getattr(model.config, "layer_types", None),
        "text_samples": TEXT_SAMPLES,
        "text_ids": [tokenizer.encode(t) for t in TEXT_SAMPLES],
        "parameters": [name for name, _ in model.named_parameters()],
    }
    (out / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    return golden


def make_documents(out, tokens):
    model = load_f64(out)
    assert sum(DOCUMENT_LENGTHS) == len(tokens)
    starts, total, targets, at = [], 0.0, 0, 0
    for length in DOCUMENT_LENGTHS:
        starts.append(at)
        ids = torch.tensor(tokens[at:at + length])[None]
        at += length
        if length < 2:
            continue
        logits = model(input_ids=ids).logits[0, :-1]
        total = total + torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
        targets += length - 1
    loss = total / targets
    loss.backward()
    save_grads(model, out / "documents_grads.safetensors")
    record = {"starts": starts, "lengths": DOCUMENT_LENGTHS, "loss": float(loss), "targets": targets,
              "reference_dtype": "float64", "transformers": transformers.__version__, "torch": torch.__version__}
    (out / "documents.json").write_text(json.dumps(record, indent=1) + "\n")


def make_lora(base_dir, out_dir, tokens, targets="all-linear"):
    """base_dir relative to the repository (PEFT records it as base_model_name_or_path).
    Experts run eagerly: transformers' grouped matmul has no float64."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32,
                                                              attn_implementation="eager",
                                                              experts_implementation="eager")
    torch.manual_seed(LORA_SEED)
    config = peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets,
                             bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(out_dir)  # float32 adapters, before the cast below
    (out_dir / "README.md").unlink(missing_ok=True)  # PEFT's model card template
    model = model.to(torch.float64)
    ids = torch.tensor(tokens)[None]
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n.replace(".default.", "."): p.grad.to(torch.float32).contiguous()
             for n, p in model.named_parameters() if p.requires_grad}
    save_file(grads, str(out_dir / "grads.safetensors"))
    modules = sorted({n.split(".")[-3] for n in grads})
    record = {"base": str(base_dir), "tokens": tokens, "loss": float(out.loss.item()), "r": LORA_RANK,
              "lora_alpha": LORA_ALPHA, "target_modules": modules, "seed": LORA_SEED,
              "reference_dtype": "float64", "peft": peft.__version__, "transformers": transformers.__version__,
              "torch": torch.__version__}
    (out_dir / "golden.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main():
    tokenizer = start_fixture_run()
    for fx in FIXTURES:
        base = Path("tests/golden/hf") / fx["name"]
        golden = make_base(base, fx, tokenizer)
        make_documents(base, golden["tokens"])
        lora = make_lora(base, Path("tests/golden/lora") / fx["name"], golden["tokens"])
        size = sum(p.stat().st_size for p in base.iterdir())
        print(f"{fx['name']}: {golden['architecture']} loss={golden['loss']:.9f} "
              f"lora loss={lora['loss']:.9f} modules={lora['target_modules']} bytes={size}")


if __name__ == "__main__":
    main()
