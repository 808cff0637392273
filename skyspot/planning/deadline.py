"""Deadlines: finish a run by a given time at the least cost (docs/deadline.md).

One concept despite its length: the policy, what it is fed (`measure`), the simulator that replays it
and the check and rows built on it must change together, since the simulator and the comparisons are
only worth anything while they run the very decisions the controllers run.

    skyspot launch RECIPE --deadline 36h        # or an ISO time, or resources.deadline in the recipe

Plain functions and no I/O, so the same code decides in the local executor, in the controller
that runs on SkyPilot, in the simulator, in the launch-time feasibility check and in tests:

- `parse_deadline` (from skyspot/deadline_text.py, the text's contract): `36h`, `90m`, `2d`, `1h30m`, or an
  ISO 8601 time -> unix seconds;
- `decide`: one policy decision from a `State` (where the run is) and `Estimates` (how fast it
  goes, what a restart costs), as a `Decision` (spot, on-demand, or idle waiting for spot);
- `measure`: the estimates from a run's events (measured step time per placement, restart
  overhead), a recipe hint and a prior until there are measurements;
- `simulate`: replay a spot trace (executors/local/spot_trace.py) against a policy, for a `Job`;
- `feasibility`: whether even all on-demand can make the deadline, with the arithmetic (closed form);
- `next_round`: the decision a running deadline makes, for the local controller and SkyPilot's alike.

The policies. `uniform-progress` is Uniform Progress from *Can't Be Late: Optimizing Spot
Instance Savings under Deadlines* (Wu et al., NSDI 2024, sections 3.3 and 5.2): with progress
cp(t) (fraction of steps done) and the straight line ep(t) = (t - start) / (deadline - start),

1. idle (no instance) and cp(t) < ep(t): on-demand, to catch up;
2. spot whenever it is available, even when behind; stay on it until preempted (Exploitation);
3. hysteresis: on on-demand, stay until cp(t) >= ep(t + 2d), d the restart overhead;
4. safety net: once the slack R(t) - C(t) (time left minus on-demand work left) is under 2d,
   on-demand until the end.

`greedy` (the paper's section 3.4, the comparison): spot, or wait for it, until the safety net,
then on-demand to the end. `adaptive` is Uniform Progress that waits for spot as greedy does
while the slack affords fewer than GREEDY_BELOW_RESTARTS restarts: replays of random traces
(docs/deadline.md, `python -m bench --only deadline`) show Uniform Progress ahead of greedy when
restarts are short against the slack, as the paper found, and behind it when they are long,
where catching up on on-demand early buys nothing the safety net would not. `adaptive` is the
default; `resources.deadline_policy` picks another.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Iterable, Optional

# `X as X`: re-exported, callers read them here (mypy's strict run sees explicit re-exports only).
from skyspot.attempts import DECISION_EVENT as DECISION_EVENT, is_spot, split
from skyspot.deadline_text import (
    MAX_AHEAD_SECONDS as MAX_AHEAD_SECONDS,
    DeadlineError as DeadlineError,
    check_deadline_text as check_deadline_text,
    parse_deadline as parse_deadline,
)
from skyspot.events import EventType as T

SPOT, ON_DEMAND, IDLE = "spot", "on-demand", "idle"
# A decision's reason once not even all on-demand from now can make the deadline (docs/deadline.md).
UNREACHABLE = "unreachable"
POLICIES = ("adaptive", "uniform-progress", "greedy")
DEFAULT_POLICY = "adaptive"
# Comparisons only (simulate, cost-report): every step on on-demand from the start.
ALL_ON_DEMAND = "on-demand"

# Can't Be Late, section 3.3 (Safety Net Rule) and 5.2.2 (Hysteresis): both reserve 2 restarts.
SAFETY_RESTARTS = 2
# The safety net also keeps this share of the on-demand work left: step time is measured, and a node
# (or this machine, for the local executor) can slow down after the measurement.
SAFETY_WORK_SHARE = 0.05
HYSTERESIS_RESTARTS = 2
# adaptive: below this many restarts of slack, wait for spot as greedy does (docs/deadline.md has
# the measurements behind the number).
GREEDY_BELOW_RESTARTS = 12

# Before anything is measured on a cloud: VM provisioning plus setup plus restore. Can't Be Late
# measured 0.2-0.3 h for theirs (Table 4: provisioning, environment setup and progress loss).
CLOUD_RESTART_PRIOR_SECONDS = 900.0
# The local executor knows its provisioning delay; on top, before it has measured one: torchrun,
# imports, DeepSpeed's start and a resume take about this long for `tiny` on 2 cores.
LOCAL_START_PRIOR_SECONDS = 30.0


def when(ts: Optional[float]) -> str:
    """A unix time as this machine's local time with its offset, to the second."""
    moment = _moment(ts)
    return "-" if moment is None else moment.astimezone().isoformat(timespec="seconds")


