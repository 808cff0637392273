"""The model and tokenizer: a pretrained model (hub or local directory), or one built from an inline
config (tiny), always under zero.Init with ZeRO-3, optionally with LoRA adapters (peft).

With ZeRO-3 the parameters are partitioned as they are created (deepspeed.zero.Init), so a model
larger than one device's memory can be built at all. Pretrained weights are then copied in one
module at a time: the module's parameters are gathered, global rank 0 reads their tensors from
the safetensors files and writes them in, and leaving the gather (modifier_rank=0) scatters them
to every rank's partition. Only rank 0 reads the files; every parameter must be found in them
(and nothing else may be), so a model can never start silently random. A resumed full fine-tune
skips the weights: the checkpoint restores every parameter.

LoRA (train.lora): the base is frozen, peft wraps the target layers, and only the adapters are
trainable; DeepSpeed then partitions the new adapter parameters too (broadcast from rank 0).
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
        (Path(directory) / BYTE_TOKENIZER_FILE).write_text(
            json.dumps(
                {
                    "type": "bytes",
                    "bos_token_id": self.bos_token_id,
                    "eos_token_id": self.eos_token_id,
                    "pad_token_id": self.pad_token_id,
                    "vocab_size": self.vocab_size,
                }
            )
            + "\n"
        )

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "ByteTokenizer":
        info = json.loads((Path(directory) / BYTE_TOKENIZER_FILE).read_text())
        if info.get("type") != "bytes":
            raise ValueError(f"{directory} does not hold a byte tokenizer")
        return cls()


def load_tokenizer(model_section, directory: Optional[Path] = None):
    """The byte tokenizer for `tokenizer: bytes`; else a Hugging Face tokenizer: model.tokenizer (a hub
    id or a local directory), or the base model's own from `directory` (base.py put its files there)."""
    name = model_section.tokenizer or (str(directory) if directory is not None else model_section.hub_id)
    if name == "bytes":
        return ByteTokenizer()
    from transformers import AutoTokenizer

    revision = model_section.revision if name == model_section.hub_id else None
    tokenizer = AutoTokenizer.from_pretrained(name, revision=revision)
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


def pretrained_config(directory: Path, tokenizer):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "vocab_size", None)
    vocab = getattr(config, "vocab_size", None)
    if size is not None and vocab is not None and size > vocab:
        raise UsageError(
            f"the tokenizer has {size} tokens but the model's embedding only {vocab}; "
            "model.tokenizer must belong to the model"
        )
    return config


def build_model(
    recipe, ds_config: dict[str, Any], tokenizer, directory: Optional[Path] = None, load_weights: bool = True
) -> tuple[torch.nn.Module, Optional[object]]:
    """The model, partitioned as it is built. `directory` holds a pretrained model's files (base.py);
    with `load_weights` its weights are copied in (a fresh start, or LoRA's frozen base), else the
    caller restores a checkpoint over it. Returns (model, keepalive): keep the second alive while
    the model is in use."""
    from transformers import AutoModelForCausalLM

    section = recipe.model
    dtype = torch.bfloat16 if recipe.deepspeed.bf16 else torch.float32
    zero3 = ds_config.get("zero_optimization", {}).get("stage") == 3
    pretrained = section.config is None
    config = pretrained_config(directory, tokenizer) if pretrained else model_config(section, tokenizer)
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and recipe.train.seq_len > max_pos:
        where = "the model's max_position_embeddings" if pretrained else "model.config.max_position_embeddings"
        raise UsageError(f"train.seq_len={recipe.train.seq_len} exceeds {where}={max_pos}")
    if zero3:
        model = _from_config(config, ds_config, dtype, init=not pretrained)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if pretrained and load_weights:
        load_weights_into(model, directory, zero3=zero3)
    if recipe.deepspeed.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if recipe.train.lora is not None:
        model = apply_lora(model, recipe)
    return model, None


