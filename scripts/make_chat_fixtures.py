#!/usr/bin/env python3
"""The chat fine-tuning fixture: a tiny Llama whose tokenizer has chat tokens, chat templates,
a few conversations, and transformers' loss and gradients on them with labels -100.

usage: make_chat_fixtures.py OUT_DIR        (the repository keeps it in tests/golden/hf/llama-chat)

Writes OUT_DIR, a model directory as save_pretrained writes it, plus:
  templates/*.jinja   chat templates written for these tests, in the styles models ship:
                      chatml.jinja (system default, tools, tool calls; what the directory's
                      own chat_template.jinja holds) and chatml_generation.jinja (the same
                      text with {% generation %} around each assistant turn and its
                      <|im_end|>), headers.jinja (BOS and header tokens, a namespace and
                      loop controls), and reasoning.jinja / reasoning_generation.jinja (which
                      drop the reasoning of past assistant turns, so a turn renders
                      differently inside the conversation than after its prefix)
  chat.jsonl          the rows: two documents, three conversations (one with a tool call),
                      a plain prompt/completion pair, in the order they are packed
  chat.json           for each row its tokens and its loss mask, as transformers gives them
                      (apply_chat_template on chatml_generation.jinja with
                      return_assistant_tokens_mask for conversations; for documents BOS +
                      ids + EOS, all targets; for the pair BOS + ids of prompt + completion
                      + EOS, the completion's tokens by their offsets and EOS targets); the
                      packed sequence (tokens, mask, document starts); its loss: the sum over
                      rows of transformers' cross-entropy sums with labels -100 where the
                      mask is 0, each row run alone, over the number of targets
  chat_grads.safetensors   the float32 gradient of that loss for every parameter
Runs on the CPU in float32 with eager attention, deterministic.
"""
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import AddedToken, Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASE_TOKENIZER = ROOT / "tests" / "golden" / "hf" / "llama-fp16-linear" / "tokenizer.json"
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
VOCAB = 272  # the tokenizer's 261 ids and unused rows, as released models pad theirs
SEED = 1004

