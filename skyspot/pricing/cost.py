"""What a run cost, what it saved, and what each preemption cost, computed from its events.

One concept despite its length: every figure of the cost report (attempt costs, egress, recoveries,
the on-demand baseline, goodput) is read off the same attempts and steps in one pass, and
docs/cost.md defines them together; the attempts themselves come from skyspot/attempts.py.

Nothing here is typed in: every figure comes from an `events.EventLog` (trainer events, and
executor events when the local executor ran the job) plus hourly list prices from
`skyspot.pricing.prices`. docs/cost.md defines each figure and works one example by hand.

Attempts. An attempt is one placement of the job on nodes, as skyspot/attempts.py splits the
events: from `attempt_start` (local executor: nodes provisioned) or the trainer's first `start`
(SkyPilot runs, whose controller keeps its own record) to its `attempt_end` or last `exit`, or to
its last event if it never wrote one. Billing that began before the trainer started (provisioning,
setup) is invisible in a SkyPilot run's events, so its figures are a floor. A SkyPilot `queue_v2`
record, when given, fills what events lack.

Money. An attempt costs (end - start) x nodes x the hourly price of its instance, spot or
on-demand as `where.spot` says, plus internet egress when it ran on another cloud than the
run's store: the bytes its `upload_end` events sent (at its own cloud's egress price) and the
bytes its `resume` from the store pulled back (at the store's cloud's price). A local run is
priced as the cloud instance its `where` names and is reported as simulated. All figures are
estimates, not bills.

Baseline. What the same run would have cost as one uninterrupted attempt on the cheapest
on-demand candidate: one start-up (the first attempt's billing start to its first step), every
useful step once, and one wind-down (the last step to the end of a completed run). Recoveries,
recomputed steps, checkpoint stalls and start-ups after the first count against spot. Evaluations
count once each, like steps: an uninterrupted run evaluates too.

In-place restarts. torchrun's agent may restart every rank on the same machines within an attempt
(`restart_in_place`, docs/cost.md): those recoveries are reported apart from the re-provisioned ones
(new attempts), in their own MTTR and lost work, and a `hang` the watchdog turned into one is counted.
"""

from __future__ import annotations

import copy
import math
import time
from bisect import bisect_right
from dataclasses import asdict, dataclass, field, fields
from itertools import accumulate
from typing import Any, Callable, Iterable, Mapping, Optional

from skyspot.pricing import prices as pricing
from skyspot.attempts import (
    DECISION_EVENT,
    UNKNOWN,
    Attempt,
    cause_of,
    count_causes,
    describe_causes,
    end_of_status,
    is_simulated,
    is_spot,
    split,
)
from skyspot.clouds.fabric_rates import summarize as summarize_fabric
from skyspot.errors import UsageError
from skyspot.events import EventLog
from skyspot.events import EventType as T


@dataclass
class AttemptCost:
    """One attempt: where it ran, how long it was billed, and what that cost."""

    attempt: int
    cloud: Optional[str]
    region: Optional[str]
    zone: Optional[str]
    instance_type: Optional[str]
    nodes: int
    spot: bool
    start: float
    """Unix time billing starts: nodes provisioned (executor) or trainer started (SkyPilot)."""
    end: float
    end_reason: str
    """complete, preempted, error, cancelled, running (billed up to `now`) or unknown."""
    seconds: float
    """Wall time, end - start."""
    billed_hours: float
    """Node-hours: seconds / 3600 x nodes."""
    usd_per_hour: Optional[float]
    """Per node; None when no price is known (see RunCost.warnings)."""
    cost_usd: Optional[float]
    price_source: Optional[str]
    price_date: Optional[str]
    price_detail: Optional[str]
    simulated: bool
    compute_usd: Optional[float] = None
    """billed_hours x usd_per_hour; `cost_usd` is this plus `egress_usd`."""
    egress_upload_bytes: int = 0
    """Bytes the attempt's `upload_end` events sent to a store on another cloud (0 on the store's cloud)."""
    egress_download_bytes: int = 0
    """Bytes its `resume` from a store on another cloud downloaded, as the events record them."""
    egress_usd: float = 0.0
    egress_detail: Optional[str] = None
    cause: Optional[str] = None
    """Why it ended, when it did not complete: one of attempts.CAUSES (spot-preemption, planned-maintenance,
    rebalance, deadline-switch, sigterm, node-lost, cancelled, setup-failed, error, ...)."""
    cloud_cause: Optional[str] = None
    """The cloud's own name for the cause, when its notice gave one (AWS `terminate`, GCP
    `TERMINATE_ON_HOST_MAINTENANCE`, Azure `Preempt`)."""
    transport: Optional[str] = None
    """What NCCL used between the nodes, from its nodes' `fabric` events (ib, roce, ofi, tcpx, socket; gloo
    on CPU), several joined by commas when nodes differed; None when no node recorded it."""
    fabric: Optional[dict[str, Any]] = None
    """The fabric probe's figures from its nodes' `fabric` events (clouds.fabric_rates.summarize): transport,
    the slowest node's bus bandwidth (GB/s), the expected figure, below_expected, the first warning."""

    def to_dict(self) -> dict[str, Any]:
        return _flat_dict(self)


@dataclass
class Recovery:
    """From the first sign of a preemption to the first step done on the next attempt.

    Timestamps are unix seconds (None when the events do not show that moment); each
    `*_seconds` part is the gap between two of them, and `total_seconds` runs from
    `notice_at` (or `exit_at` when no notice came, e.g. a bare SIGKILL) to `first_step_at`.
    """

    from_attempt: int
    to_attempt: int
    cause: str
    notice_at: Optional[float]
    checkpoint_at: Optional[float]
    exit_at: float
    start_at: float
    restored_at: Optional[float]
    first_step_at: Optional[float]
    notice_to_checkpoint_seconds: Optional[float]
    checkpoint_to_exit_seconds: Optional[float]
    notice_to_exit_seconds: Optional[float]
    exit_to_start_seconds: float
    start_to_restore_seconds: Optional[float]
    restore_to_first_step_seconds: Optional[float]
    total_seconds: Optional[float]
    emergency_checkpoint: bool
    restored_step: Optional[int]
    load_seconds: Optional[float]
    lost_steps: int
    """Steps run in `from_attempt` that had to be run again (not covered by a checkpoint)."""
    lost_seconds: float
    """Sum of those steps' step_seconds."""
    interruption_cause: Optional[str] = None
    """Why `from_attempt` ended (its AttemptCost.cause); `cause` is its end reason."""
    cloud_cause: Optional[str] = None
    """The cloud's own name for it (its AttemptCost.cloud_cause)."""

    def to_dict(self) -> dict[str, Any]:
        return _flat_dict(self)


