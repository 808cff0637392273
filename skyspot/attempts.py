"""A run's attempts: how its events split into placements of the job, and how each one ended.

An attempt is one placement of the job on nodes, numbered by the events' `attempt` field (the event
contract, skyspot/events.py). This is the one reader of that split; status (runs.summarize), the cost
report (cost.run_cost), the trainer's preemption rate (trainer/interval.py) and the deadline's
measurements (deadline.measure) all take their attempts from `split`.

    for a in split(log.events, now=time.time()):
        a.number, a.where, a.spot, a.start, a.end, a.reason, a.preempted, a.uptime_s

- Start: the executor's `attempt_start` (nodes provisioned), else the trainer's first `start`, else
  the attempt's first event (`started` says whether a start was recorded at all).
- End: its last `attempt_end`, else its last `exit` (how it ended is the record's `reason`, mapped
  onto AttemptEnd); without either, an attempt followed by a later one was killed with its node at
  its last event ("preempted"); the last one is still "running" up to `now`, or "unknown" without it.
- Where: `attempt_start.where`, then each trainer `start.where` for the keys it lacks or says "unknown"
  of (a node leader's start carries what its cloud's metadata said: trainer/instance.py).
- Preempted (for the preemption rate): it ended "preempted", or nothing says how it ended and a notice
  came; its uptime runs to that first notice (`notice_at`).
- In-place restarts (docs/cost.md, "In-place restarts and hangs"): within one attempt, torchrun's agent may
  restart every rank on the same machines; each restart is a new `start` of global rank 0 with the same
  attempt number (`process_starts`: where each set of processes began, the first included), its
  `restart_in_place` record (`restarts`, one per restart number) and, for a hang, the watchdog's `hang`
  (`hangs`, one per set of processes). An earlier set's `exit` does not end the attempt, and
  `attempt.generation(ts)` says which set of processes an event belongs to (0, 1, ...).
- Cause: why an attempt that did not complete ended, one word of CAUSES (`cause_of`, the one place it is
  derived), and the cloud's own name for it when the cloud gave one (`cloud_cause`: AWS `terminate`,
  GCP `TERMINATE_ON_HOST_MAINTENANCE`, Azure `Preempt`); docs/cost.md, "Why an attempt ended".

Import-light and pure: status imports it for every row.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from skyspot import clouds
from skyspot.events import EventType as T
from skyspot.statuses import RunStatus
from skyspot.str_enum import StrEnum


class AttemptEnd(StrEnum):
    """How an attempt ended: the words of its `attempt_end` or `exit` record, read by `end_reason`."""

    COMPLETE = "complete"
    PREEMPTED = "preempted"
    """Taken away (a notice, a signal, killed with its node) and recovered by a later attempt or not."""
    ERROR = "error"
    CANCELLED = "cancelled"
    SWITCHED = "switched"
    """The local executor's deadline moved the run to the other capacity (attempt_end's reason)."""
    SETUP_FAILED = "setup_failed"
    """The local executor's setup failed (attempt_end's reason)."""
    STALE = "stale"
    """A newer attempt of the run held its store, so this one stopped itself (trainer/fence.py)."""
    RUNNING = "running"
    """No end yet: the open last attempt, billed up to `now`."""
    UNKNOWN = "unknown"


END_REASONS = tuple(AttemptEnd)

# A trainer's exit codes (trainer/exit_codes.py, a contract the CLI side may not import here: a leaf) and the
# end each means, for an attempt whose only record is the trainer's `exit` event (a cloud run's).
_EXIT_CODE_ENDS = {0: AttemptEnd.COMPLETE, 75: AttemptEnd.PREEMPTED, 76: AttemptEnd.STALE, 130: AttemptEnd.CANCELLED}

# Events that mean "this attempt is being taken away": the first one starts the recovery clock.
NOTICE_TYPES = (T.PREEMPTION_NOTICE, T.PREEMPT_NOTICE_SENT, T.SIGNAL, T.PREEMPT_SIGTERM)

# A deadline controller's decisions (skyspot/planning/deadline.py) are written between attempts and belong to none.
DECISION_EVENT = T.DEADLINE_DECISION

_TRUE_WORDS = ("true", "1", "yes", "spot")
UNKNOWN = "unknown"  # what a trainer's `where` says for a fact SKYPILOT_CLUSTER_INFO does not give

# Why an attempt that did not complete ended: a stable word, and its phrase (one, many) for summaries.
CAUSES: dict[str, tuple[str, str]] = {
    "spot-preemption": ("spot preemption", "spot preemptions"),  # the cloud took the spot VM back
    "planned-maintenance": ("planned maintenance", "planned maintenance"),  # a scheduled stop, reboot, redeploy
    "rebalance": ("rebalance recommendation", "rebalance recommendations"),  # only AWS's early warning came
    "deadline-switch": ("deadline switch", "deadline switches"),  # the deadline moved to the other capacity
    "sigterm": ("SIGTERM without notice", "SIGTERMs without notice"),  # a SIGTERM no notice explains
    "signal": ("other signal", "other signals"),  # SIGUSR1 (a scheduler's warning)
    "node-lost": ("lost node", "lost nodes"),  # no notice, no signal, no exit: gone
    "stale": ("stale attempt", "stale attempts"),  # a newer attempt held the run's store (trainer/fence.py)
    "cancelled": ("cancellation", "cancellations"),
    "setup-failed": ("setup failure", "setup failures"),
    "error": ("error", "errors"),
    "unknown": ("unknown ending", "unknown endings"),  # ended preempted, nothing says why
}

# Which of the notice watchers' `action` words (skyspot/trainer/notice/, docs/notices.md) are a planned
# shutdown rather than a spot preemption, and the cloud's own spelling of each, are each cloud's facts
# (skyspot/clouds/: `planned_actions`, `native_action`).
# What the executor's attempt_end says that is a cause of its own.
_RECORDED_CAUSES: dict[str, str] = {
    AttemptEnd.CANCELLED: "cancelled",
    AttemptEnd.SWITCHED: "deadline-switch",
    AttemptEnd.SETUP_FAILED: "setup-failed",
}
# A job's status (statuses.RunStatus, SkyPilot's names) for a last attempt whose end only the queue record knows.
_QUEUE_CAUSES = {RunStatus.CANCELLED: "cancelled", RunStatus.FAILED_SETUP: "setup-failed"}


@dataclass
class Attempt:
    """One attempt of a run, as its events tell it."""

    number: int
    events: list[Mapping[str, Any]] = field(repr=False)
    """Its events, oldest first."""
    where: dict[str, Any]
    """attempt_start's `where`, then the trainer starts' for the keys it lacks."""
    spot: bool
    """See `is_spot`."""
    start: float
    started: bool
    """An attempt_start or a trainer start was recorded (else `start` is its first event)."""
    end: float
    reason: AttemptEnd
    """How it ended."""
    recorded_end: bool
    """An attempt_end or exit says how it ended."""
    open: bool
    """No end record and no later attempt: still running, or its end is not in the events."""
    notice_at: Optional[float]
    """Its first notice or signal (NOTICE_TYPES)."""
    switched_at: Optional[float] = None
    """A deadline's switch to the other capacity while it ran (a `deadline_decision` inside it)."""
    cause: Optional[str] = None
    """Why it ended, one of CAUSES (`cause_of`); None when it completed or has not ended."""
    cloud_cause: Optional[str] = None
    """The cloud's own name for that cause, when a cloud notice gave one."""
    process_starts: list[float] = field(default_factory=list)
    """When each set of processes began: global rank 0's `start` events, oldest first; more than one
    after in-place restarts."""
    restarts: list[Mapping[str, Any]] = field(default_factory=list, repr=False)
    """Its `restart_in_place` events, one per restart number (global rank 0's), oldest first."""
    hangs: list[Mapping[str, Any]] = field(default_factory=list, repr=False)
    """The watchdog's `hang` events, one per set of processes (the first node's to see it)."""

    @property
    def in_place_restarts(self) -> int:
        """Its in-place restarts: the `restart_in_place` records, or the new sets of processes when one has
        started but not yet reached the step that records it."""
        return max(len(self.restarts), len(self.process_starts) - 1)

    def generation(self, ts: float) -> int:
        """Which set of processes of this attempt was running at `ts`: 0 until the first in-place restart."""
        return max(0, bisect_right(self.process_starts, ts) - 1)

    @property
    def preempted(self) -> bool:
        """Ended preempted; or nothing says how it ended and a notice came."""
        return self.reason == AttemptEnd.PREEMPTED or (
            self.reason in (AttemptEnd.RUNNING, AttemptEnd.UNKNOWN) and self.notice_at is not None
        )

    @property
    def uptime_s(self) -> float:
        """How long it ran before it was taken away: to its first notice when preempted, else to its end."""
        end = self.notice_at if self.preempted and self.notice_at is not None else self.end
        return max(0.0, end - self.start)