def clock(ts: Optional[float]) -> str:
    """A unix time as `HH:MM:SS` local time, with the date in front when it is not today."""
    moment = _moment(ts)
    if moment is None:
        return "-"
    return moment.strftime("%H:%M:%S" if moment.date() == datetime.now().date() else "%Y-%m-%d %H:%M")


def _moment(ts: Optional[float]) -> Optional[datetime]:
    """A unix time as a local datetime; None where there is none to show (unknown, or a projected
    finish past the calendar's end: 10**12 steps of 10**12 s)."""
    if ts is None or not math.isfinite(ts):
        return None
    try:
        return datetime.fromtimestamp(ts)
    except (ValueError, OverflowError, OSError):
        return None


def span(seconds: Optional[float]) -> str:
    """Seconds as `2h05m`, `3m20s` or `12.5s`."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    sign, seconds = ("-" if seconds < 0 else ""), abs(seconds)
    if seconds < 60:
        return f"{sign}{seconds:.1f}s"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{sign}{hours}h{minutes:02d}m" if hours else f"{sign}{minutes}m{secs:02d}s"


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Estimates:
    """How fast the run goes and what a restart costs, each with where the figure came from."""

    step_seconds: dict[str, Optional[float]]
    """Seconds per optimizer step by placement (`spot`, `on-demand`); None where nothing is known."""
    restart_seconds: float
    """d: billed time without progress per changeover (provisioning, start-up, wind-down, lost work)."""
    restart_seconds_max: float
    """The worst changeover seen (or the prior): what the safety net reserves."""
    sources: dict[str, str] = field(default_factory=dict)

    def step(self, mode: str) -> Optional[float]:
        """Seconds per step on `mode`; the other placement's figure (same hardware) when unmeasured."""
        mine = self.step_seconds.get(mode)
        if mine:
            return mine
        other = self.step_seconds.get(ON_DEMAND if mode == SPOT else SPOT)
        return other or None


@dataclass(frozen=True)
class State:
    """Where the run stands at a decision point (all times unix seconds, or all since launch)."""

    now: float
    start: float
    """Where the straight line to the deadline starts: the launch."""
    deadline: float
    total_steps: int
    done_steps: int
    mode: str
    """What holds the run now: `spot`, `on-demand`, or `idle` (nothing; waiting for spot)."""
    spot_available: Optional[bool] = None
    """Idle only: False while a spot request waits for capacity, True once granted, None if not tried."""
    committed: bool = False
    """The safety net fired earlier: on-demand until the end."""
    margin: float = 0.0
    """Seconds that may pass between two decisions: the safety net reserves them too."""
    overhead_left: float = 0.0
    """Seconds before `mode` makes progress again: the rest of a changeover under way (the node still being
    prepared or provisioned, the trainer not at its first step yet). Time spent there passes without
    progress, so the projections count it from now; 0 once the run steps."""


@dataclass(frozen=True)
class Decision:
    mode: str
    reason: str
    """A short code: start, spot, exploit, wait, behind, hysteresis, ahead, safety-net, done."""
    why: str
    """The reason in words, for logs."""
    progress: float
    expected: float
    slack_seconds: Optional[float]
    """Time left minus the on-demand work left; None until a step time is known."""
    projected_finish: Optional[float]
    committed: bool
    policy: str

    def event_fields(self, state: State, estimates: Estimates) -> dict[str, Any]:
        """The fields of a `deadline_decision` event."""
        return {
            "policy": self.policy,
            "mode": self.mode,
            "reason": self.reason,
            "why": self.why,
            "progress": round(self.progress, 6),
            "expected": round(self.expected, 6),
            "step": state.done_steps,
            "total_steps": state.total_steps,
            "slack_seconds": _round(self.slack_seconds),
            "projected_finish": _round(self.projected_finish),
            "deadline": state.deadline,
            "committed": self.committed,
            "from_mode": state.mode,
            "spot_available": state.spot_available,
            **({"overhead_left": _round(state.overhead_left)} if state.overhead_left else {}),
            "estimates": {
                "step_seconds": {k: _round(v) for k, v in estimates.step_seconds.items()},
                "restart_seconds": _round(estimates.restart_seconds),
                "restart_seconds_max": _round(estimates.restart_seconds_max),
                "sources": dict(estimates.sources),
            },
        }


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None or not math.isfinite(value) else round(value, 3)


# --------------------------------------------------------------------------- the policies


def expected_progress(state: State, at: float) -> float:
    """ep(t): the straight line from nothing at `start` to everything at `deadline`."""
    length = state.deadline - state.start
    if length <= 0:
        return 1.0
    return min(1.0, max(0.0, (at - state.start) / length))


