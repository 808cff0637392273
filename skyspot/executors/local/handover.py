"""Make-before-break: the next attempt's node is made ready while the current attempt goes on training.

    handover = Handover(controller)
    handover.begin(attempt, now, spot=True, reason="spot_back")   # provisioning starts; the attempt trains on
    handover.ready(attempt, now)         # each poll: True once the node is ready (then the attempt stops)
    handover.take()                      # the next attempt: the ready node, started at once (no provisioning)

Two callers decide when: the way back to spot of a run without a deadline (return_to_spot.py: spot is back
and the switch pays) and a deadline's switch while an attempt runs (deadline.py: the policy wants the other
capacity). Both then wait here for the same thing: the replacement's provisioning (the run's
`--provision-delay`), billed from when the node is ready (`attempt_start.provisioned_at`, read by
attempts.py), while the current attempt trains. Only when the node is ready does the current attempt get
SIGTERM (its trainer writes an emergency checkpoint), and the next attempt starts on the ready node at once
and resumes from that checkpoint.

The two attempts never train at once and never both write the store: the next attempt's processes start
after every process of the current one has exited (the controller runs attempts in turn), and the store's
fencing (trainer/fence.py) refuses a late commit of the older one anyway.

A handover to spot is withdrawn when spot capacity goes again before the node is ready (the caller asks
`withdraw`); one to on-demand always completes: on-demand capacity is not taken away. If the current attempt
ends on its own first (a preemption), the node being provisioned is the replacement: the next attempt waits
only for what is left of its provisioning (`left`).

Each step is a `handover` event: `decision` provisioning (with `ready_at`), ready, withdrawn or declined, `to`
(spot or on-demand), `reason` (spot_back or deadline) and the step the current attempt was at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from skyspot.events import EventType as T


@dataclass(frozen=True)
class Ready:
    """A node made ready for the next attempt."""

    spot: bool
    at: float
    """When it was ready: the next attempt is billed from here."""


class Handover:
    """One run's node in the making (see the module docstring); the controller owns one."""

    def __init__(self, controller) -> None:
        self.c = controller
        self.to_spot: Optional[bool] = None
        """The capacity of the node being provisioned; None when none is."""
        self.ready_at: Optional[float] = None
        self.reason = ""
        self.prepared: Optional[Ready] = None
        """The node made ready for the next attempt, until it takes it."""

    @property
    def pending(self) -> bool:
        return self.ready_at is not None

    def begin(self, attempt, now: float, *, spot: bool, reason: str, **fields: Any) -> None:
        self.to_spot, self.reason = spot, reason
        self.ready_at = now + self.c.spec.provision_delay
        self._emit(attempt, "provisioning", ready_at=self.ready_at, **fields)

    def ready(self, attempt, now: float) -> bool:
        """At each poll of the current attempt: True once the node being provisioned is ready."""
        if self.ready_at is None or self.to_spot is None or now < self.ready_at:
            return False
        self._emit(attempt, "ready")
        self.prepared = Ready(self.to_spot, now)
        self.to_spot, self.ready_at = None, None
        return True

    def withdraw(self, attempt) -> None:
        self._emit(attempt, "withdrawn")
        self.to_spot, self.ready_at = None, None

    def declined(self, attempt, *, spot: bool, reason: str, **fields: Any) -> None:
        self.to_spot, self.reason = spot, reason
        self._emit(attempt, "declined", **fields)
        self.to_spot = None

    def left(self, now: float) -> Optional[tuple[bool, float]]:
        """The attempt ended on its own while a node was provisioned: (its capacity, seconds of provisioning
        left), and the node counts as made ready once they pass; None when no node is being provisioned."""
        if self.ready_at is None or self.to_spot is None:
            return None
        spot, wait = self.to_spot, max(0.0, self.ready_at - now)
        self.prepared = Ready(spot, self.ready_at)
        self.to_spot, self.ready_at = None, None
        return spot, wait

    def take(self) -> Optional[Ready]:
        """The node made ready, for the attempt that starts now (at most once)."""
        prepared, self.prepared = self.prepared, None
        return prepared

    def _emit(self, attempt, decision: str, **fields: Any) -> None:
        attempt.events.emit(
            T.HANDOVER,
            decision=decision,
            to="spot" if self.to_spot else "on-demand",
            reason=self.reason,
            step=attempt.step,
            **fields,
        )
