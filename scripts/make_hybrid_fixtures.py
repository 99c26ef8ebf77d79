#!/usr/bin/env python3
"""Golden references for the hybrid linear-attention families (model/family.hpp: qwen3_5,
qwen3_5_moe, qwen3_next), produced by Hugging Face transformers on this machine (no hub
access).

usage: make_hybrid_fixtures.py [ROOT]      (default: the repository; writes ROOT/tests/golden)

Writes four model directories under tests/golden/hybrid/, each saved by transformers' own
`save_pretrained` in bfloat16 with the byte-level tokenizer of make_hf_fixtures.py. Each has
three Gated DeltaNet layers below one gated full-attention layer (layer_types), 8 attention
heads over 2 kv heads of head_dim 16 with partial RoPE (factor 0.25: 4 dimensions rotate),
and DeltaNet layers of 4 key heads (dk 8) and 8 value heads (dv 12: value head h reads key
head h / 2), a convolution of 4 taps:

  qwen3-5/        Qwen3_5ForCausalLM (model_type qwen3_5_text): separate in_proj_qkv, in_proj_z,
                  in_proj_b, in_proj_a; a dense MLP
  qwen3-5-attention/  the same family with two full-attention layers only: the gated attention,
                  partial RoPE and the zero-centred norms alone
  qwen3-5-vl/     Qwen3_5ForConditionalGeneration (model_type qwen3_5, the Hub's layout): the text
                  model under model.language_model.*, a tiny vision tower under model.visual.*,
                  and an `mtp.fc.weight` as the Hub's checkpoints carry (transformers ignores it)
  qwen3-5-moe/    Qwen3_5MoeForCausalLM: every layer's MLP 8 experts of width 16, top-2
                  renormalized, a shared expert of width 24 behind its sigmoid gate
  qwen3-next/     Qwen3NextForCausalLM: in_proj_qkvz and in_proj_ba grouped by key head, sparse
                  layers of 8 experts (top-2, norm_topk_prob) and a shared expert, layer 1's MLP
                  dense (mlp_only_layers)

Weights are drawn in float32 with fixed seeds so that every path matters: the DeltaNet state
must carry over tens of tokens (A_log = log U(0.02, 0.3), dt_bias 0.5 N(0, 1), so each
token keeps 80 to 99% of the state) and the zero-centred norms scale by 1 + 0.1 N(0, 1)
(stored 0.1 N(0, 1)); the gated norm's weight 1 + 0.1 N(0, 1); biases 0.5 N(0, 1);
embeddings N(0, 1); routers 2 N(0, 1) / sqrt(D); the convolution N(0, 1) / sqrt(4); other
matrices N(0, 1) / sqrt(fan_in). 203 random tokens (not a multiple of 4, 8 or 16: the CP
layouts pad).

The references are computed from the saved directory re-loaded and cast to float64 with eager
attention (transformers' chunked gated delta rule, its gated RMSNorm and the decay run in
float32 inside, as its code casts them):
  golden.json                 loss, tokens, layer types, versions, parameter names, the
                              tokenizer's ids of three sample texts, and float32_error: how
                              far transformers itself lands from this reference in float32
                              (the worst of the loss and every gradient, relative to the
                              largest); the golden tests allow upipe, an fp32 engine, twice that
                              where it exceeds their 1e-5
  grads.safetensors           every parameter's gradient (float32) under the names
                              save_pretrained writes (the experts per expert)
  documents.json, documents_grads.safetensors
                              the same tokens as six packed documents (37, 1, 60, 24, 50, 31),
                              each run by itself: the state and the convolution start afresh
                              at every document (with its float32_error: a document's first
                              outputs are small differences that the gated norm rescales, which
                              fp32 rounding shows up to about 3e-5 here)
qwen3-5-vl/ has golden.json alone (its loss: the text model's through the multimodal class).
And under tests/golden/lora/hybrid-<name>/, PEFT's LoRA on each base (make_family_fixtures.py's
make_lora: r 4, alpha 7, B drawn N(0, 0.05^2)): every linear module of the dense Qwen3.5's
(the attention's q_proj with its gate rows, k, v, o; the Gated DeltaNet's in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a, out_proj; the MLP's), and on the mixtures of experts the
attention's and the Gated DeltaNet's (Qwen3-Next's fused in_proj_qkvz and in_proj_ba).
Runs on the CPU, one thread; deterministic for given versions.
"""
import json
import math
import sys
from pathlib import Path

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_family_fixtures import make_lora  # noqa: E402
from make_hf_fixtures import BOS, EOS, PAD, TEXT_SAMPLES, VOCAB, start_fixture_run  # noqa: E402
from make_moe_fixtures import stored_names  # noqa: E402