def decide(policy: str, state: State, estimates: Estimates) -> Decision:
    """The next placement under `policy` (one of POLICIES, or ALL_ON_DEMAND)."""
    if policy not in POLICIES and policy != ALL_ON_DEMAND:
        raise DeadlineError(f"unknown deadline policy '{policy}' (known: {', '.join(POLICIES)})")
    total = max(1, state.total_steps)
    left = max(0, state.total_steps - state.done_steps)
    cp, ep = state.done_steps / total, expected_progress(state, state.now)
    on_demand_step = estimates.step(ON_DEMAND)
    slack = None if on_demand_step is None else (state.deadline - state.now) - left * on_demand_step

    def out(mode: str, reason: str, why: str, *, committed: bool = state.committed) -> Decision:
        return Decision(mode, reason, why, cp, ep, slack, _projected(mode, state, estimates, left), committed, policy)

    if left == 0:
        return out(IDLE, "done", "every step is done")
    if policy == ALL_ON_DEMAND:
        return out(ON_DEMAND, "on-demand", "all on-demand (comparison)")
    soonest = _soonest_finish(state, estimates, left)
    if state.now >= state.deadline or (soonest is not None and soonest > state.deadline):
        # The deadline is gone: what is left is to finish as soon as possible, and the one placement
        # whose finish holds is on-demand (never preempted). Said in every decision from here on.
        late = f"{span(soonest - state.deadline)} late" if soonest is not None else "step time unknown"
        return out(
            ON_DEMAND,
            UNREACHABLE,
            f"the deadline {when(state.deadline)} cannot be met any more (the "
            f"soonest finish is {when(soonest)}, {late}): on-demand until the end, to finish as soon as it can",
            committed=True,
        )
    if state.committed:
        return out(ON_DEMAND, "safety-net", "committed to on-demand until the end")
    reserve = _reserve(state, estimates, left)
    if slack is not None and slack < reserve:
        return out(
            ON_DEMAND,
            "safety-net",
            f"slack {span(slack)} is under {span(reserve)} "
            f"({'one restart' if state.mode == SPOT else f'{SAFETY_RESTARTS} restarts'}, decision interval, "
            f"{100 * SAFETY_WORK_SHARE:.0f}% of the work left): on-demand until the end",
            committed=True,
        )
    if state.mode == SPOT:
        return out(SPOT, "exploit", "on spot: stay until preempted")
    if policy == "greedy":
        if state.spot_available is False:
            return out(IDLE, "wait", "no spot capacity: wait for it while the slack lasts")
        return out(SPOT, "spot", "spot first")

    # adaptive: while the slack affords fewer than GREEDY_BELOW_RESTARTS restarts, catching up on
    # on-demand early buys nothing the safety net would not: wait for spot as greedy does.
    few = policy == "adaptive" and slack is not None and slack < GREEDY_BELOW_RESTARTS * estimates.restart_seconds
    if state.mode == ON_DEMAND:
        ahead_at = state.now + HYSTERESIS_RESTARTS * estimates.restart_seconds
        if cp < expected_progress(state, ahead_at):
            return out(ON_DEMAND, "hysteresis", f"on on-demand until {HYSTERESIS_RESTARTS} restarts ahead of the line")
        if state.spot_available is False:
            return out(IDLE, "ahead", "ahead of the line: release on-demand, wait for spot")
        return out(SPOT, "ahead", "ahead of the line: back to spot")
    # Idle: nothing holds the run.
    if state.spot_available is not False:
        return out(SPOT, "spot" if state.spot_available else "start", "spot first (even when behind)")
    if few:
        return out(
            IDLE,
            "wait",
            f"slack {span(slack)} affords under {GREEDY_BELOW_RESTARTS} restarts: wait for spot until the safety net",
        )
    if cp < ep:
        return out(ON_DEMAND, "behind", f"behind the line ({100 * cp:.1f}% done, {100 * ep:.1f}% due): on-demand")
    return out(IDLE, "wait", f"ahead of the line ({100 * cp:.1f}% done, {100 * ep:.1f}% due): wait for spot")


def _soonest_finish(state: State, estimates: Estimates, left: int) -> Optional[float]:
    """The earliest end any placement gives from now, without a preemption: stay where the run is,
    or change over (one restart) to the other; None while no step time is known."""
    ends = []
    for mode in (SPOT, ON_DEMAND):
        step = estimates.step(mode)
        if step is not None:
            ends.append(
                state.now + (state.overhead_left if mode == state.mode else estimates.restart_seconds) + left * step
            )
    return min(ends) if ends else None


def _reserve(state: State, estimates: Estimates, left: int) -> float:
    """The slack the safety net keeps. Off spot a return trip costs two changeovers; on spot one (the
    switch to on-demand) is enough, and covers a spot that runs slower than on-demand (fewer nodes),
    which eats slack as it goes. Changeovers at their worst seen (never below the prior)."""
    d = estimates.restart_seconds_max
    work = left * (estimates.step(ON_DEMAND) or 0.0)
    return (d if state.mode == SPOT else SAFETY_RESTARTS * d) + state.margin + SAFETY_WORK_SHARE * work


