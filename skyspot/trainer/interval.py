"""`checkpoint.every_seconds: auto`: the interval, planned at start and re-planned as the run learns.

One concept, the checkpoint interval, in three layers read bottom-up: Young's and Daly's optimum and
the bounds around it (`plan_interval`), what the run's events say about its inputs (blocking cost,
upload time, the mean time between preemptions: `plan_from_events`), and the planner the loop asks
(`IntervalPlanner`). docs/planning.md derives every formula. `initial_plan` is also what the CLI's
plan (skyspot/planning/candidates.py) counts checkpoints with, the trainer's one public planning answer.

Global rank 0 owns the interval (it alone decides `time_due`, which the step vote shares). The
plan is `plan_from_events` over the run's own history:

    C  blocking cost of one checkpoint   the median observed `blocked_seconds`, else the estimate
                                         (state bytes / write bandwidth, `initial_plan`)
    U  upload time                       the median observed durable upload, else the estimate
    M  mean time between preemptions    the prior (checkpoint.mtbp_prior_seconds, else skyspot's
                                         per cloud and accelerator prior) until two preemptions
                                         are seen, then the Gamma-posterior blend with the
                                         observed exposure (`mtbp_from_events`)

History: the events of earlier attempts in the run directory (the local executor shares it), else
the store's copy of them (a fresh node on a cloud), then this attempt's as they are written
(EventTail, incremental). The planner re-plans at start and after each committed checkpoint;
every change beyond 10 % is logged as an `interval_plan` event with its inputs and the reason,
and the cost report shows the plans a run used.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Mapping, Optional, Union

from skyspot.attempts import NOTICE_TYPES, split
from skyspot import clouds
from skyspot.clouds import GB, bandwidth_for, mtbp_prior
from skyspot.events import EventLog, EventTail
from skyspot.events import CheckpointKind
from skyspot.events import EventType as T
from skyspot.sizing import state_bytes

if TYPE_CHECKING:  # the recipe module pulls in pydantic; callers already have a Recipe
    from skyspot.recipe import Recipe

# =========================================================================== interval policy

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
        return {
            "blocking_cost_s": self.blocking_cost_s,
            "mtbp_s": _finite(self.mtbp_s),
            "upload_s": self.upload_s,
            "max_staleness_s": self.max_staleness_s,
            "daly_s": _finite(self.daly_s),
            "young_s": _finite(self.young_s),
            "lower_s": self.lower_s,
            "upper_s": self.upper_s,
            "bound": self.bound,
            "conflict": self.conflict,
            "expected_overhead": self.expected_overhead,
            "sources": dict(self.sources),
        }

    def event_fields(self) -> dict[str, Any]:
        """Fields of an `interval_plan` event (events.EVENT_TYPES): every_seconds and inputs."""
        return {"every_seconds": self.every_seconds, "inputs": self.inputs}

    def to_dict(self) -> dict[str, Any]:
        return {"every_seconds": self.every_seconds, **self.inputs, "note": self.note}


def _finite(value: float) -> Optional[float]:
    return value if math.isfinite(value) else None


def plan_interval(
    blocking_cost_s: float,
    mtbp_s: float,
    upload_s: float,
    max_staleness_s: Optional[float] = None,
    *,
    min_interval_s: float = MIN_INTERVAL_S,
    max_interval_s: float = MAX_INTERVAL_S,
    sources: Optional[Mapping[str, str]] = None,
) -> IntervalPlan:
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
            note = (
                f"max staleness {max_staleness_s:g} s cannot be met: the durable copy is at best "
                f"{lower + blocking_cost_s + upload_s:.0f} s old ({lower:.0f} s interval + "
                f"{blocking_cost_s:.0f} s blocking + {upload_s:.0f} s upload)"
            )
        else:
            note = f"an upload takes {upload_s:.0f} s, longer than the {max_interval_s:.0f} s cap on the interval"
    elif daly < lower:
        every, bound = lower, lower_bound
    elif daly > upper:
        every, bound = upper, upper_bound
    else:
        every, bound = daly, "daly"
    return IntervalPlan(
        every_seconds=float(every),
        bound=bound,
        daly_s=daly,
        young_s=young,
        lower_s=float(lower),
        upper_s=float(upper),
        blocking_cost_s=float(blocking_cost_s),
        mtbp_s=float(mtbp_s),
        upload_s=float(upload_s),
        max_staleness_s=max_staleness_s,
        conflict=conflict,
        expected_overhead=_overhead(every, blocking_cost_s, mtbp_s),
        note=note,
        sources=dict(sources or {}),
    )


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


def _events(log: Union[EventLog, Iterable[Mapping[str, Any]]]) -> list[Mapping[str, Any]]:
    events = log.events if isinstance(log, EventLog) else list(log)
    return sorted((e for e in events if isinstance(e.get("ts"), (int, float))), key=lambda e: e["ts"])


def attempt_uptimes(
    log: Union[EventLog, Iterable[Mapping[str, Any]]], *, now: Optional[float] = None
) -> list[AttemptUptime]:
    """Per attempt (skyspot/attempts.py `split`): how long it ran before it was preempted (to its first
    notice), or until it ended, or until `now`; whether it was preempted; whether it ran on spot."""
    events = log.events if isinstance(log, EventLog) else log
    return [AttemptUptime(a.number, a.uptime_s, a.preempted, a.spot) for a in split(events, now=now)]


def mtbp_from_events(
    log: Union[EventLog, Iterable[Mapping[str, Any]]],
    prior_s: float,
    min_observations: int = 2,
    *,
    prior_weight: float = 1.0,
    now: Optional[float] = None,
) -> MtbpEstimate:
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


def _per_checkpoint(events: list[Mapping[str, Any]], type: str, value: str, keep=lambda e: True) -> list[float]:
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
    values = _per_checkpoint(
        _events(log),
        T.CHECKPOINT_END,
        "blocked_seconds",
        lambda e: str(e.get("kind", "")).lower() != CheckpointKind.EMERGENCY,
    )
    return statistics.median(values) if values else None


def upload_seconds_from_events(log: Union[EventLog, Iterable[Mapping[str, Any]]]) -> Optional[float]:
    """Median `seconds` of the uploads that made a checkpoint durable (`upload_end` with `durable`), the
    slowest node of each; None before the first one."""
    values = _per_checkpoint(_events(log), T.UPLOAD_END, "seconds", lambda e: e.get("durable") is True)
    return statistics.median(values) if values else None


def plan_from_events(
    log: Union[EventLog, Iterable[Mapping[str, Any]]],
    *,
    prior_s: float,
    blocking_cost_s: float,
    upload_s: float,
    max_staleness_s: Optional[float] = None,
    min_observations: int = 2,
    prior_weight: float = 1.0,
    now: Optional[float] = None,
    min_interval_s: float = MIN_INTERVAL_S,
) -> IntervalPlan:
    """Re-plan from what the run has seen: observed blocking cost, upload time and preemptions, each
    replacing its estimate (`blocking_cost_s`, `upload_s`, `prior_s`) once observed. The plan's
    `sources` say which were used."""
    observed_c = blocking_cost_from_events(log)
    observed_u = upload_seconds_from_events(log)
    mtbp = mtbp_from_events(log, prior_s, min_observations, prior_weight=prior_weight, now=now)
    sources = {
        "blocking_cost_s": "observed median" if observed_c is not None else "estimate",
        "upload_s": "observed median" if observed_u is not None else "estimate",
        "mtbp_s": f"{mtbp.source} ({mtbp.preemptions} preemptions in {mtbp.exposure_s:.0f} s)",
    }
    return plan_interval(
        observed_c if observed_c is not None else blocking_cost_s,
        mtbp.mtbp_s,
        observed_u if observed_u is not None else upload_s,
        max_staleness_s,
        min_interval_s=min_interval_s,
        sources=sources,
    )


def initial_plan(
    recipe: "Recipe",
    cloud: str,
    *,
    bandwidth: Optional[Mapping[str, Mapping[str, float]]] = None,
    environ: Optional[Mapping[str, str]] = None,
    max_staleness_s: Optional[float] = None,
) -> Optional[IntervalPlan]:
    """The plan before any event: blocking cost = the local write, upload time and MTBP from the
    assumptions and priors above. None when the model's size is unknown."""
    state = state_bytes(recipe, environ=environ)
    if state.bytes_per_node is None:
        return None
    bw = bandwidth_for(cloud, disk_size_gb=recipe.resources.disk_size, overrides=bandwidth, environ=environ)
    accelerator = recipe.resources.accelerators[0] if recipe.resources.accelerators else None
    prior = mtbp_prior(cloud, accelerator, recipe.resources.num_nodes)
    return plan_interval(
        state.bytes_per_node / (bw.write_gbps * GB),
        prior.job_s,
        state.bytes_per_node / (bw.upload_gbps * GB),
        max_staleness_s,
        sources={
            "blocking_cost_s": f"estimate: local write ({bw.write_source})",
            "upload_s": f"estimate: upload ({bw.upload_source})",
            "mtbp_s": prior.source,
        },
    )


