#!/usr/bin/env python3
"""Golden references for the mixture-of-experts families (model/family.hpp: qwen3_moe,
mixtral, qwen2_moe), produced by Hugging Face transformers on this machine (no hub access).

usage: make_moe_fixtures.py [ROOT]      (default: the repository; writes ROOT/tests/golden)

Writes three model directories under tests/golden/moe/, each saved by transformers' own
`save_pretrained` in bfloat16 (the per-expert layout: mlp.experts.N.gate_proj.weight, or
Mixtral's block_sparse_moe.experts.N.w1.weight) with the byte-level tokenizer of
make_hf_fixtures.py:

  qwen3-moe/   Qwen3MoeForCausalLM: three layers, layer 0 dense (mlp_only_layers), 8 experts
               of width 32, top-2 renormalized (norm_topk_prob), q/k norms
  mixtral/     MixtralForCausalLM: two layers of 8 experts (w1, w3, w2 of width 48), top-2
  qwen2-moe/   Qwen2MoeForCausalLM: two layers of 6 experts, top-3 not renormalized, a shared
               expert of width 48 behind sigmoid(shared_expert_gate), q/k/v biases;
               output_router_logits true in its config.json
  qwen3-moe-12/  Qwen3MoeForCausalLM of other sizes (the general mechanism, not the first
               fixture's numbers): hidden 48, head_dim 12, two sparse layers of 12 experts of
               width 16, top-3 not renormalized (12 experts split over 1, 2, 3, 4 or 6 EP ranks)

Each config sets router_aux_loss_coef 0.25, so that the load-balancing term weighs in the
gradients (transformers' default 0.001 would hide an error in it below the tolerance).
Weights are drawn in float32 with fixed seeds (norm weights 1 + 0.1 N(0, 1); biases 0.5 N(0, 1);
embeddings N(0, 1); routers 2 N(0, 1) / sqrt(D), so that the top-k choices are clear; other
matrices N(0, 1) / sqrt(fan_in)) and cast to bfloat16 by the save. 203 random tokens (a few
hundred, not a multiple of 4 or 8: the padding of CP layouts is exercised).

The references are computed from the saved directory re-loaded and cast to float64 with
eager attention (the router's softmax stays in float32 inside, as transformers computes it):
  golden.json             the tokens; loss without the load-balancing term; with it the loss,
                          the aux loss (before the coefficient); versions; parameter names;
                          the tokenizer's ids of three sample texts
  grads.safetensors       every parameter's gradient without the term (float32)
  aux_grads.safetensors   the same with the term (output_router_logits=True)
  documents.json, documents_grads.safetensors, documents_aux_grads.safetensors
                          the same tokens packed as six documents (31, 1, 57, 12, 70, 32), each
                          run by itself (attention inside a document, positions restarting):
                          the loss the sum of the documents' cross-entropies over their targets
                          (none across a boundary), and with the term the load-balancing loss
                          of transformers' load_balancing_loss_func over the router logits of
                          every document's tokens together (the packed sequence's, as one
                          sequence counts them), its gradients and the loss's
Gradients are stored under the names save_pretrained writes (per expert), the fused
experts.gate_up_proj (E, 2I, D) / down_proj (E, D, I) of transformers 5 split back.
And under tests/golden/lora/qwen3-moe/, PEFT's LoRA on the Qwen3-MoE base (make_family_fixtures.py's
make_lora: r 4, alpha 7, B drawn N(0, 0.05^2)) on the attention's q, k, v and o projections.
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

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_family_fixtures import make_lora  # noqa: E402
from make_hf_fixtures import BOS, EOS, PAD, TEXT_SAMPLES, VOCAB, build_tokenizer, start_fixture_run  # noqa: E402

TOKENS = 203
AUX_COEF = 0.25
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, bos_token_id=BOS,
              eos_token_id=EOS, initializer_range=0.01, tie_word_embeddings=False, max_position_embeddings=512,
              router_aux_loss_coef=AUX_COEF, rope_parameters=dict(rope_type="default", rope_theta=10000.0))

FIXTURES = [
    dict(name="qwen3-moe", seed=4101, block="mlp", roles=("gate_proj", "up_proj", "down_proj"),
         config=lambda: transformers.Qwen3MoeConfig(
             **COMMON, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, head_dim=16,
             rms_norm_eps=1e-6, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
             decoder_sparse_step=1, use_sliding_window=False)),
    dict(name="mixtral", seed=4102, block="block_sparse_moe", roles=("w1", "w3", "w2"),
         config=lambda: transformers.MixtralConfig(
             **COMMON, intermediate_size=48, num_hidden_layers=2, rms_norm_eps=1e-5, num_local_experts=8,
             num_experts_per_tok=2, sliding_window=None)),
    dict(name="qwen3-moe-12", seed=4104, block="mlp", roles=("gate_proj", "up_proj", "down_proj"),
         config=lambda: transformers.Qwen3MoeConfig(
             **dict(COMMON, hidden_size=48), intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
             head_dim=12, rms_norm_eps=1e-6, num_experts=12, num_experts_per_tok=3, norm_topk_prob=False,
             mlp_only_layers=[], decoder_sparse_step=1, use_sliding_window=False)),
    dict(name="qwen2-moe", seed=4103, block="mlp", roles=("gate_proj", "up_proj", "down_proj"),
         config=lambda: transformers.Qwen2MoeConfig(
             **COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
             num_hidden_layers=2, rms_norm_eps=1e-6, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
             output_router_logits=True, use_sliding_window=False)),
]


def fill_weights(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith(".bias"):
                p.copy_(0.5 * noise)
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif name.endswith(".gate.weight"):
                p.copy_(2.0 * noise / math.sqrt(p.shape[-1]))
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def stored_names(fx, name, grad):
    """A parameter's gradient under the names save_pretrained writes: the fused experts split
    per expert, Mixtral's block named block_sparse_moe."""
    block = fx["block"]
    name = name.replace(".mlp.", "." + block + ".") if block != "mlp" else name
    gate, up, down = fx["roles"]
    if name.endswith(".experts.gate_up_proj"):
        prefix = name[: -len("gate_up_proj")]
        width = grad.shape[1] // 2
        out = {}
        for e in range(grad.shape[0]):
            out[f"{prefix}{e}.{gate}.weight"] = grad[e, :width]
            out[f"{prefix}{e}.{up}.weight"] = grad[e, width:]
        return out
    if name.endswith(".experts.down_proj"):
        prefix = name[: -len("down_proj")]
        return {f"{prefix}{e}.{down}.weight": grad[e] for e in range(grad.shape[0])}
    return {name: grad}