_WORKINGS = {"workings": True}
"""A RunCost field that holds what its figures were counted from, not a figure (to_dict leaves it out)."""


@dataclass
class RunCost:
    """Per-run cost, baseline, savings and recovery figures. Always an estimate."""

    name: str
    attempts: list[AttemptCost]
    recovery_details: list[Recovery]
    cost_usd: float
    on_demand_cost_usd: Optional[float]
    """baseline_seconds / 3600 x nodes x baseline_usd_per_hour."""
    baseline_usd_per_hour: Optional[float]
    baseline_instance: Optional[str]
    """The cheapest on-demand candidate, as 'cloud instance_type region'."""
    savings_usd: Optional[float]
    savings_pct: Optional[float]
    """100 x savings_usd / on_demand_cost_usd."""
    sagemaker_savings_pct: Optional[float]
    """100 x (1 - billed_seconds / training_seconds): SageMaker's managed-spot savings formula,
    (1 - BillableTimeInSeconds / TrainingTimeInSeconds) * 100 (SageMaker API reference,
    DescribeTrainingJob, BillableTimeInSeconds). A time ratio, blind to spot prices."""
    preemptions: int
    recoveries: int
    mttr_seconds: Optional[float]
    lost_steps: int
    lost_seconds: float
    checkpoint_overhead_seconds: float
    useful_steps: int
    useful_seconds: float
    billed_seconds: float
    """Wall seconds with nodes up: sum of attempt seconds (not multiplied by nodes)."""
    billed_node_hours: float
    training_seconds: float
    """Wall span from the first attempt's start to the last attempt's end, gaps included."""
    goodput: Optional[float]
    """useful_seconds / billed_seconds."""
    nodes: int
    price_source: Optional[str]
    price_date: Optional[str]
    simulated: bool
    estimated: bool = True
    warnings: list[str] = field(default_factory=list)
    interval_plans: list[dict] = field(default_factory=list)
    """checkpoint.every_seconds=auto: each plan the trainer logged (attempt, step, every_seconds, bound,
    reason, mtbp_s, blocking_cost_s), oldest first; the last is the interval in use."""
    store_cloud: Optional[str] = None
    """The cloud of the run's store (s3 -> aws, gs -> gcp, az -> azure); None for a local store or none."""
    egress_usd: float = 0.0
    """Σ attempt `egress_usd`; already inside `cost_usd`."""
    egress_bytes: int = 0
    """Σ attempt egress upload and download bytes."""
    startup_seconds: float = 0.0
    """The one start an uninterrupted run also pays: from the start of the first attempt that ran a step
    to the start of that step (provisioning, setup, op builds, model load); all of the first attempt
    when no step ran yet."""
    wind_down_seconds: float = 0.0
    """The one finish an uninterrupted run also pays: the end of the last step to the end of the last
    attempt (final checkpoint, export, shutdown); 0 unless the run completed."""
    baseline_seconds: float = 0.0
    """startup_seconds + useful_seconds + useful_eval_seconds + wind_down_seconds: the run as one
    uninterrupted attempt."""
    interruptions_by_cause: dict[str, int] = field(default_factory=dict)
    """Attempts that ended without completing, counted by cause (attempts.CAUSES), most frequent first."""
    interruptions: str = ""
    """The same in words: '2 spot preemptions, 1 planned maintenance'; empty when nothing was interrupted."""
    restarts_in_place: int = 0
    """In-place restarts (same attempt, same machines, new processes), over every attempt."""
    hangs: int = 0
    """Hangs the watchdog caught (one per set of processes, whichever nodes saw it)."""
    in_place_details: list[InPlaceRecovery] = field(default_factory=list)
    mttr_reprovisioned_seconds: Optional[float] = None
    """Mean `total_seconds` of the recoveries onto a new attempt (`recovery_details`)."""
    mttr_in_place_seconds: Optional[float] = None
    """Mean `seconds_to_next_step` of the in-place restarts."""
    lost_steps_reprovisioned: int = 0
    lost_seconds_reprovisioned: float = 0.0
    lost_steps_in_place: int = 0
    lost_seconds_in_place: float = 0.0
    evals: int = 0
    """`eval` events (every evaluation run, redone ones included)."""
    eval_seconds: float = 0.0
    """Σ their `seconds`: the time spent evaluating, its own line in `goodput_breakdown`."""
    useful_eval_seconds: float = 0.0
    """What the baseline counts of it: each evaluated step once (its last run), the evaluations after the
    last step left to the wind-down that holds them."""
    final_eval_loss: Optional[float] = None
    """The newest evaluation's loss (what the money bought), its perplexity, step and time."""
    final_eval_perplexity: Optional[float] = None
    final_eval_step: Optional[int] = None
    final_eval_at: Optional[float] = None
    final_train_loss: Optional[float] = None
    """The newest step's training loss, and its step."""
    final_train_step: Optional[int] = None
    final_train_diverged: bool = False
    """The newest step's loss was NaN or inf (final_train_loss is then None: JSON has no NaN)."""
    goodput_breakdown: dict[str, float] = field(default_factory=dict)
    """billed_seconds, line by line (GOODPUT_LINES): they add up to billed_seconds; `useful` over it is goodput."""
    step_runs: list["StepRun"] = field(default_factory=list, repr=False, compare=False, metadata=_WORKINGS)
    """Every step's runs and every evaluation the figures above were counted from: the plot draws these
    rather than reckon the run again (a second split of 20,000 attempts cost the plot 2 s, issue 31).
    Workings, not figures: left out of to_dict."""
    eval_runs: list["EvalRun"] = field(default_factory=list, repr=False, compare=False, metadata=_WORKINGS)

    def to_dict(self) -> dict[str, Any]:
        # Not asdict(self): that converts every attempt twice (once here, once below) and deep-copies as it
        # goes, 0.4 ms an attempt, most of the report's time for 20,000 of them (issue 31, item 9).
        records = {"attempts", "recovery_details", "in_place_details"}
        return {
            f.name: [r.to_dict() for r in getattr(self, f.name)]
            if f.name in records
            else copy.deepcopy(getattr(self, f.name))
            for f in fields(self)
            if not f.metadata.get("workings")
        }