TOKENS = 203
DOCUMENT_LENGTHS = [37, 1, 60, 24, 50, 31]
LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]

TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            head_dim=16, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None, initializer_range=0.01,
            tie_word_embeddings=False, max_position_embeddings=512, rms_norm_eps=1e-6, layer_types=LAYER_TYPES,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=12,
            linear_conv_kernel_dim=4,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LINEAR_35 = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
FIXTURES = [
    dict(name="qwen3-5", seed=4601, lora="all-linear",
         config=lambda: transformers.Qwen3_5TextConfig(**TEXT, intermediate_size=96)),
    dict(name="qwen3-5-attention", seed=4605, lora="all-linear",
         config=lambda: transformers.Qwen3_5TextConfig(**dict(TEXT, num_hidden_layers=2,
                                                              layer_types=["full_attention"] * 2),
                                                       intermediate_size=96)),
    dict(name="qwen3-5-moe", seed=4602, lora=ATTENTION + LINEAR_35,
         config=lambda: transformers.Qwen3_5MoeTextConfig(**TEXT, **MOE)),
    dict(name="qwen3-next", seed=4603, lora=ATTENTION + ["in_proj_qkvz", "in_proj_ba", "out_proj"],
         config=lambda: transformers.Qwen3NextConfig(**TEXT, **MOE, intermediate_size=96, mlp_only_layers=[1],
                                                     decoder_sparse_step=1, norm_topk_prob=True)),
]


def vision_config():
    return dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                spatial_merge_size=1, temporal_patch_size=2, num_position_embeddings=16, in_channels=3)


def fill_weights(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("A_log"):
                p.copy_(torch.log(0.02 + 0.28 * torch.rand(p.shape, generator=gen)))
            elif name.endswith("dt_bias") or name.endswith(".bias"):
                p.copy_(0.5 * noise)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)  # zero-centred: the norm scales by 1 + w
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif name.endswith(".gate.weight"):
                p.copy_(2.0 * noise / math.sqrt(p.shape[-1]))
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def tokens_for(seed):
    gen = torch.Generator().manual_seed(seed + 7)
    return torch.randint(0, VOCAB, (TOKENS,), generator=gen)


def load_f32(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32,
                                                             attn_implementation="eager",
                                                             experts_implementation="eager").eval()


def load_f64(directory):
    return load_f32(directory).to(torch.float64)


def documents_loss(model, tokens, lengths):
    """The mean loss over packed documents, each run by itself (a one-token document has no target)."""
    total, targets, at = 0.0, 0, 0
    for length in lengths:
        ids = torch.tensor(tokens[at:at + length])[None]
        at += length
        if length < 2:
            continue
        logits = model(input_ids=ids).logits[0, :-1]
        total = total + torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
        targets += length - 1
    return total / targets, targets


def float32_error(directory, reference, loss, tokens, lengths):
    """How far transformers itself lands from the float64 reference when it runs in float32: the
    worst over the loss and every gradient of max |difference| / max |reference|. At a document's
    first tokens the gated norm rescales outputs that are small differences of rounded products,
    so an fp32 engine cannot be closer than about this (the golden tests bound upipe by it)."""
    model = load_f32(directory)
    f32_loss, _ = documents_loss(model, tokens, lengths)
    f32_loss.backward()
    worst = abs(f32_loss.item() - loss) / abs(loss)
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        want = grads[name].grad.detach()
        worst = max(worst, ((p.grad.double() - want).abs().max() / want.abs().max()).item())
    return worst


FX_ROLES = dict(block="mlp", roles=("gate_proj", "up_proj", "down_proj"))


def save_grads(model, path, saved):
    grads = {}
    for name, p in model.named_parameters():
        for stored, g in stored_names(FX_ROLES, name, p.grad.detach()).items():
            grads[stored] = g.to(torch.float32).contiguous()
    assert set(grads) == saved, f"gradient names {sorted(set(grads) ^ saved)[:6]} differ from the saved tensors'"
    save_file(grads, str(path), metadata={"format": "pt"})


def fresh(out):
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if old.is_file():
            old.unlink()