def _projected(mode: str, state: State, estimates: Estimates, left: int) -> Optional[float]:
    """When the run ends if `mode` holds from now on without interruption (idle: waiting for spot
    until the safety net would commit, then on-demand)."""
    on_demand = estimates.step(ON_DEMAND)
    if left == 0:
        return state.now
    if mode == IDLE:
        if on_demand is None:
            return None
        reserve = _reserve(replace(state, mode=IDLE), estimates, left)
        return max(
            state.now + estimates.restart_seconds + left * on_demand,
            state.deadline - reserve + estimates.restart_seconds,
        )
    step = estimates.step(mode)
    if step is None:
        return None
    restart = state.overhead_left if mode == state.mode else estimates.restart_seconds
    return state.now + restart + left * step


@dataclass(frozen=True)
class Round:
    """One decision of a running deadline: what it was decided from, and the decision."""

    decision: Decision
    state: State
    estimates: Estimates

    def event_fields(self) -> dict[str, Any]:
        return self.decision.event_fields(self.state, self.estimates)


def estimates_for(
    events: Iterable[dict], plan: dict[str, Any], *, provision_seconds: float, restart_prior: float
) -> Estimates:
    """`measure` on a run's events (its decisions left out) with the priors launch recorded in `plan`."""
    return measure(
        [e for e in events if e.get("type") != DECISION_EVENT],
        provision_seconds=provision_seconds,
        step_seconds_hint=plan.get("step_seconds_hint"),
        restart_prior=restart_prior,
        step_seconds_prior=plan.get("step_seconds_prior"),
    )


def next_round(
    policy: str,
    events: Iterable[dict],
    estimates: Estimates,
    *,
    now: float,
    plan: dict[str, Any],
    total_steps: int,
    mode: str,
    spot_available: Optional[bool],
    committed: bool,
    margin: float,
    overhead_left: float = 0.0,
) -> Round:
    """The decision a running deadline makes, from the run's events, its `estimates_for` them and the
    plan launch recorded (`at`, `start`). The one policy entry point of the local controller
    (executors/local/deadline.py) and of the controller on SkyPilot (executors/sky/deadline.py):
    they differ only in where events come from, how they tell the mode, and what acts. `overhead_left`:
    what is left of a changeover under way (State.overhead_left), so a deadline is judged while a node is
    prepared too, and found unreachable as soon as that is knowable (issue 31, item 12)."""
    state = State(
        now=now,
        start=float(plan["start"]),
        deadline=float(plan["at"]),
        total_steps=total_steps,
        done_steps=progress(e for e in events if e.get("type") != DECISION_EVENT),
        mode=mode,
        spot_available=spot_available,
        committed=committed,
        margin=margin,
        overhead_left=max(0.0, overhead_left),
    )
    return Round(decide(policy, state, estimates), state, estimates)


def news(previous: Optional[Decision], decision: Decision, deadline: float) -> Optional[str]:
    """The log line for a decision that changed the policy's mind (None when it did not): the
    moment a deadline becomes unreachable is one of them, said in capitals."""
    if previous is not None and (previous.mode, previous.reason) == (decision.mode, decision.reason):
        return None
    head = "deadline UNREACHABLE" if decision.reason == UNREACHABLE else "deadline"
    return (
        f"{head}: {decision.mode} ({decision.reason}: {decision.why}); projected finish "
        f"{when(decision.projected_finish)}, deadline {when(deadline)}"
    )


# --------------------------------------------------------------------------- measuring


