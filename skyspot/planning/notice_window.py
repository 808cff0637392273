"""Can an emergency checkpoint beat the notice window? The check `launch` and `recipes` run per
candidate cloud, the advice that fixes what does not make it, and the bandwidths a run measured.
docs/planning.md derives every formula and works the llama70b numbers by hand.

    report = check_notice_windows(recipe)          # per cloud: durable in time / local only / not in time
    report.advice                                  # recipe settings that fix what does not make it

The clouds' windows, poll periods and default bandwidths are cloud facts (skyspot/clouds/); the
state's size comes from skyspot/sizing.py. Import-light: the CLI imports this at start-up.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping, Optional, Union

from skyspot.clouds import (
    GB,
    NOTICE_DETECT_S,
    NOTICE_WINDOWS_S,
    SNAPSHOT_GBPS_PER_RANK,
    WRITE_ENV,
    Bandwidth,
    bandwidth_for,
)
from skyspot.events import EventLog
from skyspot.events import EventType as T
from skyspot.sizing import StateEstimate, state_bytes

if TYPE_CHECKING:  # the recipe module pulls in pydantic; callers already have a Recipe
    from skyspot.recipe import Recipe


def _events(log: Union[EventLog, Iterable[Mapping[str, Any]]]) -> list[Mapping[str, Any]]:
    events = log.events if isinstance(log, EventLog) else list(log)
    return sorted((e for e in events if isinstance(e.get("ts"), (int, float))), key=lambda e: e["ts"])


def measured_bandwidth(log: Union[EventLog, Iterable[Mapping[str, Any]]]) -> dict[str, dict[str, float]]:
    """What a run measured, as `bandwidth=` overrides for the window check (empty when nothing was).

    write_gbps: the node's local disk as `python -m skyspot.trainer.local_disk` measured it at setup
    (`local_disk` events, the slowest node), else the median over checkpoints of bytes / write_seconds
    (serialisation, hashing and fsync included). upload_gbps: the median of the streamed bytes /
    stream_seconds of the uploads that made a checkpoint durable (`upload_end`), else bytes / seconds.
    """
    events = _events(log)
    found: dict[str, float] = {}
    disks = [e["write_gbps"] for e in events if e.get("type") == T.LOCAL_DISK and _positive(e.get("write_gbps"))]
    writes = [
        e["bytes"] / e["write_seconds"] / GB
        for e in events
        if e.get("type") == T.CHECKPOINT_END
        and _positive(e.get("bytes"))
        and _positive(e.get("write_seconds"))
        and e["bytes"] >= 1e8
    ]
    if disks:
        found["write_gbps"] = min(disks)
    elif writes:
        found["write_gbps"] = statistics.median(writes)
    uploads = []
    for e in events:
        if e.get("type") != T.UPLOAD_END or e.get("durable") is not True:
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

LOST_MEANING = (
    "the node's disk goes with the spot VM (SkyPilot recovers on new nodes), so recovery "
    "falls back to the last durable interval checkpoint"
)


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


def check_window(
    cloud: str, bytes_per_node: Optional[int], bandwidth: Bandwidth, *, step_s: float = 0.0, ranks_per_node: int = 1
) -> WindowCheck:
    """The window check for one cloud, given what the busiest node must write and upload.

    durable_at = detect + step + snapshot + max(write, upload): the ranks copy their shards to host
    memory at the step boundary, then each rank's bytes go to the local file and to the store in
    one pass (writer.py), so the slower of the two paths decides.
    """
    window, detect = NOTICE_WINDOWS_S[cloud], NOTICE_DETECT_S[cloud]
    common = dict(
        cloud=cloud,
        window_s=window,
        detect_s=detect,
        step_s=step_s,
        bytes_per_node=bytes_per_node,
        write_gbps=bandwidth.write_gbps,
        upload_gbps=bandwidth.upload_gbps,
        write_source=bandwidth.write_source,
        upload_source=bandwidth.upload_source,
    )
    if bytes_per_node is None:
        return WindowCheck(
            **common,
            write_s=None,
            upload_s=None,
            local_at_s=None,
            durable_at_s=None,
            verdict="unknown",
            local_slack_s=None,
            durable_slack_s=None,
            meaning="the model's size is unknown, so whether a checkpoint fits cannot be told",
        )
    snapshot_s = bytes_per_node / max(1, ranks_per_node) / (SNAPSHOT_GBPS_PER_RANK * GB)
    write_s = bytes_per_node / (bandwidth.write_gbps * GB)
    upload_s = bytes_per_node / (bandwidth.upload_gbps * GB)
    local_at = detect + step_s + snapshot_s + write_s
    durable_at = detect + step_s + snapshot_s + max(write_s, upload_s)
    local_slack, durable_slack = window - local_at, window - durable_at
    arithmetic = (
        f"{bytes_per_node / GB:,.1f} GB/node: {detect:g} s notice poll + {step_s:g} s step + "
        f"{snapshot_s:.1f} s snapshot + max({write_s:,.1f} s write at {bandwidth.write_gbps:g} GB/s, "
        f"{upload_s:,.1f} s upload at {bandwidth.upload_gbps:g} GB/s) = {durable_at:,.1f} s "
        f"{'<=' if durable_slack >= 0 else '>'} {window:.0f} s notice"
    )
    if durable_slack >= 0:
        verdict: Verdict = "durable in time"
        meaning = f"durable {durable_slack:.0f} s before the VM goes: a preemption loses nothing"
    elif local_slack >= 0:
        verdict = "local only in time"
        meaning = (
            f"committed locally {local_slack:.0f} s before the VM goes, but the upload needs "
            f"{-durable_slack:.0f} s more; {LOST_MEANING}"
        )
    else:
        verdict = "not in time"
        meaning = f"even the local commit needs {local_at:.0f} s of the {window:.0f} s window; {LOST_MEANING}"
    return WindowCheck(
        **common,
        write_s=write_s,
        upload_s=upload_s,
        local_at_s=local_at,
        durable_at_s=durable_at,
        verdict=verdict,
        local_slack_s=local_slack,
        durable_slack_s=durable_slack,
        meaning=meaning,
        snapshot_s=snapshot_s,
        arithmetic=arithmetic,
    )


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
        return {c.cloud: c for c in self.checks}[cloud]

    @property
    def durable_clouds(self) -> list[str]:
        return [c.cloud for c in self.checks if c.verdict == "durable in time"]

    @property
    def warnings(self) -> list[str]:
        """One line per spot cloud where a preemption would fall back to the last interval checkpoint."""
        if not self.spot:
            return []
        return [
            f"{c.cloud}: emergency checkpoint {c.verdict} ({c.window_s:.0f} s notice): {c.meaning}"
            for c in self.checks
            if c.verdict != "durable in time"
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "spot": self.spot,
            "state": self.state.to_dict(),
            "checks": [c.to_dict() for c in self.checks],
            "advice": list(self.advice),
            "warnings": self.warnings,
        }


def check_notice_windows(
    recipe: "Recipe",
    *,
    clouds: Optional[Iterable[str]] = None,
    bandwidth: Optional[Mapping[str, Mapping[str, float]]] = None,
    environ: Optional[Mapping[str, str]] = None,
    step_s: float = 0.0,
    max_loss_s: Optional[float] = None,
) -> WindowReport:
    """Can an emergency checkpoint become durable inside each candidate cloud's notice window?

    clouds: default the recipe's `resources.clouds`. bandwidth: per-cloud overrides (see
    `bandwidth_for`). step_s: how long the step in progress may still take (unknown before launch: 0,
    and the slack columns say how much a step may take). max_loss_s: the loss bound `advice` aims at.
    """
    if not (math.isfinite(step_s) and step_s >= 0):
        raise ValueError(f"step_s must be a finite number >= 0, got {step_s!r}")
    state = state_bytes(recipe, environ=environ)
    checks = []
    for cloud in list(clouds) if clouds is not None else list(recipe.resources.clouds):
        bw = bandwidth_for(
            cloud,
            disk_size_gb=recipe.resources.disk_size,
            overrides=bandwidth,
            environ=environ,
            local_nvme=bool(recipe.resources.accelerators),
        )
        checks.append(
            check_window(cloud, state.bytes_per_node, bw, step_s=step_s, ranks_per_node=recipe.resources.ranks_per_node)
        )
    report = WindowReport(recipe.name, recipe.resources.spot, state, checks)
    report.advice.extend(
        advice(report, recipe, max_loss_s=max_loss_s if max_loss_s is not None else DEFAULT_MAX_LOSS_S)
    )
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
        lines.append(
            f"the local write is the slow part on {', '.join(slow_disk)} (SkyPilot's default root disk): "
            f"keep the fast tier on the node's local NVMe (SKYSPOT_RUN_DIR) and tell the check its "
            f"speed, e.g. {WRITE_ENV}=2"
        )
    # 2. A shorter interval bounds what a preemption loses when the emergency checkpoint does not make it:
    #    the newest durable copy is at worst interval + its save (snapshot + the slower of write and upload,
    #    which overlap) old. Training is blocked only for the snapshot; the rest runs in the background.
    worst = max(failing, key=lambda c: (c.snapshot_s or 0) + max(c.write_s or 0, c.upload_s or 0))
    snapshot_s = worst.snapshot_s or 0.0
    save_s = snapshot_s + max(worst.write_s or 0.0, worst.upload_s or 0.0)
    every = recipe.checkpoint.every_seconds
    now = (
        f"now every_seconds={every:g}: up to {(every + save_s) / 60:.1f} min"
        if isinstance(every, (int, float))
        else "now `auto`"
        if every == "auto"
        else "now no time-based interval"
    )
    target = max_loss_s - save_s
    if target >= save_s and _round_down(target) >= save_s:
        interval = _round_down(target)
        head = f"checkpoint.every_seconds={interval}: a preemption on {names} then loses at most"
    else:
        interval = math.ceil(save_s)
        head = (
            f"checkpoint.every_seconds={interval} (the shortest interval whose upload finishes before the next "
            f"checkpoint supersedes it): a preemption on {names} then still loses up to"
        )
    blocked = snapshot_s / (interval + snapshot_s)
    if blocked <= MAX_BLOCKED_SHARE:
        lines.append(
            f"{head} {(interval + save_s) / 60:.1f} min (interval + {save_s:.0f} s to a durable copy), with "
            f"training blocked {blocked:.1%} of the time by the snapshots "
            f"({now}; or `auto` to plan it from the preemption rate)"
        )
    else:
        lines.append(
            f"a shorter checkpoint.every_seconds would only trade lost work for blocked training: each "
            f"snapshot blocks {snapshot_s:.0f} s, so {interval} s would block {blocked:.0%} of the time ({now})"
        )
    # 3. Fewer clouds, when some candidates make it.
    good = report.durable_clouds
    if good:
        lines.append(
            f"resources.clouds=[{','.join(good)}]: drop {names}, where the emergency checkpoint "
            "cannot become durable in time"
        )
    # 4. More nodes: each node writes and uploads checkpoint_bytes / num_nodes in parallel. Only counts up to
    #    4x today's are offered; beyond that the fix costs more than the loss it prevents.
    needs = []
    for c in failing:
        budget = c.window_s - c.detect_s - c.step_s
        if budget > 0 and state.checkpoint_bytes and state.zero_stage == 3:
            seconds_per_byte = max(1 / (c.write_gbps * GB), 1 / (c.upload_gbps * GB)) + 1 / (
                state.ranks_per_node * SNAPSHOT_GBPS_PER_RANK * GB
            )
            nodes = math.ceil(state.checkpoint_bytes * seconds_per_byte / budget)
            if nodes <= 4 * state.num_nodes:
                needs.append(f"{nodes} on {c.cloud}")
    if needs:
        lines.append(
            f"resources.num_nodes: the state ({state.checkpoint_bytes / GB:.1f} GB) becomes durable in time "
            f"with at least {', '.join(needs)} (now {state.num_nodes}; each node adds GPUs and cost)"
        )
    # 5. LoRA: only the adapters are trained, so only they are checkpointed (recipes llama70b-lora, llama8b-lora).
    if getattr(recipe.train, "lora", None) is None and recipe.model.hub_id:
        lines.append(
            f"train.lora={{}}: a LoRA fine-tune checkpoints only the adapters' state (for Llama-3.1-70B at "
            f"r=16, 2.5 GB instead of 846.6 GB: see the llama70b-lora recipe), durable in seconds on "
            f"{names}"
        )
    return lines