# Where billed time went (RunCost.goodput_breakdown), in this order; docs/cost.md defines each line.
GOODPUT_LINES = (
    "useful",
    "evaluating",
    "redone_in_place",
    "redone_reprovisioned",
    "checkpoint_stalls",
    "first_start_up",
    "reprovisioned_start_ups",
    "in_place_restarts",
    "other",
)


@dataclass(frozen=True)
class StepRun:
    """One execution of one training step; `recomputed` when it ran again later (a later attempt, or the
    same attempt's processes after an in-place restart: `in_place`)."""

    attempt: int
    step: int
    ts: float
    seconds: float
    recomputed: bool
    in_place: bool = False
    """Recomputed by the same attempt after an in-place restart (no new machines)."""
    generation: int = 0
    """Which set of the attempt's processes ran it (attempts.Attempt.generation)."""
    loss: Optional[float] = None
    diverged: bool = False
    """Its loss was a number but not a finite one (NaN, inf): the training diverged there."""


@dataclass(frozen=True)
class EvalRun:
    """One evaluation (an `eval` event); `redone` when the same step was evaluated again later (a rollback)."""

    attempt: int
    step: Optional[int]
    ts: float
    seconds: float
    loss: Optional[float]
    perplexity: Optional[float]
    redone: bool


@dataclass
class InPlaceRecovery:
    """One in-place restart of an attempt's processes on the same machines (a `restart_in_place` event):
    from the failure to the next completed step, and the steps that had to be run again."""

    attempt: int
    restart: Optional[int]
    """1, 2, ... within the attempt."""
    cause: Optional[str]
    """crash, hang or error, as the trainer recorded it."""
    failed_at: Optional[float]
    first_step_at: Optional[float]
    """failed_at + seconds_to_next_step."""
    seconds_to_next_step: Optional[float]
    """The recovery's time, failure to the next completed step: what `mttr_in_place_seconds` averages."""
    resumed_step: Optional[int]
    """The step the new processes resumed from (the newest committed local checkpoint)."""
    steps_redone: Optional[int]
    """As the trainer counted them."""
    lost_steps: int
    """Step runs of the processes it replaced that the new ones ran again, from the step events."""
    lost_seconds: float
    hang: Optional[dict] = None
    """For a hang: the watchdog's record (step, seconds_without_step, bound_seconds, stacks, each rank's top)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _flat_dict(record: Any) -> dict[str, Any]:
    """A dataclass of plain values as a dict (what asdict gives for one, without its recursion)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


# --- public API --------------------------------------------------------------------------


