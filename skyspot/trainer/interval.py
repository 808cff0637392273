"""`checkpoint.every_seconds: auto`: the interval, planned at start and re-planned as the run learns.

Global rank 0 owns the interval (it alone decides `time_due`, which the step vote shares). The
plan is planning.plan_from_events over the run's own history:

    C  blocking cost of one checkpoint   the median observed `blocked_seconds`, else the estimate
                                         (state bytes / write bandwidth, planning.initial_plan)
    U  upload time                       the median observed durable upload, else the estimate
    M  mean time between preemptions    the prior (checkpoint.mtbp_prior_seconds, else skyspot's
                                         per cloud and accelerator prior) until two preemptions
                                         are seen, then the Gamma-posterior blend with the
                                         observed exposure (planning.mtbp_from_events)

History: the events of earlier attempts in the run directory (the local executor shares it), else
the store's copy of them (a fresh node on a cloud), then this attempt's as they are written
(EventTail, incremental). The planner re-plans at start and after each committed checkpoint;
every change beyond 10 % is logged as an `interval_plan` event with its inputs and the reason,
and the cost report shows the plans a run used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from skyspot.events import EventTail

# The event types the planner reads (planning.attempt_uptimes, blocking and upload medians).
_KEPT = {"attempt_start", "start", "attempt_end", "exit", "preemption_notice", "preempt_notice_sent", "signal",
         "preempt_sigterm", "checkpoint_end", "upload_end"}
CHANGE = 0.10
DEFAULT_AUTO_SECONDS = 1800.0
FALLBACK_COST_S, FALLBACK_PRIOR_S = 10.0, 6 * 3600.0


class IntervalPlanner:
    def __init__(self, recipe, cloud: Optional[str], events_dir: Path, *, history: Iterable[dict] = (),
                 emit: Callable[..., Any], say: Callable[[str], None]):
        from skyspot.planning import MIN_INTERVAL_S, initial_plan

        self.emit, self.say = emit, say
        checkpoint = recipe.checkpoint
        self.min_interval_s = float(checkpoint.min_every_seconds or MIN_INTERVAL_S)
        first = None
        try:
            first = initial_plan(recipe, cloud) if cloud in ("aws", "gcp", "azure") else None
        except Exception as err:  # planning is advice; never stop training over it
            say(f"checkpoint.every_seconds=auto: no initial estimate ({err}); planning from what the run observes")
        self.cost_s = first.blocking_cost_s if first else FALLBACK_COST_S
        self.upload_s = first.upload_s if first else FALLBACK_COST_S
        self.prior_s = float(checkpoint.mtbp_prior_seconds or (first.mtbp_s if first else FALLBACK_PRIOR_S))
        self.prior_source = ("checkpoint.mtbp_prior_seconds" if checkpoint.mtbp_prior_seconds
                             else (first.sources.get("mtbp_s") if first else "fallback prior (6 h)"))
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
        from skyspot.planning import plan_from_events

        self._absorb(self._tail.poll())
        seen = {id(e) for e in self._kept}
        log = self._kept + [e for e in self._last_of_attempt.values() if id(e) not in seen]
        try:
            plan = plan_from_events(log, prior_s=self.prior_s, blocking_cost_s=self.cost_s, upload_s=self.upload_s,
                                    min_interval_s=self.min_interval_s)
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
        self.say(f"checkpoint interval {plan.every_seconds:.0f} s ({reason}; {plan.bound}: C {plan.blocking_cost_s:.2f} s "
                 f"[{src.get('blocking_cost_s')}], M {plan.mtbp_s:.0f} s [{src.get('mtbp_s')}], "
                 f"upload {plan.upload_s:.1f} s)" + (f", was {previous:.0f} s" if previous is not None else ""))
        return self.every_seconds