def split(events: Iterable[Mapping[str, Any]], *, now: Optional[float] = None) -> list[Attempt]:
    """The run's attempts, by number. `now` bills an open last attempt up to that time ("running")."""
    events = [e for e in events if _number(e.get("ts"))]
    ordered = sorted((e for e in events if e.get("type") != DECISION_EVENT), key=lambda e: e["ts"])
    switches = sorted(e["ts"] for e in events if e.get("type") == DECISION_EVENT and _is_switch(e))
    by_attempt: dict[int, list[Mapping[str, Any]]] = {}
    for e in ordered:
        number = e.get("attempt", 0)
        by_attempt.setdefault(number if isinstance(number, int) and not isinstance(number, bool) else 0, []).append(e)
    numbers = sorted(by_attempt)
    attempts = [_attempt(n, by_attempt[n], later=i + 1 < len(numbers), now=now) for i, n in enumerate(numbers)]
    for a in attempts:
        a.switched_at = next((ts for ts in switches if a.start <= ts <= a.end), None)
        a.cause, a.cloud_cause = cause_of(a)
    return attempts


def _attempt(number: int, events: list[Mapping[str, Any]], *, later: bool, now: Optional[float]) -> Attempt:
    executor_start = next((e for e in events if e.get("type") == T.ATTEMPT_START), None)
    trainer_starts = [e for e in events if e.get("type") == T.START]
    where: dict[str, Any] = {}
    for e in ([executor_start] if executor_start else []) + trainer_starts:
        if isinstance(e.get("where"), Mapping):
            for key, value in e["where"].items():
                # A node leader's start knows what its metadata said; the other ranks' say "unknown".
                if where.get(key) in (None, "", UNKNOWN):
                    where[key] = value
    if executor_start is not None:
        start = executor_start["ts"]
        # A node made ready before the attempt began (make-before-break: executors/local/return_to_spot.py)
        # is billed from when it was ready.
        ready = executor_start.get("provisioned_at")
        if isinstance(ready, (int, float)) and not isinstance(ready, bool) and math.isfinite(ready):
            start = min(start, float(ready))
    else:
        start = trainer_starts[0]["ts"] if trainer_starts else events[0]["ts"]
    process_starts = sorted({e["ts"] for e in trainer_starts if e.get("rank") == 0})
    # After an in-place restart, the exits of the processes it replaced (a crashed rank's peers) end nothing.
    newest = process_starts[-1] if len(process_starts) > 1 else None
    record = next((e for e in reversed(events) if e.get("type") == T.ATTEMPT_END), None) or next(
        (e for e in reversed(events) if e.get("type") == T.EXIT and (newest is None or e["ts"] >= newest)), None
    )
    stale = next((e for e in events if e.get("type") == T.STALE_ATTEMPT), None)
    if record is not None:
        end, reason = record["ts"], end_reason(record.get("reason"))
        if record.get("type") == T.EXIT and reason == AttemptEnd.UNKNOWN:  # a trainer's own words: its code says
            reason = _EXIT_CODE_ENDS.get(record.get("code"), AttemptEnd.UNKNOWN)
    elif stale is not None:  # its own event files stopped at the takeover; its stale/ record says the rest
        end, reason = max(e["ts"] for e in events), AttemptEnd.STALE
    elif later:
        end, reason = events[-1]["ts"], AttemptEnd.PREEMPTED  # no record, and a later attempt: killed with its node
    elif now is not None:
        end, reason = max(now, events[-1]["ts"]), AttemptEnd.RUNNING
    else:
        end, reason = events[-1]["ts"], AttemptEnd.UNKNOWN
    notices = [e["ts"] for e in events if e.get("type") in NOTICE_TYPES]
    return Attempt(
        number=number,
        events=events,
        where=where,
        spot=is_spot(where),
        start=start,
        started=executor_start is not None or bool(trainer_starts),
        end=end,
        reason=reason,
        recorded_end=record is not None,
        open=record is None and not later,
        notice_at=min(notices) if notices else None,
        process_starts=process_starts,
        restarts=_restarts(events),
        hangs=_hangs(events, process_starts),
    )


