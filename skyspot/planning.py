"""Checkpoint planning: how big the training state is, whether an emergency checkpoint can beat the
notice window, and how often to take interval checkpoints. docs/planning.md derives every formula and
works the llama70b numbers by hand.

    from skyspot.planning import check_notice_windows, plan_interval, mtbp_prior

    report = check_notice_windows(recipe)          # per cloud: durable in time / local only / not in time
    report.advice                                  # recipe settings that fix what does not make it
    prior = mtbp_prior("aws", "H100", num_nodes=4)  # until the run has seen preemptions of its own
    plan = plan_interval(blocking_cost_s=12.0, mtbp_s=prior.job_s, upload_s=212.0)
    plan.every_seconds, plan.bound                 # the interval and which bound decided it
    events.emit("interval_plan", **plan.event_fields())

The trainer re-plans from its own events with `plan_from_events` (observed blocking cost, upload time
and time between preemptions, each falling back to a prior until observed).

Import-light: the CLI imports this at start-up, so nothing here imports torch, deepspeed or sky.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping, Optional, Union

from skyspot.errors import UsageError
from skyspot.events import EventLog
from skyspot.clouds import (GB, NOTICE_DETECT_S, NOTICE_WINDOWS_S, SNAPSHOT_GBPS_PER_RANK, WRITE_ENV, Bandwidth,
                            bandwidth_for, mtbp_prior)

if TYPE_CHECKING:  # the recipe module pulls in pydantic; callers already have a Recipe
    from skyspot.recipe import Recipe

# =========================================================================== state size

# Architectures of hub models we know, from each repository's config.json on the Hugging Face hub
# (huggingface.co/<id>/blob/main/config.json). Counting them with `llama_param_count` gives the figures
# the hub shows on each model page: Llama-3.1-8B 8,030,261,248 ("8.03B"), Llama-3.1-70B 70,553,706,496
# ("70.6B"), Llama-3.2-1B 1,235,814,400 ("1.24B"), Llama-3.2-3B 3,212,749,824 ("3.21B"); the same
# counts as transformers' LlamaForCausalLM built from each config (checked when this table was written).
_LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
_LLAMA3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                   num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False)
_LLAMA32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)
_LLAMA32_3B = dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                   num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
# HuggingFaceTB/SmolLM2-360M (ungated, Apache-2.0; LlamaForCausalLM): 361,821,120 parameters ("362M").
_SMOLLM2_360M = dict(vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                     num_attention_heads=15, num_key_value_heads=5, tie_word_embeddings=True)
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
            raise UsageError(f"{PARAMS_ENV}='{raw}' is not a number; expected a parameter count such as 7.2e9") from None
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
        return None, (f"'{hub_id}' is not in skyspot's table of known models; set {PARAMS_ENV} "
                      f"to its parameter count (e.g. {PARAMS_ENV}=7.2e9)")
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
                raise ValueError("the model's architecture is unknown (neither in skyspot's table nor a local "
                                 "directory with config.json)")
            trainable = trainable_params(arch, lora.r, lora.target_modules)
        except ValueError as err:
            params, source = None, f"cannot count LoRA's trainable parameters: {err}"
        else:
            frozen, params = params, trainable
            source = (f"LoRA r={lora.r} on {', '.join(dict.fromkeys(lora.target_modules))}: {trainable:,} of "
                      f"{frozen:,} parameters trainable ({source})")
    if params is None:
        return StateEstimate(name, None, source, ds.zero_stage, nodes, per_node, CHECKPOINT_BYTES_PER_PARAM,
                             MEMORY_BYTES_PER_PARAM, None, None, None, None, None, "parameter count unknown")
    total = CHECKPOINT_BYTES_PER_PARAM * params
    weight_bytes = (2 if ds.bf16 else 4) * params
    note = ("LoRA: a checkpoint holds the adapters' state only; the frozen base comes back from its files"
            if frozen else "")
    if ds.zero_stage == 3:
        busiest_node, busiest_rank = math.ceil(total / nodes), math.ceil(total / ranks)
    elif ds.zero_stage in (1, 2):
        total += weight_bytes
        busiest_node = math.ceil(CHECKPOINT_BYTES_PER_PARAM * params / nodes) + weight_bytes
        busiest_rank = math.ceil(CHECKPOINT_BYTES_PER_PARAM * params / ranks) + weight_bytes
        note = "; ".join(n for n in (note, f"ZeRO stage {ds.zero_stage}: node 0 also saves the whole 16-bit "
                                           "model (approximate)") if n)
    else:
        total += weight_bytes
        busiest_node = busiest_rank = total
        note = "; ".join(n for n in (note, "ZeRO stage 0: rank 0 saves everything (approximate)") if n)
    memory = MEMORY_BYTES_PER_PARAM * params + (2 if ds.bf16 else 4) * frozen
    return StateEstimate(name, params, source, ds.zero_stage, nodes, per_node, CHECKPOINT_BYTES_PER_PARAM,
                         MEMORY_BYTES_PER_PARAM, total, busiest_node, busiest_rank, memory,
                         math.ceil(memory / ranks) if ds.zero_stage == 3 else None, note)


def measured_bandwidth(log: Union[EventLog, Iterable[Mapping[str, Any]]]) -> dict[str, dict[str, float]]:
    """What a run measured, as `bandwidth=` overrides for the window check (empty when nothing was).

    write_gbps: the node's local disk as `python -m skyspot.trainer.local_disk` measured it at setup
    (`local_disk` events, the slowest node), else the median over checkpoints of bytes / write_seconds
    (serialisation, hashing and fsync included). upload_gbps: the median of the streamed bytes /
    stream_seconds of the uploads that made a checkpoint durable (`upload_end`), else bytes / seconds.
    """
    events = _events(log)
    found: dict[str, float] = {}
    disks = [e["write_gbps"] for e in events if e.get("type") == "local_disk" and _positive(e.get("write_gbps"))]
    writes = [e["bytes"] / e["write_seconds"] / GB for e in events if e.get("type") == "checkpoint_end"
              and _positive(e.get("bytes")) and _positive(e.get("write_seconds")) and e["bytes"] >= 1e8]
    if disks:
        found["write_gbps"] = min(disks)
    elif writes:
        found["write_gbps"] = statistics.median(writes)
    uploads = []
    for e in events:
        if e.get("type") != "upload_end" or e.get("durable") is not True:
            continue
        if _positive(e.get("streamed_bytes")) and _positive(e.get("stream_seconds")) and e["streamed_bytes"] >= 1e8:
            uploads.append(e["streamed_bytes"] / e["stream_seconds"] / GB)
        elif _positive(e.get("bytes")) and _positive(e.get("seconds")) and e["bytes"] >= 1e8:
            uploads.append(e["bytes"] / e["seconds"] / GB)
    if uploads:
        found["upload_gbps"] = statistics.median(uploads)
    return {"*": found} if found else {}


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


# =========================================================================== notice-window check

Verdict = Literal["durable in time", "local only in time", "not in time", "unknown"]

LOST_MEANING = ("the node's disk goes with the spot VM (SkyPilot recovers on new nodes), so recovery "
                "falls back to the last durable interval checkpoint")


@dataclass(frozen=True)
class WindowCheck:
    """Whether an emergency checkpoint fits one cloud's notice window, with the arithmetic behind it."""

    cloud: str
    window_s: float
    detect_s: float
    """Worst-case delay before the watcher sees the notice (its polling period)."""
    step_s: float
    """Time assumed for the step in progress to finish (the save starts at a step boundary)."""
    bytes_per_node: Optional[int]
    write_gbps: float
    upload_gbps: float
    write_source: str
    upload_source: str
    write_s: Optional[float]
    upload_s: Optional[float]
    local_at_s: Optional[float]
    """Seconds after the notice at which the checkpoint is committed on local disk."""
    durable_at_s: Optional[float]
    """Seconds after the notice at which it is durable in the store: the snapshot streams to the store
    while it is written, so the write and the upload overlap and the slower one counts."""
    verdict: Verdict
    local_slack_s: Optional[float]
    """window - local_at: negative means short by that much."""
    durable_slack_s: Optional[float]
    meaning: str
    snapshot_s: Optional[float] = None
    """Device-to-host copy of each rank's shards (in parallel) before anything is written."""
    arithmetic: str = ""
    """durable_at_s worked out, for the plan's readers."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_window(cloud: str, bytes_per_node: Optional[int], bandwidth: Bandwidth, *, step_s: float = 0.0,
                 ranks_per_node: int = 1) -> WindowCheck:
    """The window check for one cloud, given what the busiest node must write and upload.

    durable_at = detect + step + snapshot + max(write, upload): the ranks copy their shards to host
    memory at the step boundary, then each rank's bytes go to the local file and to the store in
    one pass (writer.py), so the slower of the two paths decides.
    """
    window, detect = NOTICE_WINDOWS_S[cloud], NOTICE_DETECT_S[cloud]
    common = dict(cloud=cloud, window_s=window, detect_s=detect, step_s=step_s, bytes_per_node=bytes_per_node,
                  write_gbps=bandwidth.write_gbps, upload_gbps=bandwidth.upload_gbps,
                  write_source=bandwidth.write_source, upload_source=bandwidth.upload_source)
    if bytes_per_node is None:
        return WindowCheck(**common, write_s=None, upload_s=None, local_at_s=None, durable_at_s=None,
                           verdict="unknown", local_slack_s=None, durable_slack_s=None,
                           meaning="the model's size is unknown, so whether a checkpoint fits cannot be told")
    snapshot_s = bytes_per_node / max(1, ranks_per_node) / (SNAPSHOT_GBPS_PER_RANK * GB)
    write_s = bytes_per_node / (bandwidth.write_gbps * GB)
    upload_s = bytes_per_node / (bandwidth.upload_gbps * GB)
    local_at = detect + step_s + snapshot_s + write_s
    durable_at = detect + step_s + snapshot_s + max(write_s, upload_s)
    local_slack, durable_slack = window - local_at, window - durable_at
    arithmetic = (f"{bytes_per_node / GB:,.1f} GB/node: {detect:g} s notice poll + {step_s:g} s step + "
                  f"{snapshot_s:.1f} s snapshot + max({write_s:,.1f} s write at {bandwidth.write_gbps:g} GB/s, "
                  f"{upload_s:,.1f} s upload at {bandwidth.upload_gbps:g} GB/s) = {durable_at:,.1f} s "
                  f"{'<=' if durable_slack >= 0 else '>'} {window:.0f} s notice")
    if durable_slack >= 0:
        verdict: Verdict = "durable in time"
        meaning = f"durable {durable_slack:.0f} s before the VM goes: a preemption loses nothing"
    elif local_slack >= 0:
        verdict = "local only in time"
        meaning = (f"committed locally {local_slack:.0f} s before the VM goes, but the upload needs "
                   f"{-durable_slack:.0f} s more; {LOST_MEANING}")
    else:
        verdict = "not in time"
        meaning = f"even the local commit needs {local_at:.0f} s of the {window:.0f} s window; {LOST_MEANING}"
    return WindowCheck(**common, write_s=write_s, upload_s=upload_s, local_at_s=local_at, durable_at_s=durable_at,
                       verdict=verdict, local_slack_s=local_slack, durable_slack_s=durable_slack, meaning=meaning,
                       snapshot_s=snapshot_s, arithmetic=arithmetic)


@dataclass(frozen=True)
class WindowReport:
    """The notice-window check of a recipe on each candidate cloud, with advice."""

    recipe: str
    spot: bool
    """False when the recipe uses on-demand capacity only: no notices, nothing to fit."""
    state: StateEstimate
    checks: list[WindowCheck]
    advice: list[str] = field(default_factory=list)

    def check(self, cloud: str) -> WindowCheck:
        return next(c for c in self.checks if c.cloud == cloud)

    @property
    def durable_clouds(self) -> list[str]:
        return [c.cloud for c in self.checks if c.verdict == "durable in time"]

    @property
    def warnings(self) -> list[str]:
        """One line per spot cloud where a preemption would fall back to the last interval checkpoint."""
        if not self.spot:
            return []
        return [f"{c.cloud}: emergency checkpoint {c.verdict} ({c.window_s:.0f} s notice): {c.meaning}"
                for c in self.checks if c.verdict != "durable in time"]

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "spot": self.spot, "state": self.state.to_dict(),
                "checks": [c.to_dict() for c in self.checks], "advice": list(self.advice),
                "warnings": self.warnings}


def check_notice_windows(recipe: "Recipe", *, clouds: Optional[Iterable[str]] = None,
                         bandwidth: Optional[Mapping[str, Mapping[str, float]]] = None,
                         environ: Optional[Mapping[str, str]] = None, step_s: float = 0.0,
                         max_loss_s: Optional[float] = None) -> WindowReport:
    """Can an emergency checkpoint become durable inside each candidate cloud's notice window?

    clouds: default the recipe's `resources.clouds`. bandwidth: per-cloud overrides (see
    `bandwidth_for`). step_s: how long the step in progress may still take (unknown before launch: 0,
    and the slack columns say how much a step may take). max_loss_s: the loss bound `advice` aims at.
    """
    if not (math.isfinite(step_s) and step_s >= 0):
        raise ValueError(f"step_s must be a finite number >= 0, got {step_s!r}")
    state = state_bytes(recipe, environ=environ)
    checks = []
    for cloud in (list(clouds) if clouds is not None else list(recipe.resources.clouds)):
        bw = bandwidth_for(cloud, disk_size_gb=recipe.resources.disk_size, overrides=bandwidth, environ=environ,
                           local_nvme=bool(recipe.resources.accelerators))
        checks.append(check_window(cloud, state.bytes_per_node, bw, step_s=step_s,
                                   ranks_per_node=recipe.resources.ranks_per_node))
    report = WindowReport(recipe.name, recipe.resources.spot, state, checks)
    report.advice.extend(advice(report, recipe, max_loss_s=max_loss_s if max_loss_s is not None else DEFAULT_MAX_LOSS_S))
    return report


DEFAULT_MAX_LOSS_S = 15 * 60.0  # ours: what `advice` aims to bound a preemption's loss to
MAX_BLOCKED_SHARE = 0.25  # ours: `advice` suggests no interval that blocks training more than this


def _round_down(seconds: float) -> int:
    """A readable interval no longer than `seconds`: whole minutes from 2 min up, else tens of seconds."""
    return int(seconds // 60 * 60) if seconds >= 120 else max(10, int(seconds // 10 * 10))


def advice(report: WindowReport, recipe: "Recipe", *, max_loss_s: float = DEFAULT_MAX_LOSS_S) -> list[str]:
    """Recipe settings that fix (or bound the cost of) the clouds whose emergency checkpoint cannot become
    durable in time, most useful first. Empty when every cloud makes it, or the recipe never runs on spot."""
    if not report.spot:
        return []
    state = report.state
    if not state.known:
        return [f"the window check needs the model's size: {state.params_source}"]
    failing = [c for c in report.checks if c.verdict != "durable in time"]
    if not failing:
        return []
    names = ", ".join(c.cloud for c in failing)
    lines = []
    # 1. The local write is the slow part: SkyPilot's root disk is network storage of modest throughput.
    slow_disk = [c.cloud for c in failing if c.verdict == "not in time" and (c.write_s or 0) > (c.upload_s or 0)]
    if slow_disk:
        lines.append(f"the local write is the slow part on {', '.join(slow_disk)} (SkyPilot's default root disk): "
                     f"keep the fast tier on the node's local NVMe (SKYSPOT_RUN_DIR) and tell the check its "
                     f"speed, e.g. {WRITE_ENV}=2")
    # 2. A shorter interval bounds what a preemption loses when the emergency checkpoint does not make it:
    #    the newest durable copy is at worst interval + its save (snapshot + the slower of write and upload,
    #    which overlap) old. Training is blocked only for the snapshot; the rest runs in the background.
    worst = max(failing, key=lambda c: (c.snapshot_s or 0) + max(c.write_s or 0, c.upload_s or 0))
    snapshot_s = worst.snapshot_s or 0.0
    save_s = snapshot_s + max(worst.write_s or 0.0, worst.upload_s or 0.0)
    every = recipe.checkpoint.every_seconds
    now = (f"now every_seconds={every:g}: up to {(every + save_s) / 60:.1f} min"
           if isinstance(every, (int, float)) else
           "now `auto`" if every == "auto" else "now no time-based interval")
    target = max_loss_s - save_s
    if target >= save_s and _round_down(target) >= save_s:
        interval = _round_down(target)
        head = f"checkpoint.every_seconds={interval}: a preemption on {names} then loses at most"
    else:
        interval = math.ceil(save_s)
        head = (f"checkpoint.every_seconds={interval} (the shortest interval whose upload finishes before the next "
                f"checkpoint supersedes it): a preemption on {names} then still loses up to")
    blocked = snapshot_s / (interval + snapshot_s)
    if blocked <= MAX_BLOCKED_SHARE:
        lines.append(f"{head} {(interval + save_s) / 60:.1f} min (interval + {save_s:.0f} s to a durable copy), with "
                     f"training blocked {blocked:.1%} of the time by the snapshots "
                     f"({now}; or `auto` to plan it from the preemption rate)")
    else:
        lines.append(f"a shorter checkpoint.every_seconds would only trade lost work for blocked training: each "
                     f"snapshot blocks {snapshot_s:.0f} s, so {interval} s would block {blocked:.0%} of the time ({now})")
    # 3. Fewer clouds, when some candidates make it.
    good = report.durable_clouds
    if good:
        lines.append(f"resources.clouds=[{','.join(good)}]: drop {names}, where the emergency checkpoint "
                     "cannot become durable in time")
    # 4. More nodes: each node writes and uploads checkpoint_bytes / num_nodes in parallel. Only counts up to
    #    4x today's are offered; beyond that the fix costs more than the loss it prevents.
    needs = []
    for c in failing:
        budget = c.window_s - c.detect_s - c.step_s
        if budget > 0 and state.checkpoint_bytes and state.zero_stage == 3:
            seconds_per_byte = (max(1 / (c.write_gbps * GB), 1 / (c.upload_gbps * GB))
                                + 1 / (state.ranks_per_node * SNAPSHOT_GBPS_PER_RANK * GB))
            nodes = math.ceil(state.checkpoint_bytes * seconds_per_byte / budget)
            if nodes <= 4 * state.num_nodes:
                needs.append(f"{nodes} on {c.cloud}")
    if needs:
        lines.append(f"resources.num_nodes: the state ({state.checkpoint_bytes / GB:.1f} GB) becomes durable in time "
                     f"with at least {', '.join(needs)} (now {state.num_nodes}; each node adds GPUs and cost)")
    # 5. LoRA: only the adapters are trained, so only they are checkpointed (recipes llama70b-lora, llama8b-lora).
    if getattr(recipe.train, "lora", None) is None and recipe.model.hub_id:
        lines.append(f"train.lora={{}}: a LoRA fine-tune checkpoints only the adapters' state (for Llama-3.1-70B at "
                     f"r=16, 2.5 GB instead of 846.6 GB: see the llama70b-lora recipe), durable in seconds on "
                     f"{names}")
    return lines


# =========================================================================== interval planner

MIN_INTERVAL_S = 60.0  # ours: below a minute, costs the model ignores (step boundary, file churn) dominate
MAX_INTERVAL_S = 4 * 3600.0  # ours: even without preemptions, hardware fails; never risk more than 4 h of work

Bound = Literal["daly", "upload", "min_interval", "staleness", "max_interval"]


def _check(name: str, value: float, *, allow_inf: bool = False, positive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    ok = ok and (math.isfinite(value) or (allow_inf and value > 0))
    ok = ok and (value > 0 if positive else value >= 0)
    if not ok:
        raise ValueError(f"{name} must be a {'positive' if positive else 'non-negative'} number, got {value!r}")


def young_interval(C: float, M: float) -> float:
    """Young's first-order optimum compute time between checkpoints: sqrt(2 C M).

    J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9), 1974.
    C: time to write a checkpoint; M: mean time between failures (here: preemptions).
    """
    _check("C", C)
    _check("M", M, allow_inf=True, positive=True)
    return math.sqrt(2 * C * M)


def daly_interval(C: float, M: float, R: float = 0.0) -> float:
    """Daly's higher-order optimum compute time between checkpoints:

        tau = sqrt(2 C M) * [1 + 1/3 sqrt(C / 2M) + 1/9 (C / 2M)] - C    for C < 2M
        tau = M                                                          for C >= 2M

    J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
    Future Generation Computer Systems 22 (2006) 303-312. The restart time R does not enter: it scales
    the expected wall time by e^(R/M) but does not move its minimum (see `daly_wall_time`); the
    argument exists so callers can pass it along with the other inputs.
    """
    _check("C", C)
    _check("M", M, allow_inf=True, positive=True)
    _check("R", R)
    if math.isinf(M):
        return math.inf if C > 0 else 0.0
    if C >= 2 * M:
        return M
    ratio = C / (2 * M)
    return math.sqrt(2 * C * M) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - C


def daly_wall_time(Ts: float, tau: float, C: float, M: float, R: float = 0.0) -> float:
    """Daly's (2006) expected wall time to finish Ts of work, checkpointing every tau of compute:

        T_w = M e^(R/M) (e^((tau + C)/M) - 1) Ts / tau

    for exponentially distributed failures with mean M, checkpoint cost C and restart cost R.
    """
    return M * math.exp(R / M) * math.expm1((tau + C) / M) * Ts / tau


def daly_exact_interval(C: float, M: float) -> float:
    """The tau that minimises `daly_wall_time` exactly, by bisection.

    dT_w/dtau = 0 gives e^((tau + C)/M) (tau/M - 1) + 1 = 0, i.e. tau = M (1 + W0(-e^-(1 + C/M))) with
    W0 the principal Lambert W branch. `daly_interval` is Daly's perturbation expansion of this root.
    """
    _check("C", C)
    _check("M", M, positive=True)
    if C == 0:
        return 0.0
    d = C / M
    lo, hi = 0.0, 1.0  # x = tau/M; h(x) = e^(x+d)(x-1) + 1 rises from 1 - e^d < 0 to 1
    for _ in range(200):
        mid = (lo + hi) / 2
        if math.exp(mid + d) * (mid - 1) + 1 < 0:
            lo = mid
        else:
            hi = mid
    return M * (lo + hi) / 2


@dataclass(frozen=True)
class IntervalPlan:
    """The checkpoint interval chosen, its inputs, and which bound decided it."""

    every_seconds: float
    """Seconds of training between interval checkpoints."""
    bound: Bound
    """What decided it: `daly` (the optimum fits the bounds), `upload` (raised to the upload time),
    `min_interval`, `staleness` (lowered to keep the durable copy fresh) or `max_interval`."""
    daly_s: float
    young_s: float
    lower_s: float
    upper_s: float
    blocking_cost_s: float
    mtbp_s: float
    upload_s: float
    max_staleness_s: Optional[float]
    conflict: bool
    """The bounds cross (staleness asks for less than the upload allows); the upload bound won."""
    expected_overhead: Optional[float]
    """Daly's expected wall time / work - 1 at this interval (checkpoint cost plus rework), R = 0."""
    note: str = ""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each input came from (observed, prior, estimate), when the caller says."""

    @property
    def inputs(self) -> dict[str, Any]:
        return {"blocking_cost_s": self.blocking_cost_s, "mtbp_s": _finite(self.mtbp_s), "upload_s": self.upload_s,
                "max_staleness_s": self.max_staleness_s, "daly_s": _finite(self.daly_s),
                "young_s": _finite(self.young_s), "lower_s": self.lower_s, "upper_s": self.upper_s,
                "bound": self.bound, "conflict": self.conflict, "expected_overhead": self.expected_overhead,
                "sources": dict(self.sources)}

    def event_fields(self) -> dict[str, Any]:
        """Fields of an `interval_plan` event (events.EVENT_TYPES): every_seconds and inputs."""
        return {"every_seconds": self.every_seconds, "inputs": self.inputs}

    def to_dict(self) -> dict[str, Any]:
        return {"every_seconds": self.every_seconds, **self.inputs, "note": self.note}


def _finite(value: float) -> Optional[float]:
    return value if math.isfinite(value) else None


def plan_interval(blocking_cost_s: float, mtbp_s: float, upload_s: float, max_staleness_s: Optional[float] = None,
                  *, min_interval_s: float = MIN_INTERVAL_S, max_interval_s: float = MAX_INTERVAL_S,
                  sources: Optional[Mapping[str, str]] = None) -> IntervalPlan:
    """Choose the interval: Daly's optimum for the BLOCKING cost, clamped to [lower, upper].

    lower = max(min_interval_s, upload_s): each checkpoint must become durable before the next one
        supersedes its upload (the uploader is newest-wins), or nothing ever becomes durable.
    upper = min(max_interval_s, max_staleness_s - blocking_cost_s - upload_s): the durable copy is at
        worst interval + blocking + upload old when the next one lands, which is what a preemption loses
        when the emergency checkpoint does not make it.
    When the bounds cross, the upload bound wins (a fresher durable copy is impossible) and `conflict` says so.
    """
    _check("blocking_cost_s", blocking_cost_s)
    _check("mtbp_s", mtbp_s, allow_inf=True, positive=True)
    _check("upload_s", upload_s)
    _check("min_interval_s", min_interval_s, positive=True)
    _check("max_interval_s", max_interval_s, positive=True)
    if max_staleness_s is not None:
        _check("max_staleness_s", max_staleness_s)
    daly = daly_interval(blocking_cost_s, mtbp_s)
    young = young_interval(blocking_cost_s, mtbp_s)
    lower, lower_bound = (upload_s, "upload") if upload_s >= min_interval_s else (min_interval_s, "min_interval")
    upper, upper_bound = max_interval_s, "max_interval"
    if max_staleness_s is not None and max_staleness_s - blocking_cost_s - upload_s < upper:
        upper, upper_bound = max_staleness_s - blocking_cost_s - upload_s, "staleness"
    conflict, note = False, ""
    if upper < lower:
        every, bound, conflict = lower, lower_bound, True
        if upper_bound == "staleness":
            note = (f"max staleness {max_staleness_s:g} s cannot be met: the durable copy is at best "
                    f"{lower + blocking_cost_s + upload_s:.0f} s old ({lower:.0f} s interval + "
                    f"{blocking_cost_s:.0f} s blocking + {upload_s:.0f} s upload)")
        else:
            note = f"an upload takes {upload_s:.0f} s, longer than the {max_interval_s:.0f} s cap on the interval"
    elif daly < lower:
        every, bound = lower, lower_bound
    elif daly > upper:
        every, bound = upper, upper_bound
    else:
        every, bound = daly, "daly"
    return IntervalPlan(every_seconds=float(every), bound=bound, daly_s=daly, young_s=young, lower_s=float(lower),
                        upper_s=float(upper), blocking_cost_s=float(blocking_cost_s), mtbp_s=float(mtbp_s),
                        upload_s=float(upload_s), max_staleness_s=max_staleness_s, conflict=conflict,
                        expected_overhead=_overhead(every, blocking_cost_s, mtbp_s), note=note,
                        sources=dict(sources or {}))


def _overhead(tau: float, C: float, M: float) -> Optional[float]:
    try:
        value = C / tau if math.isinf(M) else daly_wall_time(1.0, tau, C, M) - 1
    except (OverflowError, ZeroDivisionError):
        return None
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class AttemptUptime:
    attempt: int
    uptime_s: float
    preempted: bool
    spot: bool


@dataclass(frozen=True)
class MtbpEstimate:
    """The mean time between preemptions to plan with, and how it was reached."""

    mtbp_s: float
    source: Literal["prior", "observed+prior"]
    preemptions: int
    exposure_s: float
    """Spot uptime summed over attempts, up to each preemption, including attempts not (yet) preempted."""
    observed_s: Optional[float]
    """exposure / preemptions, the data alone; None before the first preemption."""
    prior_s: float
    prior_weight: float
    attempts: list[AttemptUptime] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_NOTICE_TYPES = ("preemption_notice", "preempt_notice_sent", "signal", "preempt_sigterm")


def _events(log: Union[EventLog, Iterable[Mapping[str, Any]]]) -> list[Mapping[str, Any]]:
    events = log.events if isinstance(log, EventLog) else list(log)
    return sorted((e for e in events if isinstance(e.get("ts"), (int, float))), key=lambda e: e["ts"])


def _preempted_reason(text: Any) -> Optional[bool]:
    """The end reasons docs/cost.md maps onto `preempted`; None when there is no reason to read."""
    word = str(text or "").strip().lower()
    if not word:
        return None
    return "preempt" in word or word in ("signal", "sigterm", "sigkill", "terminated", "notice")


def _as_bool(value: Any, default: bool) -> bool:
    if value is None:
        return default
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "spot")
    return bool(value)


def attempt_uptimes(log: Union[EventLog, Iterable[Mapping[str, Any]]], *,
                    now: Optional[float] = None) -> list[AttemptUptime]:
    """Per attempt: how long it ran before it was preempted (or until it ended, or until `now`).

    Start: `attempt_start` (executor) or the first trainer `start`. A preempted attempt ends at its first
    notice (`preemption_notice`, `preempt_notice_sent`, `signal`, `preempt_sigterm`); without one, at its
    `attempt_end`, last `exit` or last event. Preempted: `attempt_end` or `exit` says so, or the attempt
    left no end record and a later attempt exists (killed with its node, as docs/cost.md reads it), or it
    is still open with a notice in it. Spot: `where.spot` of attempt_start or start (assumed spot if unset).
    """
    events = _events(log)
    by_attempt: dict[int, list[Mapping[str, Any]]] = {}
    for e in events:
        attempt = e.get("attempt", 0)
        by_attempt.setdefault(attempt if isinstance(attempt, int) else 0, []).append(e)
    numbers = sorted(by_attempt)
    result = []
    for index, number in enumerate(numbers):
        evs = by_attempt[number]
        later = index + 1 < len(numbers)
        executor_start = next((e for e in evs if e.get("type") == "attempt_start"), None)
        starts = [e for e in evs if e.get("type") == "start"]
        start = executor_start["ts"] if executor_start else (starts[0]["ts"] if starts else evs[0]["ts"])
        where: dict[str, Any] = {}
        for e in ([executor_start] if executor_start else []) + starts:
            if isinstance(e.get("where"), Mapping):
                for key, value in e["where"].items():
                    where.setdefault(key, value)
        spot = _as_bool(where.get("spot"), True)
        notices = [e["ts"] for e in evs if e.get("type") in _NOTICE_TYPES]
        ends = [e for e in evs if e.get("type") == "attempt_end"]
        exits = [e for e in evs if e.get("type") == "exit"]
        if ends:
            preempted = _preempted_reason(ends[-1].get("reason"))
            end = ends[-1]["ts"]
        elif exits:
            preempted = _preempted_reason(exits[-1].get("reason"))
            end = exits[-1]["ts"]
        else:
            preempted = True if later else None
            end = evs[-1]["ts"] if later or now is None else max(now, evs[-1]["ts"])
        if preempted is None:
            preempted = bool(notices)
        if preempted and notices:
            end = min(notices)
        result.append(AttemptUptime(number, max(0.0, end - start), bool(preempted), spot))
    return result


def mtbp_from_events(log: Union[EventLog, Iterable[Mapping[str, Any]]], prior_s: float, min_observations: int = 2,
                     *, prior_weight: float = 1.0, now: Optional[float] = None) -> MtbpEstimate:
    """The mean time between preemptions: the prior until `min_observations` preemptions are seen, then

        (prior_weight * prior_s + exposure) / (prior_weight + preemptions)

    where exposure sums the spot uptime of every attempt (censored ones too: an attempt that ran 10 h
    without a preemption is evidence). This is 1 / the posterior mean rate for exponential preemptions
    with a Gamma prior on the rate worth `prior_weight` preemptions seen over prior_weight * prior_s.
    On-demand attempts are not exposed to preemption and are left out.
    """
    _check("prior_s", prior_s, positive=True)
    _check("prior_weight", prior_weight)
    if min_observations < 0:
        raise ValueError(f"min_observations must be >= 0, got {min_observations}")
    uptimes = attempt_uptimes(log, now=now)
    spot = [a for a in uptimes if a.spot]
    preemptions = sum(1 for a in spot if a.preempted)
    exposure = sum(a.uptime_s for a in spot)
    observed = exposure / preemptions if preemptions else None
    if preemptions < max(min_observations, 1) or prior_weight + preemptions == 0:
        return MtbpEstimate(prior_s, "prior", preemptions, exposure, observed, prior_s, prior_weight, uptimes)
    mtbp = (prior_weight * prior_s + exposure) / (prior_weight + preemptions)
    mtbp = max(mtbp, 1.0)  # zero only when the prior weighs nothing and every attempt died at once
    return MtbpEstimate(mtbp, "observed+prior", preemptions, exposure, observed, prior_s, prior_weight, uptimes)


def _per_checkpoint(events: list[Mapping[str, Any]], type: str, value: str,
                    keep=lambda e: True) -> list[float]:
    """One figure per checkpoint (attempt, step, kind): the largest over ranks and nodes, since a
    collective save waits for its slowest rank and a checkpoint is durable when its last node is."""
    worst: dict[tuple, float] = {}
    for e in events:
        if e.get("type") != type or not keep(e):
            continue
        raw = e.get(value)
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) or raw < 0:
            continue
        key = tuple(repr(e.get(k)) for k in ("attempt", "step", "kind"))  # repr: a stray list must not crash
        worst[key] = max(worst.get(key, 0.0), float(raw))
    return list(worst.values())


def blocking_cost_from_events(log: Union[EventLog, Iterable[Mapping[str, Any]]]) -> Optional[float]:
    """Median `blocked_seconds` of the run's interval checkpoints (`checkpoint_end`, any kind but
    `emergency`), taking the slowest rank of each; None before the first one."""
    values = _per_checkpoint(_events(log), "checkpoint_end", "blocked_seconds",
                             lambda e: str(e.get("kind", "")).lower() != "emergency")
    return statistics.median(values) if values else None


def upload_seconds_from_events(log: Union[EventLog, Iterable[Mapping[str, Any]]]) -> Optional[float]:
    """Median `seconds` of the uploads that made a checkpoint durable (`upload_end` with `durable`), the
    slowest node of each; None before the first one."""
    values = _per_checkpoint(_events(log), "upload_end", "seconds", lambda e: e.get("durable") is True)
    return statistics.median(values) if values else None


def plan_from_events(log: Union[EventLog, Iterable[Mapping[str, Any]]], *, prior_s: float, blocking_cost_s: float,
                     upload_s: float, max_staleness_s: Optional[float] = None, min_observations: int = 2,
                     prior_weight: float = 1.0, now: Optional[float] = None,
                     min_interval_s: float = MIN_INTERVAL_S) -> IntervalPlan:
    """Re-plan from what the run has seen: observed blocking cost, upload time and preemptions, each
    replacing its estimate (`blocking_cost_s`, `upload_s`, `prior_s`) once observed. The plan's
    `sources` say which were used."""
    observed_c = blocking_cost_from_events(log)
    observed_u = upload_seconds_from_events(log)
    mtbp = mtbp_from_events(log, prior_s, min_observations, prior_weight=prior_weight, now=now)
    sources = {"blocking_cost_s": "observed median" if observed_c is not None else "estimate",
               "upload_s": "observed median" if observed_u is not None else "estimate",
               "mtbp_s": f"{mtbp.source} ({mtbp.preemptions} preemptions in {mtbp.exposure_s:.0f} s)"}
    return plan_interval(observed_c if observed_c is not None else blocking_cost_s, mtbp.mtbp_s,
                         observed_u if observed_u is not None else upload_s, max_staleness_s,
                         min_interval_s=min_interval_s, sources=sources)


def initial_plan(recipe: "Recipe", cloud: str, *, bandwidth: Optional[Mapping[str, Mapping[str, float]]] = None,
                 environ: Optional[Mapping[str, str]] = None,
                 max_staleness_s: Optional[float] = None) -> Optional[IntervalPlan]:
    """The plan before any event: blocking cost = the local write, upload time and MTBP from the
    assumptions and priors above. None when the model's size is unknown."""
    state = state_bytes(recipe, environ=environ)
    if state.bytes_per_node is None:
        return None
    bw = bandwidth_for(cloud, disk_size_gb=recipe.resources.disk_size, overrides=bandwidth, environ=environ)
    accelerator = recipe.resources.accelerators[0] if recipe.resources.accelerators else None
    prior = mtbp_prior(cloud, accelerator, recipe.resources.num_nodes)
    return plan_interval(state.bytes_per_node / (bw.write_gbps * GB), prior.job_s,
                         state.bytes_per_node / (bw.upload_gbps * GB), max_staleness_s,
                         sources={"blocking_cost_s": f"estimate: local write ({bw.write_source})",
                                  "upload_s": f"estimate: upload ({bw.upload_source})", "mtbp_s": prior.source})
