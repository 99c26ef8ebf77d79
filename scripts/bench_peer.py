#!/usr/bin/env python3
"""The peer of `upipe bench`: Hugging Face transformers + PyTorch on the same model, length and GPU.

usage: bench_peer.py --model llama3.2-1b|llama3-8b|tiny [--layers N] [--seq-len 32768] [--repeats 3]
                     [--warmup 1] [--optimizer none|adamw] [--seed 0] [--json PATH] [--device cuda|cpu|meta]

Builds LlamaForCausalLM from a config written here (no download; random init, seeded) in bf16 on
the device, with SDPA attention and non-reentrant gradient checkpointing of every decoder layer.
One step is a forward of one sequence of --seq-len random token ids (batch 1) with labels = the
ids (the model's shifted cross-entropy) and an all-ones attention mask (as a tokenizer gives),
loss.backward(), then either AdamW (fused where the device has it) step + zero_grad, or, with
--optimizer none, the grads set to None. --warmup steps run untimed, then --repeats timed ones;
the row gives the fastest and, in the JSON, the mean. How transformers called SDPA in the first
step (mask or is_causal, GQA) is printed and kept in the JSON as sdpa_call.
--layers N keeps only N decoder layers (a slice: per-layer time = step / N). --device meta only
builds the model and prints its parameter count and model FLOPs per step.

Model FLOPs per step follow upipe: 6 N_matmul S + 6 L H d S^2, with N_matmul every weight used
in a matmul (the lm head counted even when tied to the embedding; no embedding lookup, no norms).
Out of memory: one line saying so, the JSON (if asked) with "oom": true, and exit status 3.
"""
import argparse
import inspect
import json
import platform
import sys
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
MODELS = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_scaling=LLAMA3_ROPE,
                      tie_word_embeddings=False),
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        rope_scaling=dict(LLAMA3_ROPE, factor=32.0), tie_word_embeddings=True),
    # For a CPU smoke test: the 8B's rope, everything else shrunk.
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False),
}
ROPE_THETA = 500000.0


def make_config(name, layers, seq_len):
    spec = dict(MODELS[name])
    if layers is not None:
        spec["num_hidden_layers"] = layers
    rope = dict(spec.pop("rope_scaling"))
    # transformers 5 takes rope_theta inside rope_parameters; 4.x takes rope_theta and rope_scaling.
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        spec["rope_parameters"] = dict(rope, rope_theta=ROPE_THETA)
    else:
        spec["rope_theta"] = ROPE_THETA
        spec["rope_scaling"] = rope
    return LlamaConfig(**spec, rms_norm_eps=1e-5, max_position_embeddings=max(seq_len, 131072),
                       attn_implementation="sdpa", use_cache=False)


def model_flops(c, seq_len):
    D, F, V, H, K, d = (c.hidden_size, c.intermediate_size, c.vocab_size, c.num_attention_heads,
                        c.num_key_value_heads, c.head_dim)
    n_matmul = c.num_hidden_layers * (D * H * d + 2 * D * K * d + H * d * D + 3 * D * F) + V * D
    return 6.0 * n_matmul * seq_len + 6.0 * c.num_hidden_layers * H * d * float(seq_len) ** 2


def build_model(config, dev, seed):
    torch.manual_seed(seed)
    # Parameters are created in bf16 directly on the device: no fp32 copy of the model anywhere.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    # No model.to(bf16): that would also round the rotary inv_freq buffer (fp32, as from_pretrained leaves it).
    wrong = {q.dtype for q in model.parameters()} - {torch.bfloat16}
    if wrong:
        raise RuntimeError(f"parameters built in {wrong}, not bf16")
    model.config.use_cache = False
    # transformers 5 renames gradient_checkpointing_enable (deprecated) to activation_checkpointing_enable.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def make_optimizer(model, kind):
    if kind == "none":
        return None, ""
    try:
        return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True), "fused"
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(model.parameters(), lr=1e-5), "not fused"


def is_oom(e):
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def timed_step(model, ids, mask, opt, dev):
    """One training step; returns (milliseconds, loss tensor)."""
    def step():
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        return loss.detach()

    if dev.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), loss
    t0 = time.perf_counter()
    loss = step()
    loss.item()
    return 1e3 * (time.perf_counter() - t0), loss