def _restarts(events: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One `restart_in_place` per restart number (a copy of an event file read twice counts once)."""
    chosen: dict[object, Mapping[str, Any]] = {}  # by restart number, else ("ts", ts)
    for e in events:
        if e.get("type") == T.RESTART_IN_PLACE:
            number = e.get("restart")
            chosen.setdefault(number if _number(number) else ("ts", e["ts"]), e)
    return sorted(chosen.values(), key=lambda e: e["ts"])


def _hangs(events: list[Mapping[str, Any]], process_starts: list[float]) -> list[Mapping[str, Any]]:
    """One `hang` per set of processes: every node's watchdog may see the same stalled collective."""
    chosen: dict[int, Mapping[str, Any]] = {}
    for e in events:
        if e.get("type") == T.HANG:
            chosen.setdefault(max(0, bisect_right(process_starts, e["ts"]) - 1), e)
    return [chosen[k] for k in sorted(chosen)]


def cause_of(
    attempt: Attempt, *, reason: Optional[str] = None, queue_status: Any = None
) -> tuple[Optional[str], Optional[str]]:
    """Why an attempt that did not complete ended: (one of CAUSES, the cloud's own name or None).

    (None, None) when it completed, is still running, or is the open last attempt with nothing to say.
    `reason` overrides the attempt's own end reason, and `queue_status` (SkyPilot's ManagedJobStatus, read
    by RunStatus.from_sky) says how the job ended, for a last attempt whose end only the queue record knows (cost.py).
    The first that applies wins: what the executor recorded (cancelled, a deadline switch, setup failed);
    the cloud's notice (`preemption_notice`: its source and action); the local executor's simulated spot
    preemption (`preempt_notice_sent`); a deadline switch while it ran; a warning that came alone (a
    rebalance recommendation, or a planned shutdown ahead of its deadline); a signal (SIGTERM with no
    notice); the trainer's own end (cancelled); killed with its node (no record, a later attempt);
    an error; else unknown.
    """
    reason = attempt.reason if reason is None else reason
    if reason in (AttemptEnd.COMPLETE, AttemptEnd.RUNNING):
        return None, None
    events = attempt.events
    recorded = next((e for e in reversed(events) if e.get("type") == T.ATTEMPT_END), None)
    said = _word(recorded.get("reason")) if recorded is not None else ""
    if said in _RECORDED_CAUSES:
        return _RECORDED_CAUSES[said], None
    if any(e.get("type") == T.STALE_ATTEMPT for e in events):
        return "stale", None  # it stopped itself: whatever else it saw, a newer attempt had the run
    notice = next((e for e in events if e.get("type") == T.PREEMPTION_NOTICE), None)
    if notice is not None:
        source, action = _word(notice.get("source")), _word(notice.get("action"))
        kind = (
            "planned-maintenance"
            if _planned(source, action)
            else "rebalance"
            if action == "rebalance"
            else "spot-preemption"
        )
        return kind, _cloud_name(source, action)
    if any(e.get("type") == T.PREEMPT_NOTICE_SENT for e in events):
        return "spot-preemption", None  # the local executor's simulated spot interruption
    if attempt.switched_at is not None:
        return "deadline-switch", None
    for e in events:
        if e.get("type") != T.SHUTDOWN_WARNING:
            continue
        source, action = _word(e.get("source")), _word(e.get("action"))
        if action == "rebalance":
            return "rebalance", None
        if _planned(source, action):
            return "planned-maintenance", _cloud_name(source, action)
        # freeze, migrate, system-maintenance: the VM lives through them; they end nothing.
    signal = next((e for e in events if e.get("type") == T.SIGNAL), None)
    if signal is not None:
        name = _word(signal.get("name")) or ("sigterm" if signal.get("signum") == 15 else "")
        return ("sigterm" if name == "sigterm" else "signal"), None
    if any(e.get("type") == T.PREEMPT_SIGTERM for e in events):
        return "sigterm", None
    if queue_status is not None:
        status = RunStatus.from_sky(queue_status)
        if status in _QUEUE_CAUSES:
            return _QUEUE_CAUSES[status], None
        return ("error" if status is not None and status.is_failed() else "unknown"), None
    if reason == AttemptEnd.CANCELLED:
        return "cancelled", None
    if not attempt.recorded_end:
        return ("node-lost", None) if not attempt.open else (None, None)
    if reason == AttemptEnd.ERROR:
        return "error", None
    return "unknown", None


def count_causes(attempts: Iterable[Any]) -> dict[str, int]:
    """Attempts (anything with a `cause`) that ended without completing, by cause, most frequent first,
    ties in CAUSES' order."""
    counts: dict[str, int] = {}
    for a in attempts:
        cause = getattr(a, "cause", None)
        if cause:
            counts[cause] = counts.get(cause, 0) + 1
    order = list(CAUSES)
    return dict(
        sorted(
            counts.items(),
            key=lambda item: (-item[1], order.index(item[0]) if item[0] in order else len(order), item[0]),
        )
    )


def describe_causes(counts: Mapping[str, int]) -> str:
    """'2 spot preemptions, 1 planned maintenance', in the order `count_causes` gives."""
    return ", ".join(f"{n} {CAUSES.get(cause, (cause, cause))[n != 1]}" for cause, n in counts.items() if n)


def _planned(source: str, action: str) -> bool:
    cloud = clouds.find(source)
    return cloud is not None and action in cloud.planned_actions


def _cloud_name(source: str, action: str) -> Optional[str]:
    cloud = clouds.find(source)
    return cloud.native_action(action) if cloud is not None and action else None


def _is_switch(decision: Mapping[str, Any]) -> bool:
    """A deadline decision that moved the run to the other capacity: the local executor marks it `switch`;
    the controller on SkyPilot decides a mode other than the stage's (`from_mode`), and cancels it."""
    if decision.get("switch") is True:
        return True
    modes = (decision.get("from_mode"), decision.get("mode"))
    return modes in (("spot", "on-demand"), ("on-demand", "spot"))


def _word(value: Any) -> str:
    return value.strip().lower() if isinstance(value, str) else ""


def end_reason(text: Any) -> AttemptEnd:
    """Map the words trainers and executors use for how an attempt ended onto AttemptEnd; a word it does
    not know (a trainer's free-text error) is UNKNOWN."""
    word = str(text or "").strip().lower()
    known = AttemptEnd.parse(word)
    if known is not None:
        return known
    if word.startswith("complet") or word in ("done", "finished", "success", "succeeded"):
        return AttemptEnd.COMPLETE
    if "preempt" in word or word in ("signal", "sigterm", "sigkill", "terminated", "notice"):
        return AttemptEnd.PREEMPTED
    if "cancel" in word:
        return AttemptEnd.CANCELLED
    if word.startswith("fail") or word in ("exception", "crash", "crashed"):
        return AttemptEnd.ERROR
    return AttemptEnd.UNKNOWN


def end_of_status(status: Any) -> AttemptEnd:
    """How the last attempt of a job ended, from its status as SkyPilot reports it (RunStatus.from_sky):
    the one mapping both the cost report and the causes use, so an unlisted FAILED_* is an error in both."""
    found = RunStatus.from_sky(status)
    if found is RunStatus.SUCCEEDED:
        return AttemptEnd.COMPLETE
    if found is RunStatus.CANCELLED:
        return AttemptEnd.CANCELLED
    if found is not None and found.is_failed():
        return AttemptEnd.ERROR
    return AttemptEnd.UNKNOWN


def is_spot(where: Any) -> bool:
    """Whether a `where` describes spot capacity.

    A stated value is read as stated (True, or "true"/"1"/"yes"/"spot"; anything else, including the
    trainer's "unknown" when SKYPILOT_CLUSTER_INFO does not say, is on-demand). A `where` without
    `spot` is spot: every writer that knows the capacity records it (the local executor always does),
    so its absence means a trainer-only log of a skyspot job, and skyspot's candidates put spot first;
    reading it as on-demand would also hide such an attempt's preemptions from the preemption rate.
    """
    value = where.get("spot") if isinstance(where, Mapping) else None
    return True if value is None else _truthy(value)


def is_simulated(where: Mapping[str, Any]) -> bool:
    """Whether a `where` describes a local run standing in for a cloud instance."""
    return _truthy(where.get("simulated")) or where.get("executor") == "local"


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in _TRUE_WORDS
    return bool(value)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