def save_model(model, out, tokenizer):
    model.generation_config.bos_token_id = BOS
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    model.to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def make_base(out, fx, tokenizer):
    fresh(out)
    model = transformers.AutoModelForCausalLM.from_config(fx["config"](), dtype=torch.float32)
    fill_weights(model, fx["seed"])
    save_model(model, out, tokenizer)
    del model
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        saved = set(f.keys())

    model = load_f64(out)
    ids = tokens_for(fx["seed"])[None]
    result = model(input_ids=ids, labels=ids)
    result.loss.backward()
    save_grads(model, out / "grads.safetensors", saved)
    f32 = float32_error(out, model, result.loss.item(), ids[0].tolist(), [TOKENS])
    golden = {
        "model": fx["name"],
        "architecture": type(model).__name__,
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "dtype": "bfloat16",
        "reference_dtype": "float64",
        "float32_error": f32,
        "tokens": ids[0].tolist(),
        "loss": result.loss.item(),
        "layer_types": model.config.layer_types,
        "rope": {k: v for k, v in dict(model.config.rope_parameters).items()},
        "text_samples": TEXT_SAMPLES,
        "text_ids": [tokenizer.encode(t) for t in TEXT_SAMPLES],
        "parameters": sorted(saved),
    }
    (out / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    return golden, saved


def make_documents(out, tokens, saved):
    model = load_f64(out)
    assert sum(DOCUMENT_LENGTHS) == len(tokens)
    starts = [sum(DOCUMENT_LENGTHS[:i]) for i in range(len(DOCUMENT_LENGTHS))]
    loss, targets = documents_loss(model, tokens, DOCUMENT_LENGTHS)
    loss.backward()
    save_grads(model, out / "documents_grads.safetensors", saved)
    record = {"starts": starts, "lengths": DOCUMENT_LENGTHS, "loss": float(loss), "targets": targets,
              "reference_dtype": "float64",
              "float32_error": float32_error(out, model, float(loss), tokens, DOCUMENT_LENGTHS),
              "transformers": transformers.__version__, "torch": torch.__version__}
    (out / "documents.json").write_text(json.dumps(record, indent=1) + "\n")


def make_multimodal(out, seed, tokenizer):
    """The Hub's layout: Qwen3_5ForConditionalGeneration with a tiny vision tower, plus an MTP
    tensor the text model does not use; the reference is the multimodal class's loss on text."""
    fresh(out)
    config = transformers.Qwen3_5Config(text_config=dict(TEXT, intermediate_size=96, rope_parameters=dict(
        TEXT["rope_parameters"], mrope_section=[1, 1, 0], mrope_interleaved=True)), vision_config=vision_config(),
                                        tie_word_embeddings=False)
    model = transformers.Qwen3_5ForConditionalGeneration(config).to(torch.float32)
    fill_weights(model, seed)
    save_model(model, out, tokenizer)
    del model
    tensors = load_file(str(out / "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.zeros(64, 128, dtype=torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32,
                                                                         attn_implementation="eager")
    model = model.to(torch.float64).eval()
    ids = tokens_for(seed)[None]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    names = sorted(tensors)
    assert any(n.startswith("model.language_model.") for n in names) and any(n.startswith("model.visual.") for n in names)
    golden = {"model": out.name, "architecture": type(model).__name__, "transformers": transformers.__version__,
              "torch": torch.__version__.split("+")[0], "reference_dtype": "float64", "tokens": ids[0].tolist(),
              "loss": loss, "parameters": names}
    (out / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    return golden


def main():
    tokenizer = start_fixture_run()
    root = Path("tests/golden/hybrid")
    for fx in FIXTURES:
        base = root / fx["name"]
        golden, saved = make_base(base, fx, tokenizer)
        make_documents(base, golden["tokens"], saved)
        lora = make_lora(base, Path("tests/golden/lora") / ("hybrid-" + fx["name"]), golden["tokens"], targets=fx["lora"])
        size = sum(p.stat().st_size for p in base.iterdir())
        print(f"{fx['name']}: {golden['architecture']} loss={golden['loss']:.9f} lora loss={lora['loss']:.9f} "
              f"modules={lora['target_modules']} bytes={size}")
    golden = make_multimodal(root / "qwen3-5-vl", 4604, tokenizer)
    print(f"qwen3-5-vl: {golden['architecture']} loss={golden['loss']:.9f}")


if __name__ == "__main__":
    main()
