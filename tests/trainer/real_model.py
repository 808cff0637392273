"""A real model, built here: a small LlamaForCausalLM saved with safetensors, a byte-level BPE tokenizer
trained with `tokenizers` (with a chat template), Alpaca-format and chat-format data, and a recipe
file that trains them. Nothing is downloaded; the hub is never asked (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
WORDS = (
    "apple river stone cloud green quiet north seven paper light music winter garden silver "
    "bridge window orange candle forest mirror"
).split()
HUB_ID = "skyspot-test/tiny-llama"  # how the test model is known in a planted Hugging Face cache


def alpaca_records(n: int = 96, seed: int = 7) -> list[dict]:
    """Small instruction tasks with a learnable answer: reverse, count, repeat."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = rng.sample(WORDS, rng.randint(2, 4))
        kind = i % 3
        if kind == 0:
            out.append(
                {
                    "instruction": "Reverse the order of the words.",
                    "input": " ".join(words),
                    "output": " ".join(reversed(words)),
                }
            )
        elif kind == 1:
            out.append(
                {
                    "instruction": f"How many words are in: {' '.join(words)}?",
                    "input": "",
                    "output": f"There are {len(words)} words.",
                }
            )
        else:
            out.append(
                {
                    "instruction": "Repeat the first word twice.",
                    "input": " ".join(words),
                    "output": f"{words[0]} {words[0]}",
                }
            )
    return out


def chat_records(n: int = 8) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": r["instruction"] + " " + r["input"]},
                {"role": "assistant", "content": r["output"]},
                {"role": "user", "content": "Thanks."},
                {"role": "assistant", "content": "You are welcome."},
            ]
        }
        for r in alpaca_records(n)
    ]


def build_tokenizer(directory: Path, corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def build_model(directory: Path, vocab_size: int, tokenizer, seed: int = 0) -> None:
    """A 2-layer Llama with large random weights (initializer_range 0.2), so its loss on the data is
    far from any other initialisation's: a run that silently started from random weights cannot
    match it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory, safe_serialization=True)


def build(root: Path) -> dict[str, Path]:
    """model/ (config, safetensors, tokenizer), alpaca.jsonl, held_out.jsonl (other Alpaca records, for
    data.eval_split), chat.jsonl; returns their paths."""
    root.mkdir(parents=True, exist_ok=True)
    records = alpaca_records()
    corpus = [" ".join(r.values()) for r in records] + [
        "Below is an instruction that describes a task. ### Instruction: ### Input: ### Response:"
    ] * 20
    model_dir = root / "model"
    tokenizer = build_tokenizer(model_dir, corpus)
    build_model(model_dir, len(tokenizer), tokenizer)
    alpaca = root / "alpaca.jsonl"
    alpaca.write_text("".join(json.dumps(r) + "\n" for r in records))
    held_out = root / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in alpaca_records(24, seed=8)))
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in chat_records()))
    return {"model": model_dir, "alpaca": alpaca, "held_out": held_out, "chat": chat}


def recipe_file(
    path: Path, model, data: Path, *, lora: bool = False, store: Path | None = None, held_out: Path | None = None
) -> Path:
    """A recipe for the local executor: 2 CPU ranks, fp32, ZeRO-3, Alpaca format; `model` a directory or
    a hub id. With `lora`: rank-4 adapters on every linear layer and a merged export. With `held_out`:
    evaluated on that file (data.eval_split) every 4 steps."""
    lora_block = "  lora: {r: 4, alpha: 8, dropout: 0.1}\n" if lora else ""
    tail = ("export:\n  merge: true\n" if lora else "") + (f"storage:\n  store: {store}\n" if store else "")
    tail += "eval:\n  every_steps: 4\n" if held_out else ""
    path.write_text(f"""name: real-tiny{"-lora" if lora else ""}
description: a small Llama from a local directory on Alpaca-format data
model:
  hub_id: {model}
data:
  source: {data}
  format: alpaca
{f"  eval_split: {held_out}{chr(10)}" if held_out else ""}train:
  steps: 12
  micro_batch_size: 2
  grad_accum: 1
  lr: 1.0e-3
  warmup_steps: 2
  seq_len: 128
  log_every: 4
{lora_block}deepspeed:
  zero_stage: 3
checkpoint:
  every_steps: 5
  keep: 3
  train_through_notice: false   # save at the notice's step: the tests preempt at chosen steps
resources:
  cpu_ranks: 2
  cpus: "2+"
  num_nodes: 1
  disk_size: 50
  local_only: true
{tail}""")
    return path


def plant_in_hub_cache(model_dir: Path, cache: Path, repo: str = HUB_ID, commit: str = "0" * 40) -> Path:
    """Put `model_dir` into a Hugging Face cache as `repo` at `main` (what a download would leave)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file():
            target = snapshot / path.name
            if not target.exists():
                os.link(path, target)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    return snapshot