# =========================================================================== the planner the loop asks

# The event types the planner reads (attempt_uptimes, blocking and upload medians).
_KEPT = {T.ATTEMPT_START, T.START, T.ATTEMPT_END, T.EXIT, *NOTICE_TYPES, T.CHECKPOINT_END, T.UPLOAD_END}
CHANGE = 0.10
DEFAULT_AUTO_SECONDS = 1800.0
FALLBACK_COST_S, FALLBACK_PRIOR_S = 10.0, 6 * 3600.0


class IntervalPlanner:
    def __init__(
        self,
        recipe,
        cloud: Optional[str],
        events_dir: Path,
        *,
        history: Iterable[dict] = (),
        emit: Callable[..., Any],
        say: Callable[[str], None],
    ):
        self.emit, self.say = emit, say
        checkpoint = recipe.checkpoint
        self.min_interval_s = float(checkpoint.min_every_seconds or MIN_INTERVAL_S)
        first = None
        try:
            first = initial_plan(recipe, cloud) if clouds.find(cloud) is not None else None
        except Exception as err:  # planning is advice; never stop training over it
            say(f"checkpoint.every_seconds=auto: no initial estimate ({err}); planning from what the run observes")
        self.cost_s = first.blocking_cost_s if first else FALLBACK_COST_S
        self.upload_s = first.upload_s if first else FALLBACK_COST_S
        self.prior_s = float(checkpoint.mtbp_prior_seconds or (first.mtbp_s if first else FALLBACK_PRIOR_S))
        self.prior_source = (
            "checkpoint.mtbp_prior_seconds"
            if checkpoint.mtbp_prior_seconds
            else (first.sources.get("mtbp_s") if first else "fallback prior (6 h)")
        )
        self._tail = EventTail(events_dir)
        self._kept: list[dict] = []
        self._last_of_attempt: dict[Any, dict] = {}
        self._absorb(list(history))
        self.every_seconds: Optional[float] = None
        self.plans = 0

    def _absorb(self, events: list[dict]) -> None:
        for e in events:
            if e.get("type") in _KEPT:
                self._kept.append(e)
            self._last_of_attempt[e.get("attempt")] = e  # an attempt with no end record ends at its last event

    def replan(self, reason: str) -> float:
        """Read what is new, plan, and log the plan when it moved by more than 10 %. Returns the interval."""
        self._absorb(self._tail.poll())
        seen = {id(e) for e in self._kept}
        log = self._kept + [e for e in self._last_of_attempt.values() if id(e) not in seen]
        try:
            plan = plan_from_events(
                log,
                prior_s=self.prior_s,
                blocking_cost_s=self.cost_s,
                upload_s=self.upload_s,
                min_interval_s=self.min_interval_s,
            )
        except (ValueError, ArithmeticError) as err:
            if self.every_seconds is None:
                self.every_seconds = DEFAULT_AUTO_SECONDS
                self.say(f"checkpoint.every_seconds=auto: no plan ({err}); using {DEFAULT_AUTO_SECONDS:.0f} s")
            return self.every_seconds
        previous = self.every_seconds
        if previous is not None and abs(plan.every_seconds - previous) <= CHANGE * previous:
            return previous
        self.every_seconds = plan.every_seconds
        self.plans += 1
        fields = plan.event_fields()
        fields["inputs"]["sources"].setdefault("prior", self.prior_source)
        self.emit("interval_plan", **fields, reason=reason, previous_seconds=previous)
        src = plan.sources
        self.say(
            f"checkpoint interval {plan.every_seconds:.0f} s ({reason}; {plan.bound}: C {plan.blocking_cost_s:.2f} s "
            f"[{src.get('blocking_cost_s')}], M {plan.mtbp_s:.0f} s [{src.get('mtbp_s')}], "
            f"upload {plan.upload_s:.1f} s)" + (f", was {previous:.0f} s" if previous is not None else "")
        )
        return self.every_seconds