def run_cost(
    log: EventLog,
    *,
    name: Optional[str] = None,
    candidates: Optional[Iterable[Any]] = None,
    queue_record: Any = None,
    now: Optional[float] = None,
    store: Optional[str] = None,
) -> RunCost:
    """Every figure for one run.

    `candidates` are the placements the run could have used, for the on-demand baseline:
    (cloud, instance_type or accelerator, accelerators per node, region) tuples, dicts with
    those keys, or `skyspot.planning.candidates.Candidate` objects. Without them the baseline is the
    attempts' own instance types, on demand, in their own regions.
    `queue_record` is SkyPilot's `queue_v2` record for the job, for runs without executor events.
    `now` bills a still-running last attempt up to that time.
    `store` is the run's store URI: attempts on another cloud than its own pay internet egress.
    """
    # A deadline's decisions belong to no attempt (skyspot/attempts.py): they bill nothing.
    events = sorted((e for e in log.events if e.get("type") != DECISION_EVENT), key=lambda e: e["ts"])
    split_attempts = split(events, now=now)
    warnings: list[str] = []

    price = _prices()
    attempts = [_attempt_cost(a, queue_record=queue_record, warnings=warnings, price=price) for a in split_attempts]
    home = _store_cloud(store, warnings)
    for attempt, split_attempt in zip(attempts, split_attempts):
        _add_egress(attempt, split_attempt.events, home, warnings)
    runs = step_runs(log, split_attempts)
    # Every per-attempt question below asks this, never all the runs again: linear in attempts (issue 31.9).
    runs_of = _by_attempt(runs)
    details = [
        _recovery(prev, nxt, split_attempts[i], split_attempts[i + 1], runs_of.get(prev.attempt, []))
        for i, (prev, nxt) in enumerate(zip(attempts, attempts[1:]))
    ]
    in_place = [r for a in split_attempts for r in _in_place(a, runs_of.get(a.number, []))]
    evals = eval_runs(log, split_attempts)

    useful = [r for r in runs if not r.recomputed]
    useful_seconds = sum(r.seconds for r in useful)
    billed_seconds = sum(a.seconds for a in attempts)
    training_seconds = (attempts[-1].end - attempts[0].start) if attempts else 0.0
    nodes = max((a.nodes for a in attempts), default=1)
    egress = sum(a.egress_usd for a in attempts)
    cost = sum(a.compute_usd for a in attempts if a.compute_usd is not None) + egress

    startup, wind_down = _startup_seconds(attempts, runs_of), _wind_down_seconds(attempts, runs_of)
    useful_eval_seconds = sum(e.seconds for e in baseline_evals(evals, runs, wind_down))
    baseline_seconds = startup + useful_seconds + useful_eval_seconds + wind_down
    baseline = _baseline(candidates, attempts, warnings, price)
    on_demand = baseline_seconds / 3600 * nodes * baseline.usd_per_hour if baseline else None
    savings = on_demand - cost if on_demand is not None else None
    totals = [r.total_seconds for r in details if r.total_seconds is not None]
    in_place_totals = [r.seconds_to_next_step for r in in_place if r.seconds_to_next_step is not None]
    recoveries = len(details)
    if queue_record is not None and _get(queue_record, "recovery_count"):
        recoveries = max(recoveries, int(_get(queue_record, "recovery_count")))
    prices = [(a.price_source, a.price_date) for a in attempts if a.price_source]
    causes = count_causes(attempts)
    if baseline:
        prices.append((baseline.source, baseline.source_date))
    checkpoints = _one_per_key(events, T.CHECKPOINT_END, ("step", "kind"))
    final_eval = next((e for e in reversed(evals) if e.loss is not None), None)
    # The newest step that said a loss: a NaN there is the news (issue 31.13), never an older finite loss.
    final_step = next((r for r in reversed(runs) if r.loss is not None or r.diverged), None)

    return RunCost(
        name=name or (events[0].get("run_id") if events else None) or "",
        attempts=attempts,
        recovery_details=details,
        cost_usd=cost,
        on_demand_cost_usd=on_demand,
        baseline_usd_per_hour=baseline.usd_per_hour if baseline else None,
        baseline_instance=f"{baseline.cloud} {baseline.instance_type} {baseline.region}" if baseline else None,
        savings_usd=savings,
        savings_pct=100 * savings / on_demand if on_demand else None,
        sagemaker_savings_pct=100 * (1 - billed_seconds / training_seconds) if training_seconds > 0 else None,
        preemptions=sum(a.end_reason == "preempted" for a in attempts),
        recoveries=recoveries,
        mttr_seconds=_mean(totals + in_place_totals),
        lost_steps=sum(r.recomputed for r in runs),
        lost_seconds=sum(r.seconds for r in runs if r.recomputed),
        checkpoint_overhead_seconds=sum(float(e.get("blocked_seconds") or 0.0) for e in checkpoints),
        useful_steps=len(useful),
        useful_seconds=useful_seconds,
        billed_seconds=billed_seconds,
        billed_node_hours=sum(a.billed_hours for a in attempts),
        startup_seconds=startup,
        wind_down_seconds=wind_down,
        baseline_seconds=baseline_seconds,
        training_seconds=training_seconds,
        goodput=useful_seconds / billed_seconds if billed_seconds > 0 else None,
        nodes=nodes,
        price_source="+".join(sorted({s for s, _ in prices})) or None,
        price_date="+".join(sorted({d for _, d in prices})) or None,
        simulated=any(a.simulated for a in attempts),
        warnings=warnings,
        interval_plans=_interval_plans(events),
        store_cloud=home,
        egress_usd=egress,
        egress_bytes=sum(a.egress_upload_bytes + a.egress_download_bytes for a in attempts),
        interruptions_by_cause=causes,
        interruptions=describe_causes(causes),
        restarts_in_place=sum(a.in_place_restarts for a in split_attempts),
        hangs=sum(len(a.hangs) for a in split_attempts),
        in_place_details=in_place,
        mttr_reprovisioned_seconds=_mean(totals),
        mttr_in_place_seconds=_mean(in_place_totals),
        lost_steps_reprovisioned=sum(r.recomputed and not r.in_place for r in runs),
        lost_seconds_reprovisioned=sum(r.seconds for r in runs if r.recomputed and not r.in_place),
        lost_steps_in_place=sum(r.in_place for r in runs),
        lost_seconds_in_place=sum(r.seconds for r in runs if r.in_place),
        evals=len(evals),
        eval_seconds=sum(e.seconds for e in evals),
        useful_eval_seconds=useful_eval_seconds,
        final_eval_loss=final_eval.loss if final_eval else None,
        final_eval_perplexity=final_eval.perplexity if final_eval else None,
        final_eval_step=final_eval.step if final_eval else None,
        final_eval_at=final_eval.ts if final_eval else None,
        final_train_loss=final_step.loss if final_step else None,
        final_train_step=final_step.step if final_step else None,
        final_train_diverged=bool(final_step and final_step.diverged),
        goodput_breakdown=_goodput_breakdown(
            attempts, split_attempts, runs, runs_of, evals, checkpoints, in_place, billed_seconds, startup
        ),
        step_runs=runs,
        eval_runs=evals,
    )


def baseline_evals(evals: list["EvalRun"], runs: list[StepRun], wind_down: float) -> list["EvalRun"]:
    """The evaluations the baseline counts: each evaluated step once (its last run), like each step; those
    after the last step are inside the wind-down already."""
    trained_until = max((r.ts for r in runs if not r.recomputed), default=math.inf) if wind_down else math.inf
    return [e for e in evals if not e.redone and e.ts <= trained_until]


