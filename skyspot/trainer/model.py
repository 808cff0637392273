"""The model and tokenizer: a hub model, or one built from an inline config (tiny), under zero.Init.

With ZeRO-3 the parameters are partitioned as they are created (deepspeed.zero.Init), so a
model larger than one device's memory can be built at all; for hub models, transformers does
the same inside from_pretrained while an HfDeepSpeedConfig is alive.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from skyspot.errors import UsageError

BYTE_TOKENIZER_FILE = "skyspot_tokenizer.json"


class ByteTokenizer:
    """Bytes 0-255 are their own ids; then BOS, EOS and PAD. No download, any text round-trips."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_token_id] if add_bos else []) + ids + ([self.eos_token_id] if add_eos else [])

    def encode_document(self, text: str) -> list[int]:
        return self.encode(text, add_bos=True, add_eos=True)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        if skip_special_tokens:
            ids = [i for i in ids if i < 256]
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save_pretrained(self, directory: str | Path) -> None:
        (Path(directory) / BYTE_TOKENIZER_FILE).write_text(json.dumps(
            {"type": "bytes", "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
             "pad_token_id": self.pad_token_id, "vocab_size": self.vocab_size}) + "\n")

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "ByteTokenizer":
        info = json.loads((Path(directory) / BYTE_TOKENIZER_FILE).read_text())
        if info.get("type") != "bytes":
            raise ValueError(f"{directory} does not hold a byte tokenizer")
        return cls()


def load_tokenizer(model_section):
    """The byte tokenizer for `tokenizer: bytes`, else the Hugging Face tokenizer of the hub id."""
    name = model_section.tokenizer or model_section.hub_id
    if name == "bytes":
        return ByteTokenizer()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_config(model_section, tokenizer):
    """The transformers config for an inline `model.config` (special token ids from the tokenizer)."""
    from transformers import AutoConfig

    fields = dict(model_section.config)
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise UsageError("model.config needs a model_type (e.g. llama)")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        fields.setdefault(key, getattr(tokenizer, key, None))
    config = AutoConfig.for_model(model_type, **fields)
    vocab = getattr(tokenizer, "vocab_size", None)
    if vocab is not None and config.vocab_size < vocab:
        raise UsageError(f"model.config.vocab_size={config.vocab_size} is smaller than the tokenizer's {vocab}")
    return config


def build_model(recipe, ds_config: dict[str, Any], tokenizer) -> tuple[torch.nn.Module, Optional[object]]:
    """The model, partitioned as it is built. Returns (model, keepalive): keep the second alive
    while the model is in use (transformers' ZeRO-3 integration holds it through a weak reference)."""
    from transformers import AutoModelForCausalLM

    section = recipe.model
    dtype = torch.bfloat16 if recipe.deepspeed.bf16 else torch.float32
    zero3 = ds_config.get("zero_optimization", {}).get("stage") == 3
    keepalive = None
    if section.config is not None:
        config = model_config(section, tokenizer)
        max_pos = getattr(config, "max_position_embeddings", None)
        if max_pos is not None and recipe.train.seq_len > max_pos:
            raise UsageError(f"train.seq_len={recipe.train.seq_len} exceeds model.config.max_position_embeddings={max_pos}")
        model = _from_config(config, ds_config, dtype) if zero3 else AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        if zero3:
            # transformers loads under deepspeed.zero.Init while this object lives (needs `accelerate`).
            from transformers.integrations import HfDeepSpeedConfig

            keepalive = HfDeepSpeedConfig(ds_config)
        model = AutoModelForCausalLM.from_pretrained(section.hub_id, dtype=dtype)
    if recipe.deepspeed.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model, keepalive


def _from_config(config, ds_config: dict[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    """Build under deepspeed.zero.Init, then initialise the weights the way transformers would.

    Inside zero.Init each module's parameters are partitioned as soon as it is built, so
    transformers' own init (post_init) sees empty shards: it would leave PyTorch's default init
    and fails outright on the padding row of the embedding. So the model is built without a
    padding index and each module's parameters are gathered in turn, initialised on rank 0 with
    the model's own `_init_weights`, and scattered again (modifier_rank=0).
    """
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    pad = config.pad_token_id
    config.pad_token_id = None
    # No dtype= here: zero.Init takes it from the config's bf16/fp16 sections. Given an explicit
    # dtype it falls into an expression that picks bf16 on any accelerator without fp16 (DeepSpeed
    # 0.19, partition_parameters.py `_set_dtype`), so a CPU run would silently train bf16 weights.
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    wrong = {p.dtype for p in model.parameters()} - {dtype}
    if wrong:
        raise RuntimeError(f"zero.Init built {wrong} parameters, expected {dtype}")
    model.config.pad_token_id = pad
    rank = dist.get_rank() if dist.is_initialized() else 0
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    model._init_weights(module)
    return model
