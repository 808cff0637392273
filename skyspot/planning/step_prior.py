"""A recipe's step time before anything is measured: a floor no node can beat (docs/deadline.md).

    floor, how = step_seconds_floor(recipe)     # seconds per optimizer step, at the least

`launch --deadline` refuses a deadline that even this floor, with the restart prior, cannot make,
when the recipe gives no `resources.step_seconds_hint`; the deadline's controllers plan with it
until the run has timed its own steps. A floor, not an estimate: every rank runs at its
accelerator's peak dense 16-bit throughput with nothing else to do, so a deadline it refuses is
one no run could make, and one it passes may still be missed (the run then says so at once).

Training FLOPs per token: 6 x parameters for a full fine-tune (forward 2, backward 4: Kaplan et al.
2020, "Scaling Laws for Neural Language Models", section 2.1), 4 x for LoRA (the frozen base's
weight gradients are skipped; the activations' are not). Each rank computes its own
micro_batch_size x grad_accum x seq_len tokens per step (data parallel).

Import-light: the CLI imports this at launch, so nothing here imports torch or sky.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional

if TYPE_CHECKING:
    from skyspot.recipe import Recipe

# Peak dense BF16/FP16 tensor throughput per accelerator, FLOP/s, from each vendor's datasheet
# (NVIDIA H100/H200 SXM 989 TF, B200 2.25 PF, A100 312 TF, L40S 362 TF, L4 121 TF, A10 125 TF,
# V100 125 TF, T4 65 TF). Higher than any real run reaches, which is what a floor wants.
PEAK_FLOPS = {
    "H100": 989e12,
    "H100-MEGA": 989e12,
    "H200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A100-80GB": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 125e12,
    "V100": 125e12,
    "T4": 65e12,
}
# A CPU rank (gloo, fp32): generous for a few cores of one socket; the floor only has to stay below.
CPU_RANK_FLOPS = 5e12
FLOPS_PER_PARAM_TOKEN = {"full": 6, "lora": 4}


def step_seconds_floor(recipe: "Recipe", environ: Optional[Mapping[str, str]] = None) -> tuple[float, str]:
    """(seconds per step at the least, how it was found); (0.0, why) when the model's size is unknown."""
    from skyspot.sizing import model_params

    params, source = model_params(recipe, environ)
    if params is None:
        return 0.0, f"no step-time floor: {source}"
    accelerators = [a.partition(":")[0] for a in recipe.resources.accelerators]
    peak = max((PEAK_FLOPS.get(a, 0.0) for a in accelerators), default=0.0) or CPU_RANK_FLOPS
    kind = "lora" if recipe.train.lora is not None else "full"
    train = recipe.train
    tokens = train.micro_batch_size * train.grad_accum * train.seq_len
    seconds = FLOPS_PER_PARAM_TOKEN[kind] * params * tokens / peak
    where = max(accelerators, key=lambda a: PEAK_FLOPS.get(a, 0.0)) if accelerators else "a CPU rank"
    return seconds, (
        f"floor: {FLOPS_PER_PARAM_TOKEN[kind]} x {params:,} parameters x {tokens:,} tokens per rank "
        f"at {where}'s peak {peak / 1e12:g} TFLOP/s"
    )