def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def _goodput_breakdown(
    attempts: list[AttemptCost],
    split_attempts: list[Attempt],
    runs: list[StepRun],
    runs_of: dict[int, list[StepRun]],
    evals: list["EvalRun"],
    checkpoints: list[dict],
    in_place: list[InPlaceRecovery],
    billed_seconds: float,
    startup: float,
) -> dict[str, float]:
    """Where the billed wall time went, one line per GOODPUT_LINES: each from its own events, and `other` the
    rest, so the lines add up to billed_seconds. A start-up or restart window leaves out the evaluations and
    checkpoint stalls inside it, which have their own lines."""
    # What lies inside (begin, end], by prefix sums over the times: a window costs two bisections, not a pass
    # over every evaluation and checkpoint of the run (one window per attempt: quadratic for 20,000 attempts).
    marks = sorted(
        [(e.ts, e.seconds) for e in evals]
        + [(float(c["ts"]), float(c.get("blocked_seconds") or 0.0)) for c in checkpoints]
    )
    times = [ts for ts, _ in marks]
    totals = [0.0, *accumulate(seconds for _, seconds in marks)]

    def inside(begin: float, end: float) -> float:
        return totals[bisect_right(times, end)] - totals[bisect_right(times, begin)]

    def window(begin: Optional[float], end: Optional[float]) -> float:
        if begin is None or end is None or end <= begin:
            return 0.0
        return max(0.0, end - begin - inside(begin, end))

    first = next((a for a in attempts if runs_of.get(a.attempt)), None)
    first_start = first.start if first else (attempts[0].start if attempts else 0.0)
    later_start_ups = 0.0
    for a in attempts:
        mine = runs_of.get(a.attempt, [])
        if a is not first and mine:
            step = min(mine, key=lambda r: r.ts)
            later_start_ups += window(a.start, min(a.end, step.ts - step.seconds))
    restarts = 0.0
    by_number = {a.number: a for a in split_attempts}
    for r in in_place:
        a = by_number.get(r.attempt)
        if a is None:
            continue
        generation = a.generation(r.first_step_at) if r.first_step_at is not None else None
        mine = runs_of.get(r.attempt, [])
        before = [
            s
            for s in mine
            if generation is not None and s.generation < generation and (r.failed_at is None or s.ts <= r.failed_at)
        ]
        after = [s for s in mine if s.generation == generation]
        # From the old processes' last step (a hang's stall included) to the new processes' first step.
        begin = min(
            [x for x in (r.failed_at, max((s.ts for s in before), default=None)) if x is not None], default=None
        )
        first_after = min(after, key=lambda s: s.ts) if after else None
        restarts += window(begin, first_after.ts - first_after.seconds if first_after else None)
    lines = {
        "useful": sum(r.seconds for r in runs if not r.recomputed),
        "evaluating": sum(e.seconds for e in evals),
        "redone_in_place": sum(r.seconds for r in runs if r.in_place),
        "redone_reprovisioned": sum(r.seconds for r in runs if r.recomputed and not r.in_place),
        "checkpoint_stalls": sum(float(c.get("blocked_seconds") or 0.0) for c in checkpoints),
        "first_start_up": window(first_start, first_start + startup) if startup else 0.0,
        "reprovisioned_start_ups": later_start_ups,
        "in_place_restarts": restarts,
    }
    lines["other"] = billed_seconds - sum(lines.values())
    return {key: lines[key] for key in GOODPUT_LINES}


def _by_attempt(runs: list[StepRun]) -> dict[int, list[StepRun]]:
    """The step runs of each attempt, oldest first (as `runs` is)."""
    grouped: dict[int, list[StepRun]] = {}
    for r in runs:
        grouped.setdefault(r.attempt, []).append(r)
    return grouped


def _startup_seconds(attempts: list[AttemptCost], runs_of: dict[int, list[StepRun]]) -> float:
    """Billing start to the first step's start, in the first attempt that ran a step."""
    for attempt in attempts:
        mine = runs_of.get(attempt.attempt)
        if mine:
            first = min(mine, key=lambda r: r.ts)
            return min(attempt.seconds, max(0.0, first.ts - first.seconds - attempt.start))
    return attempts[0].seconds if attempts else 0.0


def _wind_down_seconds(attempts: list[AttemptCost], runs_of: dict[int, list[StepRun]]) -> float:
    """The last step's end to the end of the last attempt, for a run that completed."""
    if not attempts or attempts[-1].end_reason != "complete":
        return 0.0
    last = attempts[-1]
    mine = [r.ts for r in runs_of.get(last.attempt, [])]
    return max(0.0, last.end - max(mine)) if mine else 0.0


def _interval_plans(events: list[dict]) -> list[dict]:
    plans = []
    for e in events:
        if e.get("type") != T.INTERVAL_PLAN or not isinstance(e.get("every_seconds"), (int, float)):
            continue
        inputs = e.get("inputs") if isinstance(e.get("inputs"), Mapping) else {}
        plans.append(
            {
                "attempt": e.get("attempt"),
                "every_seconds": float(e["every_seconds"]),
                "bound": inputs.get("bound"),
                "reason": e.get("reason"),
                "mtbp_s": inputs.get("mtbp_s"),
                "blocking_cost_s": inputs.get("blocking_cost_s"),
            }
        )
    return plans


def cost_so_far(log: EventLog, now: Optional[float] = None, store: Optional[str] = None) -> float:
    """Estimated USD spent so far, the running attempt billed up to `now` (default: the clock), with
    egress when `store` (the run's store URI) is on another cloud than an attempt."""
    return run_cost(log, now=time.time() if now is None else now, store=store).cost_usd


def step_runs(log: EventLog, attempts: Optional[list[Attempt]] = None) -> list[StepRun]:
    """Every step execution, oldest first. A step that ran again later is `recomputed`: only its last run
    counts as useful, since that is the one the final model carries. One that the same attempt ran again,
    after an in-place restart, is also `in_place`. `attempts`: the log's split, when the caller has it."""
    events = sorted(log.events, key=lambda e: e["ts"])
    generation = _generations(events, attempts)
    chosen = _lowest_rank(events, T.STEP, lambda e: (e.get("attempt", 0), generation(e), e.get("step")))
    runs: list[StepRun] = []
    later: dict[int, int] = {}  # step -> the attempt of its next run, walking back from the newest
    # Newest last by attempt, then time: a later attempt's run is the one the model carries, whatever its clock.
    for e in sorted(chosen, key=lambda e: (int(e.get("attempt", 0)), e["ts"]), reverse=True):
        step, attempt = int(e["step"]), int(e.get("attempt", 0))
        again = later.get(step)
        loss = e.get("loss")
        runs.append(
            StepRun(
                attempt=attempt,
                step=step,
                ts=e["ts"],
                seconds=float(e.get("step_seconds") or 0.0),
                recomputed=again is not None,
                in_place=again == attempt,
                generation=generation(e),
                loss=float(loss) if _finite(loss) else None,
                diverged=isinstance(loss, float) and not _finite(loss),
            )
        )
        later[step] = attempt
    return sorted(runs, key=lambda r: r.ts)


