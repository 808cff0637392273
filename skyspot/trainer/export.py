"""final/: the trained model as a Hugging Face directory, with its tokenizer.

Full fine-tune:  final/ = config.json + model.safetensors + the tokenizer's files

    model = AutoModelForCausalLM.from_pretrained("DIR/final")
    tokenizer = AutoTokenizer.from_pretrained("DIR/final")

LoRA:            final/ = adapter_config.json + adapter_model.safetensors + the tokenizer's files
                 final/merged/ (export.merge) = the base with the adapters merged in, + tokenizer

    model = AutoModelForCausalLM.from_pretrained("DIR/final")          # base (from adapter_config.json) + adapter, with peft
    model = AutoModelForCausalLM.from_pretrained("DIR/final/merged")   # no peft needed

Both: final/skyspot.json = {"step": the step trained to, "eval": the run's last evaluation
(step, loss, perplexity, tokens, batches: evaluate.py) or null when the recipe evaluates nothing}.

ZeRO-3 parameters are gathered onto global rank 0 (every rank must call `export_final`): the adapters
alone for a LoRA run, the whole model otherwise or for the merge (rank 0's host memory then holds
one 16-bit copy of the model). Rank 0 writes into a temporary sibling directory and renames it
into place, so a kill during the export never leaves a half-written final/.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch

from skyspot.trainer.files import fsync_dir
from skyspot.trainer.rundir import FINAL

MERGED = "merged"
METADATA = "skyspot.json"
PEFT_PREFIX = "base_model.model."


def gathered_state_dict(engine, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The state dict on global rank 0 (empty elsewhere); `trainable_only`: without frozen parameters."""
    if engine.zero_optimization_partition_weights():
        return engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=trainable_only) or {}
    if engine.global_rank == 0:
        params = {n for n, p in engine.module.named_parameters() if p.requires_grad} if trainable_only else None
        return {
            k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items() if params is None or k in params
        }
    return {}


def merged_state_dict(
    state: dict[str, torch.Tensor], scaling: float, adapter: str = "default"
) -> dict[str, torch.Tensor]:
    """A PeftModel's full state dict with each LoRA layer merged, W + scaling * B @ A (computed in fp32,
    stored in W's dtype), under the base model's own names. Pure."""
    out: dict[str, torch.Tensor] = {}
    lora_a, lora_b = f".lora_A.{adapter}.weight", f".lora_B.{adapter}.weight"
    for key, value in state.items():
        if ".lora_" in key:
            continue
        name = key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key
        if name.endswith(".base_layer.weight"):
            layer = key[: -len(".base_layer.weight")]
            a, b = state.get(layer + lora_a), state.get(layer + lora_b)
            name = name.replace(".base_layer.weight", ".weight")
            if a is not None and b is not None:
                value = (value.float() + scaling * (b.float() @ a.float())).to(value.dtype)
        else:
            name = name.replace(".base_layer.", ".")
        out[name] = value
    return out


def export_final(
    engine,
    tokenizer,
    run_dir: Path,
    *,
    is_writer: bool,
    merge: bool = False,
    step: Optional[int] = None,
    evaluation: Optional[dict[str, Any]] = None,
) -> Path | None:
    """Write final/ (collective: every rank calls it; global rank 0 writes); `evaluation`: the last eval."""
    module = engine.module
    is_peft = hasattr(module, "peft_config")
    if is_peft:
        adapter = gathered_state_dict(engine, trainable_only=True)  # collective
        full = gathered_state_dict(engine) if merge else None  # collective
    else:
        adapter, full = None, gathered_state_dict(engine)  # collective
    if not is_writer:
        return None
    target = Path(run_dir) / FINAL
    tmp = Path(run_dir) / f".{FINAL}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if is_peft:
        # save_embedding_layers=False: the embeddings are never adapted here, and "auto" would fetch the
        # base's config from the hub to find out.
        module.save_pretrained(tmp, state_dict=adapter, safe_serialization=True, save_embedding_layers=False)
        if full is not None:
            config = module.peft_config["default"]
            merged = merged_state_dict(full, config.lora_alpha / config.r)
            module.get_base_model().save_pretrained(tmp / MERGED, state_dict=merged, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / MERGED)
    else:
        module.save_pretrained(tmp, state_dict=full, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    (tmp / METADATA).write_text(json.dumps({"step": step, "eval": evaluation}, indent=2) + "\n")
    for path in tmp.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for directory in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        fsync_dir(directory)
    if target.exists():
        old = Path(run_dir) / f".{FINAL}.old-{int(time.time())}"
        os.replace(target, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, target)
    fsync_dir(run_dir)
    return target