def measure(
    events: Iterable[dict],
    *,
    provision_seconds: float,
    step_seconds_hint: Optional[float] = None,
    restart_prior: Optional[float] = None,
    step_seconds_prior: Optional[float] = None,
) -> Estimates:
    """The policy's inputs from a run's events.

    - step time per placement: the median `step_seconds` of the lowest rank's steps on spot and
      on on-demand attempts, leaving out each attempt's first step (warm-up); before any step,
      `step_seconds_hint` (the recipe's `resources.step_seconds_hint`), else `step_seconds_prior` (the
      recipe's floor, planning/step_prior.py, which launch recorded);
    - restart overhead d = `provision_seconds` (what the executor knows: the local executor's
      provisioning delay; a prior on a cloud) + start-up (nodes up to the first step) + wind-down
      (last step to the end of an attempt that did not complete) + recomputed steps per restart;
      mean for the line, worst for the safety net; `restart_prior` before any attempt has stepped.
    """
    by_mode: dict[str, list[float]] = {SPOT: [], ON_DEMAND: []}
    startups, wind_downs, lost = [], [], []
    seen_steps: set[int] = set()
    attempts = split(events)
    for i, attempt in enumerate(attempts):
        later = i + 1 < len(attempts)
        lowest: dict[int, tuple[Any, float, float]] = {}  # step -> (rank, ts, seconds) of its lowest rank
        for e in attempt.events:
            if e.get("type") == T.STEP and isinstance(e.get("step"), int):
                held = lowest.get(e["step"])
                rank = e.get("rank") if e.get("rank") is not None else 0
                if held is None or rank < held[0]:
                    lowest[e["step"]] = (rank, e["ts"], float(e.get("step_seconds") or 0.0))
        steps = sorted(lowest.items(), key=lambda kv: kv[1][1])
        mode = SPOT if attempt.spot else ON_DEMAND
        by_mode[mode].extend(s for _, (_, _, s) in steps[1:] if s > 0)
        if len(steps) == 1 and steps[0][1][2] > 0:
            by_mode[mode].append(steps[0][1][2])
        if steps and attempt.started:
            first_ts, first_seconds = steps[0][1][1], steps[0][1][2]
            startups.append(max(0.0, first_ts - first_seconds - attempt.start))
        redo = [s for s, _ in steps if s in seen_steps]
        if redo:
            lost.append(sum(lowest[s][2] for s in redo))
        seen_steps.update(s for s, _ in steps)
        # Killed with its node (no end record, a later attempt): it ended at its last step.
        end = attempt.end if attempt.recorded_end else (steps[-1][1][1] if later and steps else None)
        if steps and end is not None and attempt.reason != "complete" and later:
            wind_downs.append(max(0.0, end - steps[-1][1][1]))

    sources: dict[str, str] = {}
    step_seconds: dict[str, Optional[float]] = {}
    for mode in (SPOT, ON_DEMAND):
        if by_mode[mode]:
            step_seconds[mode] = statistics.median(by_mode[mode])
            sources[f"step_seconds.{mode}"] = f"measured ({len(by_mode[mode])} steps)"
        else:
            step_seconds[mode] = None
    if not any(step_seconds.values()) and step_seconds_hint:
        step_seconds = {SPOT: step_seconds_hint, ON_DEMAND: step_seconds_hint}
        sources["step_seconds"] = "hint (resources.step_seconds_hint)"
    elif not any(step_seconds.values()) and step_seconds_prior:
        step_seconds = {SPOT: step_seconds_prior, ON_DEMAND: step_seconds_prior}
        sources["step_seconds"] = "prior (the recipe's floor, nothing measured yet)"
    if startups:
        startup_mean, startup_max = statistics.fmean(startups), max(startups)
        wind_mean = statistics.fmean(wind_downs) if wind_downs else 0.0
        wind_max = max(wind_downs) if wind_downs else 0.0
        lost_mean = statistics.fmean(lost) if lost else 0.0
        restart = provision_seconds + startup_mean + wind_mean + lost_mean
        worst = provision_seconds + startup_max + wind_max + (max(lost) if lost else 0.0)
        sources["restart_seconds"] = (
            f"measured: provisioning {span(provision_seconds)} + start-up "
            f"{span(startup_mean)} ({len(startups)}) + wind-down {span(wind_mean)} "
            f"({len(wind_downs)}) + recomputed {span(lost_mean)}"
        )
    else:
        restart = worst = restart_prior if restart_prior is not None else provision_seconds
        sources["restart_seconds"] = "prior (nothing measured yet)"
    # The worst changeover stays at least the prior: one fast start says little about the next.
    worst = max(restart, worst, restart_prior or 0.0)
    return Estimates(step_seconds=step_seconds, restart_seconds=restart, restart_seconds_max=worst, sources=sources)


def progress(events: Iterable[dict]) -> int:
    """The newest step reached (step events, or the step a resume restored)."""
    steps = [e["step"] for e in events if e.get("type") in (T.STEP, T.RESUME) and isinstance(e.get("step"), int)]
    return max(steps) if steps else 0


def latest_decision(events: Iterable[dict]) -> Optional[dict]:
    decisions = [e for e in events if e.get("type") == DECISION_EVENT]
    return max(decisions, key=lambda e: e["ts"]) if decisions else None


# --------------------------------------------------------------------------- simulation


# The most ticks one replay takes (about 2 s of CPU on this machine at 20 us a tick): a longer job is
# replayed at a coarser tick, so its cost is bounded by this, never by its steps.
MAX_TICKS = 100_000


@dataclass(frozen=True)
class Job:
    """What the simulator replays: a run of `steps` steps due `deadline` seconds after launch."""

    steps: int
    step_seconds: float
    """Seconds per step on on-demand."""
    deadline: float
    restart_seconds: float
    """d, billed at the new instance's price without progress."""
    spot_step_seconds: Optional[float] = None
    """Seconds per step on spot (fewer nodes may be slower); default step_seconds."""
    spot_usd_per_hour: float = 1.0
    on_demand_usd_per_hour: float = 3.0
    """Prices for all of the run's nodes."""
    notice_seconds: float = 0.0
    """A preemption takes the instance this long after the trace's time (the trainer trains through)."""

    @property
    def price_ratio(self) -> float:
        return self.on_demand_usd_per_hour / self.spot_usd_per_hour if self.spot_usd_per_hour else math.inf