def record_sdpa_calls(calls):
    """Wraps torch's SDPA to note how transformers calls it; returns the undo. The fast path is
    is_causal=True, no mask and enable_gqa (no K/V repeat); a mask rules out the flash kernel."""
    original = torch.nn.functional.scaled_dot_product_attention

    def wrapper(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append({"attn_mask": None if attn_mask is None else list(attn_mask.shape), "is_causal": is_causal,
                      "enable_gqa": bool(kwargs.get("enable_gqa", False)), "q": list(q.shape), "k": list(k.shape)})
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = wrapper
    return lambda: setattr(torch.nn.functional, "scaled_dot_product_attention", original)


def write_json(path, result):
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--layers", type=int, help="decoder layers to run (a slice of the model); default all")
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--optimizer", choices=["none", "adamw"], default="none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    p.add_argument("--device", choices=["cuda", "cpu", "meta"], default="cuda")
    a = p.parse_args()
    if (a.layers is not None and a.layers < 1) or a.repeats < 1 or a.warmup < 0 or a.seq_len < 2:
        p.error("need --layers >= 1, --repeats >= 1, --warmup >= 0, --seq-len >= 2")
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no GPU (use --device cpu)")

    config = make_config(a.model, a.layers, a.seq_len)
    L, S = config.num_hidden_layers, a.seq_len
    total_layers = MODELS[a.model]["num_hidden_layers"]
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or dev.type)
    flops = model_flops(config, S)
    result = {"peer": "transformers+pytorch", "torch": torch.__version__, "transformers": transformers.__version__,
              "cudnn": torch.backends.cudnn.version(), "device": device_name, "model": a.model, "layers": L,
              "seq_len": S, "repeats": a.repeats, "step_ms": None, "step_ms_mean": None, "layer_ms": None,
              "tokens_per_s": None, "model_tflops": None, "model_flops_per_step": flops, "peak_bytes": None,
              "loss": None, "attn_implementation": None, "gradient_checkpointing": None,
              "optimizer": a.optimizer, "warmup": a.warmup, "parameters": None, "sdpa_call": None, "oom": False}
    step_what = ("forward+backward, grads set to None" if a.optimizer == "none"
                 else "training step with torch.optim.AdamW")
    print(f"# peer transformers+pytorch  torch {torch.__version__}  transformers {transformers.__version__}  "
          f"cuDNN {result['cudnn']}  on {device_name}", flush=True)

    try:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        model = build_model(config, dev, a.seed)
        params = sum(q.numel() for q in model.parameters())
        result["parameters"] = params
        result["attn_implementation"] = model.config._attn_implementation
        flag = ("is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing")
                else "is_gradient_checkpointing")  # transformers 5 renames it
        result["gradient_checkpointing"] = bool(getattr(model, flag))
        print(f"# model={a.model}  parameters={params:,}  layers={L} of {total_layers}"
              f"{f' (a slice: per-layer time = step / {L})' if L != total_layers else ''}  "
              f"attn={result['attn_implementation']}  gradient checkpointing="
              f"{'non-reentrant' if result['gradient_checkpointing'] else 'OFF'}  bf16  batch 1  "
              f"model GFLOP/step={flops / 1e9:,.3f}", flush=True)
        if dev.type == "meta":
            write_json(a.json, result)
            return
        opt, fused = make_optimizer(model, a.optimizer)
        if opt is not None:
            step_what += f" ({fused})"
        print(f"# {step_what}; {a.warmup} warm-up + {a.repeats} timed steps, fastest shown", flush=True)
        g = torch.Generator().manual_seed(a.seed)
        ids = torch.randint(0, config.vocab_size, (1, S), generator=g).to(dev)
        # An all-ones mask, as a tokenizer gives. Without it transformers 4.5x (use_cache=False, no mask) takes the
        # position ids for packed sequences and builds an S x S mask: no flash kernel, K/V repeated for the groups.
        # With it, SDPA gets is_causal=True, no mask and enable_gqa (checked with 4.57 and 5.24).
        mask = torch.ones_like(ids)
        times, first_loss = [], None
        for i in range(a.warmup + a.repeats):
            calls = []
            undo = record_sdpa_calls(calls) if i == 0 else None
            try:
                ms, loss = timed_step(model, ids, mask, opt, dev)
            finally:
                if undo:
                    undo()
            if first_loss is None:
                first_loss = loss.float().item()
                result["sdpa_call"] = calls[0] if calls else None
                fast = bool(calls) and calls[0]["attn_mask"] is None and calls[0]["is_causal"]
                print(f"# SDPA called {len(calls)} times in the first step, first as {calls[0] if calls else None}"
                      f"{'' if fast else '  WARNING: not the causal no-mask fast path'}", flush=True)
            if i >= a.warmup:
                times.append(ms)
    except Exception as e:  # noqa: BLE001 (only out-of-memory is handled; the rest is raised again)
        if not is_oom(e):
            raise
        msg = " ".join(str(e).split())
        print(f"OOM: {a.model} with {L} layers at seq_len {S} does not fit on {device_name}: {msg}", flush=True)
        result.update(oom=True, error=msg)
        if dev.type == "cuda":
            result["peak_bytes"] = torch.cuda.max_memory_allocated(dev)
        write_json(a.json, result)
        sys.exit(3)

    best = min(times)
    result.update(step_ms=best, step_ms_mean=sum(times) / len(times), layer_ms=best / L,
                  tokens_per_s=S / (best / 1e3), model_tflops=flops / (best / 1e3) / 1e12, loss=first_loss,
                  peak_bytes=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None)
    peak = f"{result['peak_bytes'] / 2**30:9.2f}" if result["peak_bytes"] is not None else f"{'-':>9s}"
    print(f"{'model':12s} {'layers':>6s} {'S':>9s} {'reps':>4s} {'step_ms':>11s} {'mean_ms':>11s} {'layer_ms':>10s} "
          f"{'tok/s/GPU':>11s} {'TFLOP/s':>8s} {'peak_GiB':>9s} {'loss':>8s}")
    print(f"{a.model:12s} {L:6d} {S:9d} {a.repeats:4d} {best:11.2f} {result['step_ms_mean']:11.2f} "
          f"{result['layer_ms']:10.2f} {result['tokens_per_s']:11.0f} {result['model_tflops']:8.1f} {peak} "
          f"{first_loss:8.4f}", flush=True)
    write_json(a.json, result)


if __name__ == "__main__":
    main()
