"""The DeepSpeed engine built from a recipe: config, optimizer, LR schedule.

Optimizer: AdamW, betas (0.9, 0.95), eps 1e-8. torch's implementation (DeepSpeed `torch_adam`;
fused on CUDA) unless ZeRO-Offload needs DeepSpeedCPUAdam: its bias correction has no hidden
state, which keeps resume bitwise exact (see determinism.py) and needs no JIT build.
LR: linear warm-up over train.warmup_steps, then cosine decay to lr * min_lr_ratio at
train.steps, computed from the step count (LambdaLR), never accumulated.
`deepspeed.extra` is merged into the generated config last.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8


def lr_factor(warmup_steps: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak LR for optimizer step `s` (0-based): warm-up, then cosine."""

    def factor(s: int) -> float:
        if warmup_steps > 0 and s < warmup_steps:
            return (s + 1) / warmup_steps
        decay = max(1, total_steps - warmup_steps)
        progress = min(1.0, (s - warmup_steps) / decay)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def deepspeed_config(recipe) -> dict[str, Any]:
    ds, train = recipe.deepspeed, recipe.train
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if ds.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if ds.offload_params == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    optimizer_params: dict[str, Any] = {
        "lr": train.lr,
        "betas": list(ADAM_BETAS),
        "eps": ADAM_EPS,
        "weight_decay": train.weight_decay,
    }
    if ds.offload_optimizer != "cpu":
        optimizer_params["torch_adam"] = True
        if torch.cuda.is_available():
            optimizer_params["fused"] = True
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum,
        "optimizer": {"type": "AdamW", "params": optimizer_params},
        "zero_optimization": zero,
        "bf16": {"enabled": ds.bf16},
        "steps_per_print": 2**31 - 1,  # the loop prints its own loss lines
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        # Every node writes its own copy of the rank-independent files to its local disk. Tags are
        # step_<N> of a step every rank agreed on (the vote), so DeepSpeed's per-save tag check (an
        # all-reduce of the tag's hash, about 5 ms of tiny's stall on gloo) proves nothing new.
        "checkpoint": {"use_node_local_storage": True, "tag_validation": "Ignore"},
    }
    if train.grad_clip > 0:
        config["gradient_clipping"] = train.grad_clip
    return _merge(config, ds.extra)


def initialize(recipe, model: torch.nn.Module, ds_config: dict[str, Any]):
    """deepspeed.initialize with our LR schedule; returns the engine."""
    import deepspeed

    factor = lr_factor(recipe.train.warmup_steps, recipe.train.steps, recipe.train.min_lr_ratio)

    def scheduler(optimizer):
        # A plain function (not an object) so LambdaLR does not save it: the schedule always
        # comes from the recipe, and only the step count comes from the checkpoint.
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        config=ds_config,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        lr_scheduler=scheduler,
    )
    return engine


def basic_optimizer(engine):
    """The wrapped torch optimizer (ZeRO wraps it once)."""
    optimizer = engine.optimizer
    return getattr(optimizer, "optimizer", optimizer)