def eval_runs(log: EventLog, attempts: Optional[list[Attempt]] = None) -> list[EvalRun]:
    """Every evaluation, oldest first (one per step and set of processes, the lowest rank's when several
    ranks record it); `redone` when the same step was evaluated again later."""
    events = sorted(log.events, key=lambda e: e["ts"])
    attempts = split(events) if attempts is None else attempts  # once, for the generations and the spans below
    generation = _generations(events, attempts)
    # One rank's evaluations per step and set of processes (if every rank records them), each once (a line read
    # from two copies of a file is one); the same step evaluated twice by one set (periodic, then final) is two.
    groups: dict[tuple, list[dict]] = {}
    for e in events:
        if e["type"] == T.EVAL:
            groups.setdefault((e.get("attempt", 0), generation(e), e.get("step")), []).append(e)
    chosen = []
    for group in groups.values():
        rank = min((e.get("rank") if e.get("rank") is not None else -1) for e in group)
        chosen += {e["ts"]: e for e in group if (e.get("rank") if e.get("rank") is not None else -1) == rank}.values()
    chosen.sort(key=lambda e: e["ts"])
    spans = {a.number: a.end - a.start for a in attempts}
    seen: set = set()
    runs: list[EvalRun] = []
    for e in reversed(chosen):
        step = e.get("step")
        seconds, loss, perplexity = e.get("seconds"), e.get("loss"), e.get("perplexity")
        # No evaluation outlasts its attempt: a longer figure is damage, and would swamp every sum.
        believable = _finite(seconds) and 0 < seconds <= spans.get(e.get("attempt", 0), math.inf)
        runs.append(
            EvalRun(
                attempt=int(e.get("attempt", 0)),
                step=step,
                ts=e["ts"],
                seconds=float(seconds) if believable else 0.0,
                loss=float(loss) if _finite(loss) else None,
                perplexity=float(perplexity) if _finite(perplexity) else None,
                redone=step is not None and step in seen,
            )
        )
        seen.add(step)
    return runs[::-1]


def _generations(events: list[dict], attempts: Optional[list[Attempt]]):
    """event -> which set of its attempt's processes wrote it (0 unless restarted in place)."""
    by_number = {a.number: a for a in (attempts if attempts is not None else split(events))}

    def generation(e: dict) -> int:
        a = by_number.get(e.get("attempt", 0))
        return a.generation(e["ts"]) if a is not None else 0

    return generation


def _in_place(attempt: Attempt, runs: list[StepRun]) -> list[InPlaceRecovery]:
    """The attempt's in-place restarts, from its `restart_in_place` events; the steps each one redid from
    the step events (the replaced processes' runs that the new ones ran again). `runs`: the attempt's own."""
    details = []
    hangs = {attempt.generation(h["ts"]): h for h in attempt.hangs}
    for e in attempt.restarts:
        failed_at, seconds = e.get("failed_at"), e.get("seconds_to_next_step")
        # Inside the attempt, or damage: a failure before it started, a recovery longer than it ran.
        failed_at = float(failed_at) if _finite(failed_at) and attempt.start <= failed_at <= e["ts"] else None
        seconds = float(seconds) if _finite(seconds) and 0 <= seconds <= e["ts"] - attempt.start else None
        new = attempt.generation(e["ts"])
        old = attempt.generation(failed_at) if failed_at is not None else new - 1
        lost = [r for r in runs if r.in_place and old <= r.generation < new]
        cause = e.get("cause") if isinstance(e.get("cause"), str) else None
        hang = hangs.get(old)
        details.append(
            InPlaceRecovery(
                attempt=attempt.number,
                restart=_int(e.get("restart")),
                cause=cause,
                failed_at=failed_at,
                first_step_at=failed_at + seconds if failed_at is not None and seconds is not None else None,
                seconds_to_next_step=seconds,
                resumed_step=_int(e.get("step")),
                steps_redone=_int(e.get("steps_redone")),
                lost_steps=len(lost),
                lost_seconds=sum(r.seconds for r in lost),
                hang=_hang_record(hang) if hang is not None else None,
            )
        )
    return details


def _hang_record(e: dict) -> dict:
    ranks = e.get("ranks") if isinstance(e.get("ranks"), list) else []
    return {
        "step": _int(e.get("step")),
        "node_rank": _int(e.get("node_rank")),
        "seconds_without_step": e.get("seconds_without_step") if _finite(e.get("seconds_without_step")) else None,
        "bound_seconds": e.get("bound_seconds") if _finite(e.get("bound_seconds")) else None,
        "stacks": e.get("stacks") if isinstance(e.get("stacks"), str) else None,
        "ranks": [
            {"rank": _int(r.get("rank")), "top": r.get("top") if isinstance(r.get("top"), str) else None}
            for r in ranks
            if isinstance(r, Mapping)
        ],
    }


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# --- attempts ----------------------------------------------------------------------------