def save_grads(fx, model, path, saved):
    grads = {}
    for name, p in model.named_parameters():
        for stored, g in stored_names(fx, name, p.grad.detach()).items():
            grads[stored] = g.to(torch.float32).contiguous()
    assert set(grads) == saved, f"gradient names {sorted(set(grads) ^ saved)[:6]} differ from the saved tensors'"
    save_file(grads, str(path), metadata={"format": "pt"})


def tokens_for(fx):
    gen = torch.Generator().manual_seed(fx["seed"] + 7)
    return torch.randint(0, VOCAB, (TOKENS,), generator=gen)


def reference(out, fx, ids, router_logits):
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager",
                                                              experts_implementation="eager")
    model = model.to(torch.float64).eval()
    if ids is None:
        return model, None
    result = model(input_ids=ids, labels=ids, output_router_logits=router_logits)
    result.loss.backward()
    return model, result


DOCUMENT_LENGTHS = [31, 1, 57, 12, 70, 32]


def make_documents(out, fx, tokens, saved):
    """The tokens as packed documents, each run by itself: the cross-entropy summed over the
    documents' targets, and the load-balancing loss over all their tokens' router logits."""
    assert sum(DOCUMENT_LENGTHS) == len(tokens)
    record = {"starts": [], "lengths": DOCUMENT_LENGTHS, "reference_dtype": "float64",
              "transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}
    for aux in (False, True):
        model, _ = reference(out, fx, None, False)
        total, targets, at, logits = 0.0, 0, 0, []
        for length in DOCUMENT_LENGTHS:
            if not aux:
                record["starts"].append(at)
            ids = torch.tensor(tokens[at:at + length])[None]
            at += length
            result = model(input_ids=ids, output_router_logits=True)
            logits.append(result.router_logits)
            if length < 2:
                continue
            total = total + torch.nn.functional.cross_entropy(result.logits[0, :-1], ids[0, 1:], reduction="sum")
            targets += length - 1
        loss = total / targets
        if aux:
            gate = tuple(torch.cat([doc[layer] for doc in logits]) for layer in range(len(logits[0])))
            modeling = sys.modules[type(model).__module__]
            aux_loss = modeling.load_balancing_loss_func(gate, model.num_experts, model.num_experts_per_tok, None)
            loss = loss + AUX_COEF * aux_loss
            record["aux_loss"] = aux_loss.item()
            record["loss_with_aux"] = loss.item()
        else:
            record["loss"] = loss.item()
        record["targets"] = targets
        loss.backward()
        save_grads(fx, model, out / ("documents_aux_grads.safetensors" if aux else "documents_grads.safetensors"), saved)
    (out / "documents.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def make(out, fx, tokenizer):
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if old.is_file():
            old.unlink()
    config = fx["config"]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fill_weights(model, fx["seed"])
    model.generation_config.bos_token_id = BOS
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    model.to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert any(".experts.0." in n for n in saved), "save_pretrained wrote the per-expert layout"

    ids = tokens_for(fx)[None]
    plain, result = reference(out, fx, ids, False)
    save_grads(fx, plain, out / "grads.safetensors", saved)
    with_aux, aux_result = reference(out, fx, ids, True)
    save_grads(fx, with_aux, out / "aux_grads.safetensors", saved)
    golden = {
        "model": fx["name"],
        "architecture": type(plain).__name__,
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "dtype": "bfloat16",
        "reference_dtype": "float64",
        "tokens": ids[0].tolist(),
        "loss": result.loss.item(),
        "aux_loss": aux_result.aux_loss.item(),
        "loss_with_aux": aux_result.loss.item(),
        "router_aux_loss_coef": AUX_COEF,
        "text_samples": TEXT_SAMPLES,
        "text_ids": [tokenizer.encode(t) for t in TEXT_SAMPLES],
        "parameters": sorted(saved),
    }
    assert abs(golden["loss_with_aux"] - golden["loss"] - AUX_COEF * golden["aux_loss"]) < 1e-6  # the aux sums run in float32
    (out / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    make_documents(out, fx, golden["tokens"], saved)
    return golden


def main():
    tokenizer = start_fixture_run()
    for fx in FIXTURES:
        base = Path("tests/golden/moe") / fx["name"]
        golden = make(base, fx, tokenizer)
        if fx["name"] == "qwen3-moe":  # LoRA on the attention (upipe refuses the experts: see lora.cpp)
            make_lora(base, Path("tests/golden/lora") / fx["name"], golden["tokens"],
                      targets=["q_proj", "k_proj", "v_proj", "o_proj"])
        size = sum(p.stat().st_size for p in base.iterdir())
        print(f"{fx['name']}: {golden['architecture']} loss={golden['loss']:.9f} aux={golden['aux_loss']:.9f} "
              f"with aux={golden['loss_with_aux']:.9f} bytes={size}")


if __name__ == "__main__":
    main()
