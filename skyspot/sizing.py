"""How big a recipe's training state is: parameter counts (Llama architectures, known hub models, LoRA)
and the bytes of the ZeRO state and of one checkpoint of it, in total, per node and per rank.
docs/planning.md derives every figure and works the llama70b numbers by hand.

    state = state_bytes(recipe)        # StateEstimate: params, checkpoint_bytes, bytes_per_node, ...

Used by the CLI's notice-window check (skyspot/planning/notice_window.py), the plan's egress estimate
(skyspot/planning/candidates.py) and the trainer's first interval plan (trainer/interval.py `initial_plan`).
Import-light: the CLI imports this at start-up, so nothing here imports torch, deepspeed or sky.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

from skyspot.errors import UsageError

if TYPE_CHECKING:  # the recipe module pulls in pydantic; callers already have a Recipe
    from skyspot.recipe import Recipe

# Architectures of hub models we know, from each repository's config.json on the Hugging Face hub
# (huggingface.co/<id>/blob/main/config.json). Counting them with `llama_param_count` gives the figures
# the hub shows on each model page: Llama-3.1-8B 8,030,261,248 ("8.03B"), Llama-3.1-70B 70,553,706,496
# ("70.6B"), Llama-3.2-1B 1,235,814,400 ("1.24B"), Llama-3.2-3B 3,212,749,824 ("3.21B"); the same
# counts as transformers' LlamaForCausalLM built from each config (checked when this table was written).
_LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)
_LLAMA3_70B = dict(
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)
_LLAMA32_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=True,
)
_LLAMA32_3B = dict(
    vocab_size=128256,
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=28,
    num_attention_heads=24,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
)
# HuggingFaceTB/SmolLM2-360M (ungated, Apache-2.0; LlamaForCausalLM): 361,821,120 parameters ("362M").
_SMOLLM2_360M = dict(
    vocab_size=49152,
    hidden_size=960,
    intermediate_size=2560,
    num_hidden_layers=32,
    num_attention_heads=15,
    num_key_value_heads=5,
    tie_word_embeddings=True,
)
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "HuggingFaceTB/SmolLM2-360M": _SMOLLM2_360M,
    "HuggingFaceTB/SmolLM2-360M-Instruct": _SMOLLM2_360M,
    "meta-llama/Llama-3.1-8B": _LLAMA3_8B,
    "meta-llama/Llama-3.1-8B-Instruct": _LLAMA3_8B,
    "meta-llama/Meta-Llama-3.1-8B": _LLAMA3_8B,
    "meta-llama/Meta-Llama-3.1-8B-Instruct": _LLAMA3_8B,
    "meta-llama/Meta-Llama-3-8B": _LLAMA3_8B,
    "meta-llama/Meta-Llama-3-8B-Instruct": _LLAMA3_8B,
    "meta-llama/Llama-3.1-70B": _LLAMA3_70B,
    "meta-llama/Llama-3.1-70B-Instruct": _LLAMA3_70B,
    "meta-llama/Meta-Llama-3.1-70B": _LLAMA3_70B,
    "meta-llama/Meta-Llama-3.1-70B-Instruct": _LLAMA3_70B,
    "meta-llama/Meta-Llama-3-70B": _LLAMA3_70B,
    "meta-llama/Meta-Llama-3-70B-Instruct": _LLAMA3_70B,
    "meta-llama/Llama-3.3-70B-Instruct": _LLAMA3_70B,
    "meta-llama/Llama-3.2-1B": _LLAMA32_1B,
    "meta-llama/Llama-3.2-1B-Instruct": _LLAMA32_1B,
    "meta-llama/Llama-3.2-3B": _LLAMA32_3B,
    "meta-llama/Llama-3.2-3B-Instruct": _LLAMA32_3B,
}
_KNOWN_LOWER = {name.lower(): name for name in KNOWN_MODELS}

# Bytes per parameter that a DeepSpeed ZeRO checkpoint holds for mixed-precision AdamW: the fp32
# master weights (4) and Adam's two fp32 moments m and v (4 + 4). DeepSpeed 0.19 stage 3 saves exactly
# these: the optimizer files hold `optimizer_state_dict` (exp_avg, exp_avg_sq) and `fp32_flat_groups`
# (runtime/zero/stage3.py `_rigid_state_dict`), while the model-states files hold the module's
# parameters as the empty placeholders ZeRO-3 leaves in `param.data` (partition_parameters.py
# `free_param`). The bf16 working copy is not saved: it is the master weights cast down on load.
CHECKPOINT_BYTES_PER_PARAM = 12
# Resident training state per parameter (ZeRO paper, Rajbhandari et al. 2020, "ZeRO: Memory
# Optimizations Toward Training Trillion Parameter Models", sec. 3.1: 2 + 2 + K with K = 12 for mixed-
# precision Adam): 16-bit weights 2 + 16-bit gradients 2 + fp32 master 4 + m 4 + v 4. In fp32 (CPU
# runs) DeepSpeed's master copy is the weights themselves, so 4 + 4 + 8: also 16. Activations excluded.
MEMORY_BYTES_PER_PARAM = 16

PARAMS_ENV = "SKYSPOT_MODEL_PARAMS"


def llama_param_count(config: Mapping[str, Any]) -> int:
    """Parameters of a LlamaForCausalLM with this config (LlamaConfig field names; no biases, as Llama).

    embeddings V*H; per layer q and o H*(heads*head_dim) each, k and v H*(kv_heads*head_dim) each,
    the MLP 3*H*I, two RMSNorms 2*H; a final norm H; the LM head V*H unless tied to the embeddings.
    Raises ValueError naming a missing or malformed field.
    """

    def number(name: str, default: Optional[int] = None) -> int:
        value = config.get(name, default)
        if value is None:
            raise ValueError(f"model.config has no '{name}'")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model.config '{name}' must be a positive integer, got {value!r}")
        return value

    vocab, hidden = number("vocab_size"), number("hidden_size")
    intermediate, layers = number("intermediate_size"), number("num_hidden_layers")
    heads = number("num_attention_heads")
    kv_heads = number("num_key_value_heads", heads)
    head_dim = number("head_dim", hidden // heads if hidden % heads == 0 else None)
    tied = bool(config.get("tie_word_embeddings", False))
    bias = bool(config.get("attention_bias", False)) or bool(config.get("mlp_bias", False))
    if bias:
        raise ValueError("model.config has attention_bias or mlp_bias, which this count does not cover")
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    per_layer = attention + 3 * hidden * intermediate + 2 * hidden
    return vocab * hidden + layers * per_layer + hidden + (0 if tied else vocab * hidden)


@dataclass(frozen=True)
class StateEstimate:
    """How many bytes the training state and its checkpoint take, in total and on the busiest node."""

    model: str
    """The hub id, or "inline config"."""
    params: Optional[int]
    """Parameter count; None when unknown (an unknown hub id without SKYSPOT_MODEL_PARAMS)."""
    params_source: str
    """Where the count came from, or why it is unknown."""
    zero_stage: int
    num_nodes: int
    ranks_per_node: int
    checkpoint_bytes_per_param: int
    memory_bytes_per_param: int
    checkpoint_bytes: Optional[int]
    """What one checkpoint holds, all ranks together."""
    bytes_per_node: Optional[int]
    """What the busiest node writes (and uploads) for one checkpoint; nodes write their shards in parallel."""
    bytes_per_rank: Optional[int]
    memory_bytes: Optional[int]
    """Resident training state (weights, gradients, optimizer), all ranks together; no activations."""
    memory_bytes_per_rank: Optional[int]
    note: str = ""

    @property
    def known(self) -> bool:
        return self.params is not None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "known": self.known}


def model_params(recipe: "Recipe", environ: Optional[Mapping[str, str]] = None) -> tuple[Optional[int], str]:
    """(parameter count, where it came from); (None, why) when unknown. Never raises for an unknown model."""
    environ = os.environ if environ is None else environ
    raw = environ.get(PARAMS_ENV, "").strip()
    if raw:
        try:
            count = float(raw)
        except ValueError:
            raise UsageError(
                f"{PARAMS_ENV}='{raw}' is not a number; expected a parameter count such as 7.2e9"
            ) from None
        if not math.isfinite(count) or count < 1:
            raise UsageError(f"{PARAMS_ENV}='{raw}' must be a positive parameter count such as 7.2e9")
        return int(count), f"{PARAMS_ENV}"
    model = recipe.model
    if model.config is not None:
        try:
            return llama_param_count(model.config), "inline config (LlamaConfig fields)"
        except ValueError as err:
            return None, f"cannot count the inline config's parameters: {err}"
    hub_id = model.hub_id or ""
    name = _KNOWN_LOWER.get(hub_id.lower())
    if name is None:
        return None, (
            f"'{hub_id}' is not in skyspot's table of known models; set {PARAMS_ENV} "
            f"to its parameter count (e.g. {PARAMS_ENV}=7.2e9)"
        )
    return llama_param_count(KNOWN_MODELS[name]), f"{name} config.json on the Hugging Face hub"


def state_bytes(recipe: "Recipe", *, environ: Optional[Mapping[str, str]] = None) -> StateEstimate:
    """Bytes of the ZeRO training state and of one checkpoint of it, total, per node and per rank.

    ZeRO-3 partitions everything evenly over all ranks, so each node holds (and writes) 1/num_nodes.
    Stages 0-2 keep whole 16-bit weights on every rank and rank 0 alone saves them (2 B/param, 4 in
    fp32) on top of its optimizer shard: an approximation, flagged in `note`.
    """
    from skyspot.hub import local_config
    from skyspot.lora import trainable_params

    resources, ds = recipe.resources, recipe.deepspeed
    nodes, per_node = resources.num_nodes, resources.ranks_per_node
    ranks = nodes * per_node
    params, source = model_params(recipe, environ)
    model = recipe.model
    name = model.hub_id or "inline config"
    known = _KNOWN_LOWER.get((model.hub_id or "").lower())
    arch = model.config or (KNOWN_MODELS[known] if known else None) or local_config(model.hub_id)
    if params is None and arch is not None and model.is_local:  # a local directory: its own config.json
        try:
            params, source = llama_param_count(arch), f"config.json in {model.hub_id}"
        except ValueError as err:
            source = f"cannot count the parameters of {model.hub_id}/config.json: {err}"
    # LoRA trains (and checkpoints) only the adapters; the frozen base stays resident as 16-bit weights
    # (fp32 on CPU) without gradients or optimizer state, and comes back from its files on a resume.
    lora, frozen = recipe.train.lora, 0
    if params is not None and lora is not None:
        try:
            if arch is None:
                raise ValueError(
                    "the model's architecture is unknown (neither in skyspot's table nor a local "
                    "directory with config.json)"
                )
            trainable = trainable_params(arch, lora.r, lora.target_modules)
        except ValueError as err:
            params, source = None, f"cannot count LoRA's trainable parameters: {err}"
        else:
            frozen, params = params, trainable
            source = (
                f"LoRA r={lora.r} on {', '.join(dict.fromkeys(lora.target_modules))}: {trainable:,} of "
                f"{frozen:,} parameters trainable ({source})"
            )
    if params is None:
        return StateEstimate(
            name,
            None,
            source,
            ds.zero_stage,
            nodes,
            per_node,
            CHECKPOINT_BYTES_PER_PARAM,
            MEMORY_BYTES_PER_PARAM,
            None,
            None,
            None,
            None,
            None,
            "parameter count unknown",
        )
    total = CHECKPOINT_BYTES_PER_PARAM * params
    weight_bytes = (2 if ds.bf16 else 4) * params
    note = (
        "LoRA: a checkpoint holds the adapters' state only; the frozen base comes back from its files" if frozen else ""
    )
    if ds.zero_stage == 3:
        busiest_node, busiest_rank = math.ceil(total / nodes), math.ceil(total / ranks)
    elif ds.zero_stage in (1, 2):
        total += weight_bytes
        busiest_node = math.ceil(CHECKPOINT_BYTES_PER_PARAM * params / nodes) + weight_bytes
        busiest_rank = math.ceil(CHECKPOINT_BYTES_PER_PARAM * params / ranks) + weight_bytes
        note = "; ".join(
            n
            for n in (note, f"ZeRO stage {ds.zero_stage}: node 0 also saves the whole 16-bit model (approximate)")
            if n
        )
    else:
        total += weight_bytes
        busiest_node = busiest_rank = total
        note = "; ".join(n for n in (note, "ZeRO stage 0: rank 0 saves everything (approximate)") if n)
    memory = MEMORY_BYTES_PER_PARAM * params + (2 if ds.bf16 else 4) * frozen
    return StateEstimate(
        name,
        params,
        source,
        ds.zero_stage,
        nodes,
        per_node,
        CHECKPOINT_BYTES_PER_PARAM,
        MEMORY_BYTES_PER_PARAM,
        total,
        busiest_node,
        busiest_rank,
        memory,
        math.ceil(memory / ranks) if ds.zero_stage == 3 else None,
        note,
    )