def _attempt_cost(
    split_attempt: Attempt,
    *,
    queue_record,
    warnings: list[str],
    price: Callable[..., pricing.Price] = pricing.hourly_price,
) -> AttemptCost:
    number, events = split_attempt.number, split_attempt.events
    trainer_starts = [e for e in events if e["type"] == T.START]
    where = dict(split_attempt.where)
    if queue_record is not None:  # its placement as the executor parsed it (executors/sky/sdk.py placed)
        for key, value in (_get(queue_record, "where") or {}).items():
            if where.get(key) in (None, "", UNKNOWN):
                where[key] = value

    start, end, reason = split_attempt.start, split_attempt.end, split_attempt.reason
    cause, cloud_cause = split_attempt.cause, split_attempt.cloud_cause
    if split_attempt.open and queue_record is not None and _get(queue_record, "end_at"):
        end = float(_get(queue_record, "end_at"))
        # SkyPilot's status read once, by statuses.RunStatus.from_sky: an unlisted FAILED_* is FAILED, an error.
        status = _get(queue_record, "status") or ""
        reason = end_of_status(status)
        cause, cloud_cause = cause_of(split_attempt, reason=reason, queue_status=status)

    nodes = int(where.get("num_nodes") or len({e.get("node_rank") for e in trainer_starts}) or 1)
    spot = is_spot(where)
    seconds = max(0.0, end - start)
    billed_hours = seconds / 3600 * nodes
    accelerator, count = _accelerator(where.get("accelerators"))
    found = None
    try:
        found = price(
            where.get("cloud") or "",
            instance_type=_known(where.get("instance_type")),
            accelerator=accelerator,
            accelerator_count=count,
            region=_known(where.get("region")),
            # AWS: the zone ID (use1-az4) the price data lists, when the node read it
            zone=_known(where.get("zone_id")) or _known(where.get("zone")),
            spot=spot,
        )
    except UsageError as missing:
        warnings.append(f"attempt {number}: {missing}")
    fabrics = _one_per_key(events, T.FABRIC, ("node_rank",))
    transports = sorted({str(e.get("transport")) for e in fabrics if e.get("transport")})
    for e in fabrics:
        if e.get("warning"):
            warnings.append(f"attempt {number}, node {e.get('node_rank')}: {e['warning']}")
            break
    return AttemptCost(
        attempt=number,
        cloud=str(where["cloud"]).lower() if where.get("cloud") else None,
        region=where.get("region"),
        zone=where.get("zone"),
        instance_type=_known(where.get("instance_type")) or (found.instance_type if found else None),
        nodes=nodes,
        spot=spot,
        start=start,
        end=end,
        end_reason=reason,
        seconds=seconds,
        billed_hours=billed_hours,
        usd_per_hour=found.usd_per_hour if found else None,
        cost_usd=billed_hours * found.usd_per_hour if found else None,
        price_source=found.source if found else None,
        price_date=found.source_date if found else None,
        price_detail=found.detail if found else None,
        simulated=is_simulated(where),
        compute_usd=billed_hours * found.usd_per_hour if found else None,
        cause=cause,
        cloud_cause=cloud_cause,
        transport=", ".join(transports) or None,
        fabric=summarize_fabric(fabrics),
    )


def _prices() -> Callable[..., pricing.Price]:
    """pricing.hourly_price, asked once per distinct question for one report: 20,000 attempts on one instance
    type read the price tables once, not 20,000 times (1.3 ms each; issue 31, item 9)."""
    asked: dict[tuple, Any] = {}

    def price(cloud: str, **ask: Any) -> pricing.Price:
        key = (cloud, *sorted(ask.items()))
        if key not in asked:
            try:
                asked[key] = pricing.hourly_price(cloud, **ask)
            except UsageError as missing:
                asked[key] = missing
        found = asked[key]
        if isinstance(found, UsageError):
            raise found.with_traceback(None)
        return found  # type: ignore[no-any-return]

    return price


def _known(value: Any) -> Optional[str]:
    """A `where` value, or None for an empty one or the trainer's "unknown"."""
    return None if value in (None, "", UNKNOWN) else str(value)


# --- egress ------------------------------------------------------------------------------


def _store_cloud(store: Optional[str], warnings: list[str]) -> Optional[str]:
    try:
        return pricing.store_cloud(store)
    except UsageError as bad:
        warnings.append(f"egress not counted: {bad}")
        return None


def _add_egress(attempt: AttemptCost, events: list[dict], home: Optional[str], warnings: list[str]) -> None:
    """Charge the attempt for the checkpoint bytes it sent to, and pulled back from, a store on another cloud.

    Uploads: `bytes` of every `upload_end` (each node's uploader writes one per checkpoint; abandoned
    and failed uploads count what they sent). Downloads: `bytes` of a `resume` whose `source` is
    `store`. The trainer writes `resume` on global rank 0 only, with node 0's part of the checkpoint:
    what the other nodes fetched is not in the events, so for several nodes this is a floor.
    """
    if home in (None, attempt.cloud):  # no cloud store, or the attempt ran on its cloud
        return
    up = sum(_bytes(e) for e in _distinct(events, T.UPLOAD_END, ("node", "node_rank", "step")))
    resumes = [e for e in _distinct(events, T.RESUME, ()) if str(e.get("source") or "").lower() == "store"]
    down = sum(_bytes(e) for e in resumes)
    if not up and not down:
        return
    if attempt.cloud not in pricing.CLOUDS:
        warnings.append(
            f"attempt {attempt.attempt}: {up + down} bytes moved to or from the store on {home}, "
            "but the attempt's cloud is unknown: egress not counted"
        )
        return
    out, back = pricing.egress_price(attempt.cloud), pricing.egress_price(home)
    attempt.egress_upload_bytes, attempt.egress_download_bytes = up, down
    attempt.egress_usd = out.cost(up) + back.cost(down)
    attempt.egress_detail = (
        f"{up / 1e9:,.3f} GB up out of {attempt.cloud} at ${out.usd_per_unit:g}/{out.unit} + "
        f"{down / 1e9:,.3f} GB down out of {home} at ${back.usd_per_unit:g}/{back.unit} "
        f"(published internet egress, {out.as_of})"
    )
    if attempt.compute_usd is not None:
        attempt.cost_usd = attempt.compute_usd + attempt.egress_usd
    if resumes and attempt.nodes > 1:
        warnings.append(
            f"attempt {attempt.attempt}: resume downloads count node 0's part only; the events do "
            f"not record what the other {attempt.nodes - 1} node(s) fetched from the store"
        )


def _distinct(events: list[dict], type: T, keys: tuple[str, ...]) -> list[dict]:
    """Events of `type`, each once: the same line read from two copies of an event file counts once."""
    seen: dict[tuple, dict] = {}
    for e in events:
        if e["type"] == type:
            seen.setdefault((e["ts"], e.get("rank"), *(repr(e.get(k)) for k in keys)), e)
    return list(seen.values())


def _bytes(event: dict) -> int:
    value = event.get("bytes")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return 0
    return int(value)


