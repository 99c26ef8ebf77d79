#!/usr/bin/env python3
"""Builds small Hugging Face checkpoints, plus transformers' own numbers on them, for
upipe's checkpoint import/export tests. Everything is made on this machine (no hub access).

usage: make_hf_fixtures.py OUT_DIR        (the repository keeps them in tests/golden/hf)

Writes three model directories under OUT_DIR, each saved by transformers' own
`save_pretrained` (model weights, config.json, generation_config.json) and by
`PreTrainedTokenizerFast.save_pretrained` (tokenizer files):

  llama-yarn-shards/   LlamaForCausalLM, YaRN rope (factor 4, 32 -> 128 positions),
                       untied lm_head, bfloat16, split over 3 safetensors shards with
                       model.safetensors.index.json
  qwen3-tied/          Qwen3ForCausalLM, head_dim 32 so heads*head_dim != hidden_size,
                       tied embeddings, bfloat16, one model.safetensors
  llama-fp16-linear/   LlamaForCausalLM, linear rope (factor 2), float16, one file

Weights are drawn in float32 with fixed seeds (norm weights 1 + 0.1 N(0,1), embeddings
N(0,1), other matrices N(0,1)/sqrt(fan_in)) and then cast to the stored dtype. Every
config.json carries two fields upipe ignores ("initializer_range" 0.01 and
"fixture_note"), so a round trip can check that unknown fields survive.

Each directory also gets:
  golden.json        reference numbers from the saved directory re-loaded in float32
                     with eager attention: 62 random tokens, causal-LM loss, the 61
                     per-target cross entropies, the rope parameters as transformers holds
                     them, rotary inv_freq and attention_scaling, versions, stored dtype,
                     and three text samples with the tokenizer's ids for them
  grads.safetensors  float32 gradient of the loss for every parameter, named as
                     `named_parameters()` names them (tied model: the embedding only)

The tokenizer is a byte-level BPE (vocab <= 256; <pad>=0, <s>=1, </s>=2, <s> prepended
by `encode`) trained on the text embedded below. The run is deterministic: same
versions in, same bytes out. Runs on the CPU, one thread.
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
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

VOCAB = 256
TOKENS = 62  # not a multiple of 4 or 8, as in make_golden.py
PAD, BOS, EOS = 0, 1, 2

# Training text for the tokenizer. It has to contain every character of TEXT_SAMPLES
# (the BPE has no byte fallback beyond the bytes it saw), including the multi-byte ones.
CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.
A small model learns to predict the next token from the tokens before it.
Pipelines split the layers of a model across devices, and every stage passes its
activations to the next one. Gradients flow back the other way, stage by stage.
def add(a, b): return a + b
def mul(x, y): return x * y
for i in range(10): print(i, i * i)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 -7 +1e-5
Grüße aus München! Die Bäume sind grün, und die Straße ist naß.
Ein Mädchen, ein Kätzchen, ein Hündchen: schön, müde, fröhlich.
Le café est très bon; l'été à Paris, c'est déjà la fête. Naïve, façade, garçon.
¿Dónde está la estación? Mañana será un día soleado, señor.
Привет, мир! Как дела? Всё хорошо, спасибо.
Γειά σου κόσμε. Η γάτα κοιμάται στον ήλιο. αβγδε λμπ ω
東京は日本の首都です。今日はいい天気ですね。
你好，世界！我们一起学习。
한국어 문장도 조금 있습니다. 안녕하세요.
Emoji: 🙂 🚀 ✨ 👍 — and symbols: € £ ¥ © ° ± × ÷ → ∑ √ ∞
"Quotes", 'apostrophes', (parentheses), [brackets], {braces}, <angles> & more...
Tabs\tand  double  spaces, new
lines, and the end.
"""

TEXT_SAMPLES = [
    "The quick brown fox.",
    "Grüße aus München, 東京 🙂 — naïve café!",
    "def add(a, b): return a + b",
]


def build_tokenizer():
    """A byte-level BPE with the three special tokens at ids 0, 1, 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=1,
        special_tokens=["<pad>", "<s>", "</s>"],
        show_progress=False,
    )
    lines = CORPUS.splitlines(keepends=True)
    tok.train_from_iterator(lines * 3, trainer=trainer, length=3 * len(lines))
    assert tok.token_to_id("<pad>") == PAD and tok.token_to_id("<s>") == BOS
    assert tok.token_to_id("</s>") == EOS and tok.get_vocab_size() <= VOCAB
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=4096)
    for s in TEXT_SAMPLES:  # every sample must survive the round trip
        assert fast.decode(fast.encode(s), skip_special_tokens=True) == s, s
    return fast


def fill_weights(model, seed):
    """Random, non-symmetric weights drawn in float32 in named_parameters order."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))


COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, rope_theta=10000.0, bos_token_id=BOS, eos_token_id=EOS,
    initializer_range=0.01,  # known to transformers, unused by upipe
    fixture_note="kept",     # unknown to both: must survive a round trip
)

FIXTURES = [
    dict(name="llama-yarn-shards", seed=1001, dtype=torch.bfloat16, shard="100KB", shards=3,
         config=lambda: transformers.LlamaConfig(
             **COMMON, intermediate_size=160, head_dim=16, rms_norm_eps=1e-5,
             max_position_embeddings=128, tie_word_embeddings=False,
             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                  original_max_position_embeddings=32,
                                  beta_fast=32.0, beta_slow=1.0))),
    dict(name="qwen3-tied", seed=1002, dtype=torch.bfloat16, shard=None, shards=1,
         config=lambda: transformers.Qwen3Config(
             **COMMON, intermediate_size=96, head_dim=32, rms_norm_eps=1e-6,
             max_position_embeddings=128, tie_word_embeddings=True,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    dict(name="llama-fp16-linear", seed=1003, dtype=torch.float16, shard=None, shards=1,
         config=lambda: transformers.LlamaConfig(
             **COMMON, intermediate_size=160, head_dim=16, rms_norm_eps=1e-5,
             max_position_embeddings=64, tie_word_embeddings=False,
             rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
]


def jsonable(x):
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return x


def make_one(out, fx, tokenizer):
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():  # a re-run must not leave stale shards behind
        if old.is_file():
            old.unlink()

    # 1. random model in float32, saved in the stored dtype
    config = fx["config"]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fill_weights(model, fx["seed"])
    model.generation_config.bos_token_id = BOS
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    model.to(fx["dtype"])
    kwargs = {"max_shard_size": fx["shard"]} if fx["shard"] else {}
    model.save_pretrained(out, **kwargs)
    tokenizer.save_pretrained(out)
    del model

    shard_files = sorted(p.name for p in out.glob("model*.safetensors"))
    if fx["shards"] > 1:
        assert len(shard_files) == fx["shards"], shard_files
        assert (out / "model.safetensors.index.json").is_file()
    else:
        assert shard_files == ["model.safetensors"], shard_files
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    assert gen_cfg.get("bos_token_id") == BOS and gen_cfg.get("eos_token_id") == EOS, gen_cfg

    # 2. reference numbers from the saved directory, upcast to float32
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager")
    model.eval()  # no dropout (it is 0 anyway); gradients still flow
    gen = torch.Generator().manual_seed(fx["seed"] + 7)
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=gen)
    result = model(input_ids=ids, labels=ids)
    result.loss.backward()
    per_pos = F.cross_entropy(result.logits[0, :-1].float(), ids[0, 1:], reduction="none")
    assert torch.allclose(per_pos.mean(), result.loss, rtol=1e-6, atol=0), (per_pos.mean(), result.loss)

    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        grads[name] = p.grad.detach().to(torch.float32).contiguous()
    save_file(grads, out / "grads.safetensors", metadata={"format": "pt"})

    rotary = model.model.rotary_emb
    tok = transformers.AutoTokenizer.from_pretrained(out)
    golden = {
        "model": fx["name"],
        "architecture": type(model).__name__,
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "dtype": str(fx["dtype"]).replace("torch.", ""),
        "tokens": ids[0].tolist(),
        "loss": result.loss.item(),
        "per_position_loss": per_pos.tolist(),
        "rope": jsonable(dict(model.config.rope_parameters)),
        "inv_freq": rotary.inv_freq.to(torch.float32).tolist(),
        "attention_scaling": float(rotary.attention_scaling),
        "text_samples": TEXT_SAMPLES,
        "text_ids": [tok.encode(s) for s in TEXT_SAMPLES],
        "text_ids_no_special": [tok.encode(s, add_special_tokens=False) for s in TEXT_SAMPLES],
        "parameters": [name for name, _ in model.named_parameters()],
    }
    (out / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    return golden, shard_files


def start_fixture_run():
    """The fixture scripts' common start: into the repository root (argv[1], else this script's repository),
    deterministic single-threaded torch, transformers quiet; returns the fixtures' tokenizer."""
    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent
    os.chdir(root)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    return build_tokenizer()


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    root = Path(sys.argv[1])
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    tokenizer = build_tokenizer()
    for fx in FIXTURES:
        out = root / fx["name"]
        golden, shard_files = make_one(out, fx, tokenizer)
        size = sum(p.stat().st_size for p in out.iterdir())
        print(f"{fx['name']}: {golden['architecture']} {golden['dtype']} "
              f"weights={shard_files} loss={golden['loss']:.6f} "
              f"rope={golden['rope']['rope_type']} attention_scaling={golden['attention_scaling']:.6f} "
              f"files={sorted(p.name for p in out.iterdir())} bytes={size}")


if __name__ == "__main__":
    main()