CHATML = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_text = messages[0]['content'] %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system_text = 'Be helpful.' %}
    {%- set turns = messages %}
{%- endif %}
{{- '<|im_start|>system\\n' + system_text }}
{%- if tools %}
    {{- '\\n\\nTools:' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in turns %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('this template has no role ' + message['role']) }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' }}
    {%- if message['role'] == 'assistant' %}
        @@OPEN@@
        {%- if message['content'] is defined %}
            {{- message['content'] }}
        {%- endif %}
        {%- if message['tool_calls'] is defined %}
            {%- for call in message['tool_calls'] %}
                {{- '<call>' + (call['function'] | tojson) + '<end>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>' }}
        @@CLOSE@@
        {{- '\\n' }}
    {%- else %}
        {{- message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

HEADERS = """{{- bos_token }}
{%- set ns = namespace(users=0) %}
{%- for message in messages %}
    {%- if message['role'] == 'system' and not loop.first %}
        {{- raise_exception('the system message goes first') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- set ns.users = ns.users + 1 %}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['role'] == 'user' %}
        {{- '(' + ns.users | string + ') ' }}
    {%- endif %}
    {{- message['content'] | trim + '<|eot_id|>' }}
    {%- if loop.last %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

REASONING = """{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' }}
    {%- if message['role'] == 'assistant' %}
        @@OPEN@@
        {%- if loop.index0 > ns.last_user and message['reasoning_content'] is defined %}
            {{- '<think>' + message['reasoning_content'] + '</think>' }}
        {%- endif %}
        {{- message['content'] + '<|im_end|>' }}
        @@CLOSE@@
        {{- '\\n' }}
    {%- else %}
        {{- message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def templates():
    plain = {"@@OPEN@@\n": "", "@@CLOSE@@\n": ""}
    tagged = {"@@OPEN@@\n": "{%- generation %}\n", "@@CLOSE@@\n": "{%- endgeneration %}\n"}

    def fill(text, marks):
        for k, v in marks.items():
            text = text.replace(" " * 8 + k, " " * 8 + v if v else "")
        return text

    return {"chatml.jinja": fill(CHATML, plain), "chatml_generation.jinja": fill(CHATML, tagged),
            "headers.jinja": HEADERS, "reasoning.jinja": fill(REASONING, plain),
            "reasoning_generation.jinja": fill(REASONING, tagged)}


ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Adds two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}

ROWS = [
    {"text": "The dog sleeps; the fox runs away."},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How much is 2 + 2?"},
                  {"role": "assistant", "content": "4."}]},
    {"messages": [{"role": "user", "content": "Name a fox."}, {"role": "assistant", "content": "The quick brown fox."},
                  {"role": "user", "content": "And a dog?"}, {"role": "assistant", "content": "The lazy dog."}]},
    {"text": "Numbers: 0 1 2 3"},
    {"tools": [ADD_TOOL],
     "messages": [{"role": "user", "content": "Add 2 and 3."},
                  {"role": "assistant", "tool_calls": [{"type": "function",
                                                        "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                  {"role": "tool", "content": "5"}, {"role": "assistant", "content": "The sum is 5."}]},
    {"prompt": "def add(a, b):", "completion": " return a + b"},
]


def build_tokenizer(out, chat_template):
    tok = Tokenizer.from_file(str(BASE_TOKENIZER))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_TOKENS])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", model_max_length=4096)
    fast.chat_template = chat_template
    fast.save_pretrained(out)
    assert tok.get_vocab_size() <= VOCAB
    return transformers.AutoTokenizer.from_pretrained(out)


def fill_weights(model):
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if p.dim() == 1 else noise if "embed" in name else noise / math.sqrt(p.shape[1]))


def row_example(tok, row, tagged):
    """(ids, mask) of one row as transformers (and TRL's rules for the pair) give them."""
    if "messages" in row:
        out = tok.apply_chat_template(row["messages"], tools=row.get("tools"), chat_template=tagged,
                                      return_assistant_tokens_mask=True, return_dict=True)
        return list(out["input_ids"]), list(out["assistant_masks"])
    if "text" in row:
        ids = tok(row["text"])["input_ids"] + [tok.eos_token_id]  # the post-processor's BOS, then EOS
        return ids, [1] * len(ids)
    text = row["prompt"] + row["completion"]
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    begin = len(row["prompt"])
    mask = [1 if end > begin else 0 for _, end in enc["offset_mapping"]]
    return [tok.bos_token_id] + enc["input_ids"] + [tok.eos_token_id], [0] + mask + [1]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.rglob("*"):
        if old.is_file():
            old.unlink()
    texts = templates()
    (out / "templates").mkdir(exist_ok=True)
    for name, text in texts.items():
        (out / "templates" / name).write_text(text)
    tok = build_tokenizer(out, texts["chatml.jinja"])
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                                      max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
                                      eos_token_id=2, rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fill_weights(model)
    model.to(torch.bfloat16).save_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    with open(out / "chat.jsonl", "w") as f:
        for row in ROWS:
            f.write(json.dumps(row) + "\n")

    examples = [row_example(tok, row, texts["chatml_generation.jinja"]) for row in ROWS]
    total, targets, sums, per_target = 0.0, 0, [], []
    for ids, mask in examples:
        x = torch.tensor(ids)[None]
        labels = torch.where(torch.tensor(mask, dtype=torch.bool), x[0], torch.tensor(-100))
        logits = model(input_ids=x).logits[0, :-1]
        row = F.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="none")
        # the packed sequence's target t predicts token t + 1: none where masked, none across rows
        if per_target:
            per_target.append(None)
        per_target += [v if m else None for v, m in zip(row.tolist(), mask[1:])]
        loss_sum = F.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="sum")
        total = total + loss_sum
        sums.append(loss_sum.item())
        targets += int((labels[1:] != -100).sum())
    loss = total / targets
    loss.backward()
    save_file({n: p.grad.contiguous() for n, p in model.named_parameters()}, str(out / "chat_grads.safetensors"))
    starts, tokens, mask = [], [], []
    for ids, m in examples:
        starts.append(len(tokens))
        tokens += ids
        mask += m
    assert len(per_target) == len(tokens) - 1
    golden = {"rows": [{"tokens": ids, "mask": m} for ids, m in examples], "tokens": tokens, "mask": mask,
              "starts": starts, "loss": float(loss.detach()), "targets": targets, "loss_sums": sums,
              "per_target_loss": per_target,
              "transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}
    (out / "chat.json").write_text(json.dumps(golden, indent=1) + "\n")
    print(f"{out}: {len(tokens)} tokens, {targets} targets, loss {float(loss):.6f}")


if __name__ == "__main__":
    main()