@dataclass
class Outcome:
    policy: str
    finish: Optional[float]
    """Seconds after launch the last step ended; None if it had not ended at the horizon."""
    met: bool
    cost_usd: float
    spot_seconds: float = 0.0
    on_demand_seconds: float = 0.0
    idle_seconds: float = 0.0
    changeovers: int = 0
    preemptions: int = 0
    decisions: list[tuple[float, Decision]] = field(default_factory=list)
    segments: list[tuple[float, float, str]] = field(default_factory=list)
    """(start, end, mode) of every billed stretch."""

    def summary(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "finish": _round(self.finish),
            "met": self.met,
            "cost_usd": round(self.cost_usd, 6),
            "spot_seconds": round(self.spot_seconds, 3),
            "on_demand_seconds": round(self.on_demand_seconds, 3),
            "idle_seconds": round(self.idle_seconds, 3),
            "changeovers": self.changeovers,
            "preemptions": self.preemptions,
        }


def simulate(
    job: Job,
    trace: Any,
    policy: str,
    *,
    tick: Optional[float] = None,
    period: Optional[float] = None,
    horizon: Optional[float] = None,
) -> Outcome:
    """Replay `trace` (a spot_trace.SpotTrace: preemptions, unavailable windows, capacity_gone_after)
    against `policy` for `job`, in steps of `tick` seconds, deciding every `period` seconds and at
    once after a preemption, a granted spot request or a finished changeover.

    The model is Can't Be Late's (section 3.1): a changeover costs d without progress, billed at the
    new instance's price; releasing an instance costs nothing. A preemption takes a spot instance
    held at that moment (running or in its changeover) and is lost on anything else. An idle run
    holds a request for spot, granted as soon as the trace has capacity. Work is kept across a
    preemption (the emergency checkpoint), as the trainer does.
    """
    horizon = horizon or max(job.deadline, 1.0) * 4 + job.steps * job.step_seconds * 2
    # At most MAX_TICKS ticks, whatever the job: a replay's cost is bounded, never the steps' count.
    tick = max(tick or max(0.01, min(job.restart_seconds, job.step_seconds) / 10), horizon / MAX_TICKS)
    period = period or max(tick, job.restart_seconds / 4)
    estimates = Estimates(
        step_seconds={SPOT: job.spot_step_seconds or job.step_seconds, ON_DEMAND: job.step_seconds},
        restart_seconds=job.restart_seconds,
        restart_seconds_max=job.restart_seconds,
    )
    losses = sorted(t + job.notice_seconds for t in trace.losses())
    outcome = Outcome(policy=policy, finish=None, met=False, cost_usd=0.0)
    t, done = 0.0, 0.0
    held: Optional[str] = None  # the instance held: SPOT or ON_DEMAND
    changeover = 0.0
    wants_spot = False  # a spot request is pending (granted as soon as the trace has capacity)
    committed, preempted = False, 0
    last_decision = -math.inf
    force = True
    segment_start = 0.0
    spot_started: Optional[float] = None
    loss_i = 0

    def price(mode: Optional[str]) -> float:
        return {SPOT: job.spot_usd_per_hour, ON_DEMAND: job.on_demand_usd_per_hour}.get(mode, 0.0)

    def switch(to: Optional[str], now: float) -> None:
        nonlocal held, changeover, segment_start, spot_started
        if held is not None:
            outcome.segments.append((segment_start, now, held))
        held, segment_start = to, now
        if to is not None:
            changeover = job.restart_seconds
            outcome.changeovers += 1
        spot_started = now if to == SPOT else None

    while t < horizon:
        # A preemption (or an outage starting) takes the spot instance held now.
        while loss_i < len(losses) and losses[loss_i] <= t:
            if held == SPOT:
                preempted += 1
                outcome.preemptions += 1
                switch(None, t)
                wants_spot, force = False, True  # the policy decides what comes next
            loss_i += 1
        available = trace.available(t, preempted)
        if held is None and wants_spot and available:
            switch(SPOT, t)
            force = True
        if force or t - last_decision >= period - 1e-9:
            mode = held or IDLE
            state = State(
                now=t,
                start=0.0,
                deadline=job.deadline,
                total_steps=job.steps,
                done_steps=int(done),
                mode=mode,
                spot_available=(False if mode == IDLE and wants_spot else None),
                committed=committed,
                margin=period,
            )
            decision = decide(policy, state, estimates)
            outcome.decisions.append((t, decision))
            committed = decision.committed
            last_decision, force = t, False
            if decision.mode == ON_DEMAND and held != ON_DEMAND:
                switch(ON_DEMAND, t)
                wants_spot = False
            elif decision.mode == SPOT and held != SPOT:
                wants_spot = True
                switch(SPOT if available else None, t)
            elif decision.mode == IDLE:
                if held is not None:
                    switch(None, t)
                wants_spot = decision.reason != "done"
        # Advance one tick.
        if held is not None:
            outcome.cost_usd += tick / 3600 * price(held)
            if held == SPOT:
                outcome.spot_seconds += tick
            else:
                outcome.on_demand_seconds += tick
            if changeover > 0:
                used = min(changeover, tick)
                changeover -= used
                rest = tick - used
                if changeover <= 0:
                    force = True
            else:
                rest = tick
            step = estimates.step(held)
            gained = rest / step
            if done + gained >= job.steps:
                finish = t + (tick - rest) + (job.steps - done) * step
                outcome.cost_usd -= (t + tick - finish) / 3600 * price(held)
                if held == SPOT:
                    outcome.spot_seconds -= t + tick - finish
                else:
                    outcome.on_demand_seconds -= t + tick - finish
                outcome.segments.append((segment_start, finish, held))
                outcome.finish, outcome.met = finish, finish <= job.deadline + 1e-6
                return outcome
            done += gained
        else:
            outcome.idle_seconds += tick
        t += tick
    if held is not None:
        outcome.segments.append((segment_start, t, held))
    return outcome


