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
  onto END_REASONS); without either, an attempt followed by a later one was killed with its node at
  its last event ("preempted"); the last one is still "running" up to `now`, or "unknown" without it.
- Where: `attempt_start.where`, then each trainer `start.where` for the keys it lacks.
- Preempted (for the preemption rate): it ended "preempted", or nothing says how it ended and a notice
  came; its uptime runs to that first notice (`notice_at`).

Import-light and pure: status imports it for every row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

END_REASONS = ("complete", "preempted", "error", "cancelled", "running", "unknown")

# Events that mean "this attempt is being taken away": the first one starts the recovery clock.
NOTICE_TYPES = ("preemption_notice", "preempt_notice_sent", "signal", "preempt_sigterm")

# A deadline controller's decisions (skyspot/deadline.py) are written between attempts and belong to none.
DECISION_EVENT = "deadline_decision"

_TRUE_WORDS = ("true", "1", "yes", "spot")


@dataclass
class Attempt:
    """One attempt of a run, as its events tell it."""

    number: int
    events: list[dict] = field(repr=False)
    """Its events, oldest first."""
    where: dict[str, Any]
    """attempt_start's `where`, then the trainer starts' for the keys it lacks."""
    spot: bool
    """See `is_spot`."""
    start: float
    started: bool
    """An attempt_start or a trainer start was recorded (else `start` is its first event)."""
    end: float
    reason: str
    """How it ended, one of END_REASONS."""
    recorded_end: bool
    """An attempt_end or exit says how it ended."""
    open: bool
    """No end record and no later attempt: still running, or its end is not in the events."""
    notice_at: Optional[float]
    """Its first notice or signal (NOTICE_TYPES)."""

    @property
    def preempted(self) -> bool:
        """Ended preempted; or nothing says how it ended and a notice came."""
        return self.reason == "preempted" or (self.reason in ("running", "unknown") and self.notice_at is not None)

    @property
    def uptime_s(self) -> float:
        """How long it ran before it was taken away: to its first notice when preempted, else to its end."""
        end = self.notice_at if self.preempted and self.notice_at is not None else self.end
        return max(0.0, end - self.start)


def split(events: Iterable[Mapping[str, Any]], *, now: Optional[float] = None) -> list[Attempt]:
    """The run's attempts, by number. `now` bills an open last attempt up to that time ("running")."""
    ordered = sorted((e for e in events if _number(e.get("ts")) and e.get("type") != DECISION_EVENT),
                     key=lambda e: e["ts"])
    by_attempt: dict[int, list[dict]] = {}
    for e in ordered:
        number = e.get("attempt", 0)
        by_attempt.setdefault(number if isinstance(number, int) and not isinstance(number, bool) else 0,
                              []).append(e)  # type: ignore[arg-type]
    numbers = sorted(by_attempt)
    return [_attempt(n, by_attempt[n], later=i + 1 < len(numbers), now=now) for i, n in enumerate(numbers)]


def _attempt(number: int, events: list[dict], *, later: bool, now: Optional[float]) -> Attempt:
    executor_start = next((e for e in events if e.get("type") == "attempt_start"), None)
    trainer_starts = [e for e in events if e.get("type") == "start"]
    where: dict[str, Any] = {}
    for e in ([executor_start] if executor_start else []) + trainer_starts:
        if isinstance(e.get("where"), Mapping):
            for key, value in e["where"].items():
                where.setdefault(key, value)
    if executor_start is not None:
        start = executor_start["ts"]
    else:
        start = trainer_starts[0]["ts"] if trainer_starts else events[0]["ts"]
    record = next((e for e in reversed(events) if e.get("type") == "attempt_end"), None) or \
        next((e for e in reversed(events) if e.get("type") == "exit"), None)
    if record is not None:
        end, reason = record["ts"], end_reason(record.get("reason"))
    elif later:
        end, reason = events[-1]["ts"], "preempted"  # no record, and a later attempt: killed with its node
    elif now is not None:
        end, reason = max(now, events[-1]["ts"]), "running"
    else:
        end, reason = events[-1]["ts"], "unknown"
    notices = [e["ts"] for e in events if e.get("type") in NOTICE_TYPES]
    return Attempt(number=number, events=events, where=where, spot=is_spot(where), start=start,
                   started=executor_start is not None or bool(trainer_starts), end=end, reason=reason,
                   recorded_end=record is not None, open=record is None and not later,
                   notice_at=min(notices) if notices else None)


def end_reason(text: Any) -> str:
    """Map the words trainers and executors use for how an attempt ended onto END_REASONS."""
    word = str(text or "").strip().lower()
    if word in END_REASONS:
        return word
    if word.startswith("complet") or word in ("done", "finished", "success", "succeeded"):
        return "complete"
    if "preempt" in word or word in ("signal", "sigterm", "sigkill", "terminated", "notice"):
        return "preempted"
    if "cancel" in word:
        return "cancelled"
    if word.startswith("fail") or word in ("exception", "crash", "crashed"):
        return "error"
    return word or "unknown"


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