def _from_config(config, ds_config: dict[str, Any], dtype: torch.dtype, *, init: bool = True) -> torch.nn.Module:
    """Build under deepspeed.zero.Init, then (with `init`) initialise the weights the way transformers would.

    Inside zero.Init each module's parameters are partitioned as soon as it is built, so
    transformers' own init (post_init) sees empty shards: it would leave PyTorch's default init
    and fails outright on the padding row of the embedding. So the model is built without a
    padding index and each module's parameters are gathered in turn, initialised on rank 0 with
    the model's own `_init_weights`, and scattered again (modifier_rank=0). A model whose weights
    come next (pretrained, or a checkpoint) skips that.
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
    if not init:
        return model
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


# --------------------------------------------------------------------------- pretrained weights


def weight_index(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (model.safetensors.index.json, or every file)."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        return {name: directory / file for name, file in weight_map.items()}
    out: dict[str, Path] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                out[name] = path
    if not out:
        raise UsageError(f"{directory} has no *.safetensors weights")
    return out


def _file_name(param_name: str, index: dict[str, Path], prefix: str) -> Optional[str]:
    """The checkpoint's name for a parameter: the same, or without the base model's prefix (a
    checkpoint of the bare decoder, e.g. `layers.0...` for `model.layers.0...`)."""
    if param_name in index:
        return param_name
    if prefix and param_name.startswith(prefix + "."):
        bare = param_name[len(prefix) + 1 :]
        if bare in index:
            return bare
    return None


def load_weights_into(model: torch.nn.Module, directory: Path, *, zero3: bool) -> None:
    """Copy the pretrained weights of `directory` into `model` (collective under ZeRO-3).

    Every parameter must be in the files and every tensor in the files must be a parameter or a
    buffer of the model; shapes must agree. Under ZeRO-3 global rank 0 reads and the gather's exit
    scatters; otherwise every rank reads.
    """
    import deepspeed
    import torch.distributed as dist
    from safetensors import safe_open

    index = weight_index(directory)
    prefix = getattr(model, "base_model_prefix", "") or ""
    reader = not zero3 or not dist.is_initialized() or dist.get_rank() == 0
    names = {id(p): n for n, p in model.named_parameters()}  # tied parameters appear once
    wanted = {n: _file_name(n, index, prefix) for n in names.values()}
    missing = sorted(n for n, f in wanted.items() if f is None)
    buffers = {n for n, _ in model.named_buffers()}
    used = {f for f in wanted.values() if f is not None}
    unexpected = sorted(
        k for k in index if k not in used and k not in buffers and not k.endswith("rotary_emb.inv_freq")
    )
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} ({len(missing)})")
        if unexpected:
            parts.append(
                f"unexpected {', '.join(unexpected[:3])}{' ...' if len(unexpected) > 3 else ''} ({len(unexpected)})"
            )
        raise UsageError(f"the weights in {directory} do not match its config.json: {'; '.join(parts)}")
    handles: dict[Path, Any] = {}
    done: set[int] = set()
    try:
        for module_name, module in model.named_modules():
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in done]
            if not own:
                continue
            with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=0, enabled=zero3):
                if reader:
                    with torch.no_grad():
                        for _, param in own:
                            key = wanted[names[id(param)]]
                            file = index[key]
                            if file not in handles:
                                handles[file] = safe_open(file, framework="pt")
                            tensor = handles[file].get_tensor(key)
                            if tuple(tensor.shape) != tuple(param.shape):
                                raise UsageError(
                                    f"{key} in {file.name} has shape {tuple(tensor.shape)}, the model "
                                    f"expects {tuple(param.shape)} (config.json from another model?)"
                                )
                            param.data.copy_(tensor.to(param.dtype))
            done.update(id(p) for _, p in own)
    finally:
        handles.clear()


# --------------------------------------------------------------------------- LoRA


def apply_lora(model: torch.nn.Module, recipe) -> torch.nn.Module:
    """Freeze the base and wrap the target layers with LoRA adapters (peft). The adapters are created
    on every rank from the same RNG state (the loop seeds it) in the base's dtype; DeepSpeed then
    partitions them like every other parameter, broadcasting rank 0's values."""
    from peft import LoraConfig, get_peft_model

    lora = recipe.train.lora
    for param in model.parameters():
        param.requires_grad_(False)
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        wrapped = get_peft_model(model, config, autocast_adapter_dtype=False)
    except ValueError as err:
        raise UsageError(f"train.lora.target_modules: {str(err).splitlines()[0]}") from None
    # The adapter's config names the base it belongs to as the recipe does (not a cache or mount path).
    wrapped.peft_config["default"].base_model_name_or_path = recipe.model.hub_id
    wrapped.peft_config["default"].revision = recipe.model.revision
    return wrapped


def trainable_count(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts, ZeRO-3 partitioned or not."""

    def numel(p) -> int:
        return int(p.ds_numel) if hasattr(p, "ds_numel") else p.numel()

    params = list(model.parameters())
    return sum(numel(p) for p in params if p.requires_grad), sum(numel(p) for p in params)