def job_from(
    estimates: Estimates,
    *,
    steps: int,
    deadline: float,
    spot_usd_per_hour: float,
    on_demand_usd_per_hour: float,
    notice_seconds: float = 0.0,
) -> Job:
    """A simulator job from measured (or hinted) estimates."""
    on_demand = estimates.step(ON_DEMAND)
    if on_demand is None:
        raise DeadlineError("no step time is known: run some steps first or set resources.step_seconds_hint")
    return Job(
        steps=steps,
        step_seconds=on_demand,
        deadline=deadline,
        restart_seconds=estimates.restart_seconds,
        spot_step_seconds=estimates.step(SPOT),
        spot_usd_per_hour=spot_usd_per_hour,
        on_demand_usd_per_hour=on_demand_usd_per_hour,
        notice_seconds=notice_seconds,
    )


# --------------------------------------------------------------------------- before launch


@dataclass(frozen=True)
class Feasibility:
    ok: bool
    known: bool
    """False when the step time is only a floor (no hint): what passed may still be missed."""
    needed_seconds: Optional[float]
    available_seconds: float
    text: str


def feasibility(
    *,
    now: float,
    deadline: float,
    steps: int,
    step_seconds_hint: Optional[float],
    restart_seconds: float,
    step_seconds_floor: float = 0.0,
    floor_source: str = "",
) -> Feasibility:
    """Can even all on-demand, started now, make the deadline? One start-up, then every step on
    on-demand (never preempted): restart + steps x step time, in closed form, so the check costs
    the same for 10 steps and for 10**12. Without a hint the step time is `step_seconds_floor`
    (planning/step_prior.py), and the check refuses only what no run could make."""
    available = deadline - now
    if available <= 0:
        return Feasibility(
            False, True, None, available, f"the deadline {when(deadline)} has passed ({span(-available)} ago)"
        )
    step = step_seconds_hint or step_seconds_floor or 0.0
    needed = restart_seconds + steps * step
    if step_seconds_hint:
        arithmetic = f"start-up {span(restart_seconds)} + {steps:,} steps x {step_seconds_hint:g}s = {span(needed)}"
    else:
        arithmetic = (
            f"start-up {span(restart_seconds)} + {steps:,} steps x at least {step:.3g}s = at least "
            f"{span(needed)}" + (f" ({floor_source})" if floor_source else "")
        )
    fix = "Give a later deadline (--deadline), fewer train.steps"
    if needed > available:
        return Feasibility(
            False,
            True,
            needed,
            available,
            f"even all on-demand cannot make the deadline {when(deadline)}: {arithmetic}, but only "
            f"{span(available)} are left. {fix}"
            + (", or check resources.step_seconds_hint" if step_seconds_hint else ""),
        )
    if not step_seconds_hint:
        return Feasibility(
            True,
            False,
            needed,
            available,
            f"deadline {when(deadline)} ({span(available)} from now): all on-demand needs {arithmetic}; "
            "the real step time is known after the first steps (resources.step_seconds_hint checks "
            "it at launch), and a deadline that becomes unreachable is said at once",
        )
    return Feasibility(
        True,
        True,
        needed,
        available,
        f"deadline {when(deadline)}: all on-demand needs {arithmetic} of the {span(available)} left "
        f"(slack {span(available - needed)})",
    )