def _recovery(
    prev: AttemptCost, nxt: AttemptCost, prev_split: Attempt, next_split: Attempt, runs: list[StepRun]
) -> Recovery:
    prev_events, next_events = prev_split.events, next_split.events
    notice_at = prev_split.notice_at
    checkpoints = [e["ts"] for e in prev_events if e["type"] == T.EMERGENCY_CHECKPOINT]
    checkpoint_at = max(checkpoints) if checkpoints else None
    exits = [e["ts"] for e in prev_events if e["type"] == T.EXIT]
    exit_at = max(exits) if exits else prev.end
    # The new attempt's first processes: a resume after one of its in-place restarts is that restart's.
    resumes = [e for e in next_events if e["type"] == T.RESUME and next_split.generation(e["ts"]) == 0]
    restored_at = max(e["ts"] for e in resumes) if resumes else None
    resume = min(resumes, key=lambda e: (e.get("rank") is None, e.get("rank") or 0)) if resumes else None
    after = restored_at if restored_at is not None else nxt.start
    first_steps = [e["ts"] for e in next_events if e["type"] == T.STEP and e["ts"] >= after]
    first_step_at = min(first_steps) if first_steps else None
    lost = [r for r in runs if r.attempt == prev.attempt and r.recomputed and not r.in_place]
    return Recovery(
        from_attempt=prev.attempt,
        to_attempt=nxt.attempt,
        cause=prev.end_reason,
        notice_at=notice_at,
        checkpoint_at=checkpoint_at,
        exit_at=exit_at,
        start_at=nxt.start,
        restored_at=restored_at,
        first_step_at=first_step_at,
        notice_to_checkpoint_seconds=_gap(notice_at, checkpoint_at),
        checkpoint_to_exit_seconds=_gap(checkpoint_at, exit_at),
        notice_to_exit_seconds=_gap(notice_at, exit_at),
        exit_to_start_seconds=nxt.start - exit_at,
        start_to_restore_seconds=_gap(nxt.start, restored_at),
        restore_to_first_step_seconds=_gap(restored_at, first_step_at),
        total_seconds=_gap(notice_at if notice_at is not None else exit_at, first_step_at),
        emergency_checkpoint=checkpoint_at is not None,
        restored_step=int(resume["step"]) if resume and resume.get("step") is not None else None,
        load_seconds=float(resume["load_seconds"]) if resume and resume.get("load_seconds") is not None else None,
        lost_steps=len(lost),
        lost_seconds=sum(r.seconds for r in lost),
        interruption_cause=prev.cause,
        cloud_cause=prev.cloud_cause,
    )


def _baseline(
    candidates: Optional[Iterable[Any]],
    attempts: list[AttemptCost],
    warnings: list[str],
    price: Callable[..., pricing.Price] = pricing.hourly_price,
) -> Optional[pricing.Price]:
    """The cheapest on-demand hourly price among the candidates (or the attempts' own instances)."""
    if candidates is not None:
        asks = [_candidate(c) for c in candidates]
    else:
        asks = [(a.cloud, a.instance_type, None, None, a.region) for a in attempts if a.cloud and a.instance_type]
    prices = []
    for cloud, instance_type, accelerator, count, region in asks:
        try:
            prices.append(
                price(
                    cloud,
                    instance_type=instance_type,
                    accelerator=accelerator,
                    accelerator_count=count,
                    region=region,
                    spot=False,
                )
            )
        except UsageError as missing:
            warnings.append(f"baseline: {missing}")
    return min(prices, key=lambda p: p.usd_per_hour, default=None)


def _candidate(c: Any) -> tuple:
    """(cloud, instance_type, accelerator, count, region) from a tuple, a dict or a plan.Candidate."""
    if isinstance(c, (tuple, list)):
        cloud, name, count, region = (list(c) + [None] * 4)[:4]
        c = {"cloud": cloud, "name": name, "count": count, "region": region}
    get = (lambda k: c.get(k)) if isinstance(c, Mapping) else (lambda k: getattr(c, k, None))
    cloud, region = get("cloud"), get("region")
    instance_type = get("instance_type")
    accelerator, count = _accelerator(get("accelerators"))
    accelerator = get("accelerator") or accelerator
    count = get("accelerator_count") or get("count") or count
    name = get("name")
    if name and not instance_type and not accelerator:
        # A bare name is an accelerator ("H100") if some instance carries `count` of it, else an instance type.
        if count and _is_accelerator(cloud, name, count):
            accelerator = name
        else:
            instance_type = name
    return cloud, instance_type, accelerator, count, region


def _is_accelerator(cloud: Any, name: str, count: Any) -> bool:
    try:
        pricing.instance_for(cloud, name, count)
    except UsageError:
        return False
    return True


# --- helpers -----------------------------------------------------------------------------


def _one_per_key(events: list[dict], type: T, keys: tuple[str, ...]) -> list[dict]:
    """One event per (attempt, *keys), the lowest rank's: every rank may log the same step."""
    return _lowest_rank(events, type, lambda e: (e.get("attempt", 0), *(e.get(k) for k in keys)))


def _lowest_rank(events: list[dict], type: T, key_of) -> list[dict]:
    """One event of `type` per key_of(event), the lowest rank's, oldest first."""
    chosen: dict[tuple, dict] = {}
    for e in events:
        if e["type"] != type:
            continue
        key = key_of(e)
        rank = e.get("rank") if e.get("rank") is not None else -1
        held = chosen.get(key)
        if held is None or rank < (held.get("rank") if held.get("rank") is not None else -1):
            chosen[key] = e
    return sorted(chosen.values(), key=lambda e: e["ts"])


def _gap(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else b - a


def _accelerator(value: Any) -> tuple[Optional[str], Optional[int]]:
    """{"H100": 8} or "H100:8" -> ("H100", 8)."""
    if isinstance(value, Mapping) and value:
        name, count = next(iter(value.items()))
        return str(name), int(float(count))
    if isinstance(value, str) and value:
        name, _, count = value.partition(":")
        return name, int(float(count or 1))
    return None, None


def _get(record: Any, key: str) -> Any:
    return record.get(key) if isinstance(record, Mapping) else getattr(record, key, None)