def compare(
    plan: dict,
    events: list[dict],
    trace: Any,
    *,
    t0: float,
    total_steps: int,
    spot_usd_per_hour: float,
    on_demand_usd_per_hour: float,
    provision_seconds: float,
    restart_prior: float,
    cost_usd: Optional[float],
    on_demand_usd: Optional[float],
    notice_seconds: float = 0.0,
) -> dict[str, Any]:
    """A run with a deadline against the alternatives on the same trace (`cost-report`): all
    on-demand (the cost report's on-demand baseline, docs/cost.md) and greedy, replayed by the
    simulator with this run's measured step time and restart overhead; its own policy replayed
    the same way shows how far the model is from what happened. `t0` is when the trace starts."""
    estimates = estimates_for(events, plan, provision_seconds=provision_seconds, restart_prior=restart_prior)
    finished = [
        e["ts"] for e in events if e.get("type") in (T.EXIT, T.ATTEMPT_END) and "complet" in str(e.get("reason"))
    ]
    out: dict[str, Any] = {
        "deadline": plan["at"],
        "policy": plan.get("policy") or DEFAULT_POLICY,
        "finished_at": max(finished) if finished else None,
        "met": (max(finished) <= plan["at"]) if finished else None,
        "cost_usd": cost_usd,
        "all_on_demand_usd": on_demand_usd,
        "greedy_usd": None,
        "greedy_met": None,
        "policy_replayed_usd": None,
        "vs_all_on_demand_pct": None,
        "vs_greedy_pct": None,
        "estimates": {"step_seconds": estimates.step_seconds, "restart_seconds": round(estimates.restart_seconds, 3)},
    }
    try:
        job = job_from(
            estimates,
            steps=total_steps,
            deadline=plan["at"] - t0,
            spot_usd_per_hour=spot_usd_per_hour,
            on_demand_usd_per_hour=on_demand_usd_per_hour,
            notice_seconds=notice_seconds,
        )
    except DeadlineError as error:
        out["note"] = str(error)
        return out
    period = max(1.0, job.restart_seconds / 8)
    greedy = simulate(job, trace, "greedy", period=period)
    mine = simulate(job, trace, out["policy"], period=period)
    if on_demand_usd is None:
        on_demand_usd = out["all_on_demand_usd"] = simulate(job, trace, ALL_ON_DEMAND, period=period).cost_usd
    out.update(greedy_usd=greedy.cost_usd, greedy_met=greedy.met, policy_replayed_usd=mine.cost_usd)
    if cost_usd is not None:
        if on_demand_usd:
            out["vs_all_on_demand_pct"] = 100 * (on_demand_usd - cost_usd) / on_demand_usd
        if greedy.cost_usd:
            out["vs_greedy_pct"] = 100 * (greedy.cost_usd - cost_usd) / greedy.cost_usd
    return out


def observed_trace(events: list[dict], t0: float) -> Any:
    """What a SkyPilot run saw of spot (no trace exists there): its controller's waits for capacity
    as outages, its spot stages' preemptions as preemptions. While on on-demand spot is unobserved
    and counts as available, which flatters greedy."""
    from types import SimpleNamespace

    decisions = sorted(
        (e for e in events if e.get("type") == DECISION_EVENT and e.get("reason")), key=lambda e: e["ts"]
    )
    windows: list[tuple[float, float]] = []
    for this, after in zip(decisions, decisions[1:]):
        if this.get("from_mode") == IDLE and this.get("spot_available") is False:
            start, end = this["ts"] - t0, after["ts"] - t0
            if windows and abs(windows[-1][1] - start) < 1e-6:
                windows[-1] = (windows[-1][0], end)
            else:
                windows.append((start, end))
    preempted = [
        e["ts"] - t0
        for e in events
        if e.get("type") == T.EXIT and "preempt" in str(e.get("reason")) and is_spot(e.get("where"))
    ]
    losses = sorted([*preempted, *(a for a, _ in windows)])

    def available(t: float, preemptions: int = 0) -> bool:
        return not any(a <= t < b for a, b in windows)

    return SimpleNamespace(preemptions=preempted, unavailable=windows, losses=lambda: losses, available=available)


def status_row(plan: Optional[dict], events: Iterable[dict], *, ended_at: Optional[float]) -> Optional[dict]:
    """What `status` shows for a run with a deadline (`plan` as launch recorded it): the mode the
    latest decision chose, its projected finish and the deadline; once the run ended, whether it met it."""
    if not isinstance(plan, dict) or not isinstance(plan.get("at"), (int, float)):
        return None
    latest = latest_decision(events)
    row = {
        "at": float(plan["at"]),
        "policy": plan.get("policy"),
        "mode": None,
        "reason": None,
        "projected_finish": None,
        "met": None,
    }
    if latest is not None:
        row.update(
            mode=latest.get("mode"), reason=latest.get("reason"), projected_finish=latest.get("projected_finish")
        )
    row["unreachable"] = row["reason"] == UNREACHABLE
    if ended_at is not None:
        finished = [
            e["ts"]
            for e in events
            if e.get("type") in (T.EXIT, T.ATTEMPT_END) and "complet" in str(e.get("reason", ""))
        ]
        row["finished_at"] = max(finished) if finished else None
        row["met"] = None if not finished else max(finished) <= row["at"]
    return row
