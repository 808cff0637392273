"""A deadline for a local run: the policy of skyspot/planning/deadline.py, applied by the local controller.

The controller asks `choose()` before every attempt (at the start and after each preemption or
switch) and `switch_due()` at every poll while one runs; the planner decides every `period`
seconds from the run's own events (steps done, measured step time and restart overhead):

- spot: the next attempt runs on spot, if the trace has capacity; otherwise the run waits (idle,
  nothing billed) and decides again every period, as SkyPilot keeps retrying a spot launch;
- on-demand: the next attempt runs on-demand and is never preempted;
- a switch while an attempt runs (to on-demand at the safety net, off on-demand once ahead of the
  line) is make-before-break (handover.py): a node of the other capacity is provisioned while the
  attempt trains; once it is ready, SIGTERM to the nodes, whose trainer writes an emergency checkpoint
  and exits 75; the attempt ends `switched` and the next one starts on the ready node at once.

The deadline is judged while nothing steps too: every period while the machine is prepared once
(DeepSpeed's op build) or a fresh node runs its setup (`preparing()`), and while a started attempt's
trainer has not reached its first step, with what is left of that changeover (the start-up prior) counted
from now (`State.overhead_left`). A decision is also due at the deadline itself, whatever the period. So
a deadline that becomes unreachable is said as soon as the arithmetic knows it, and at the latest when it
passes: in the log (`deadline UNREACHABLE: ...`), in `status` and on the launching terminal (follow.py),
from the one `deadline_decision` event (issue 31, item 12).

Every decision is a `deadline_decision` event in `<run>/events/deadline.jsonl` (mode, progress,
projected finish, reason, the estimates it used). A trace time that passes while the run holds
no spot instance (on-demand, or waiting for capacity) is lost, as a real preemption would be: it
can only take an instance that exists.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from skyspot.planning import deadline as dl
from skyspot.events import EVENTS_DIR, EventType, read_events_dir

DECISIONS_FILE = "deadline.jsonl"


class Planner:
    def __init__(self, controller) -> None:
        from skyspot.executors.local.spot_trace import SpotTrace

        self.c = controller
        spec = controller.spec
        plan: dict[str, Any] = spec.deadline or {}
        self.plan = plan
        self.at = float(plan["at"])
        self.start = float(plan.get("start") or controller.launched_at)
        self.policy = plan.get("policy") or dl.DEFAULT_POLICY
        self.period = float(plan.get("period") or 3.0)
        self.trace = SpotTrace.from_spec(spec)
        self.committed = False
        self.held: Optional[str] = None  # the capacity of the attempt running now
        self.nodes_started: Optional[float] = None  # when the running attempt's nodes started
        self.next_check = 0.0
        self.last: Optional[dl.Decision] = None
        self.path = Path(controller.run_dir) / EVENTS_DIR / DECISIONS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)

    # ------------------------------------------------------------------ what the controller calls
    def choose(self) -> Optional[bool]:
        """Before an attempt: True for spot, False for on-demand; None if the run was cancelled while
        it waited for spot capacity."""
        waited = False
        spot_available: Optional[bool] = None
        while True:
            decision = self.decide(dl.IDLE, spot_available)
            if decision.mode == dl.ON_DEMAND:
                self._drop_passed_trace()
                return False
            if self.capacity():
                if waited or self.held == dl.ON_DEMAND:
                    self._drop_passed_trace()
                return True
            if not waited:
                self.c.activity(f"waiting for spot capacity (deadline {dl.when(self.at)}; {decision.why})")
                self.c.ledger.set_status(self.c.spec.name, "STARTING" if self.c.attempt == 0 else "RECOVERING")
            waited, spot_available = True, False
            if self.c.cancel.wait(max(0.0, self.next_check - time.time())):
                return None

    def preparing(self, spot: bool) -> None:
        """Every poll while the attempt's node is prepared before its start (the machine's one-time op
        build, a fresh node's setup): a decision every period, on the capacity chosen for the attempt,
        with the whole start-up still ahead. It acts on nothing (the nodes start as chosen; a switch the
        policy wants comes at their first poll, `switch_due`), but what it finds is said at once."""
        now = time.time()
        if now < self.next_check:
            return
        self.decide(dl.SPOT if spot else dl.ON_DEMAND, None, overhead_left=dl.LOCAL_START_PRIOR_SECONDS)

    def started(self, spot: bool) -> None:
        self.held = dl.SPOT if spot else dl.ON_DEMAND
        self.nodes_started = time.time()
        self.next_check = self._after(self.nodes_started)

    def switch_due(self, now: float) -> Optional[str]:
        """While an attempt runs: the other capacity, when the policy wants it now (the controller then makes
        a node of it ready while the attempt trains: handover.py); None to stay."""
        if now < self.next_check or self.held is None:
            return None
        decision = self.decide(self.held, None, overhead_left=self._startup_left(now))
        if decision.mode == self.held or decision.reason == "done":
            return None  # done: the trainer is finishing on its own
        want = dl.ON_DEMAND if decision.mode == dl.ON_DEMAND else dl.SPOT  # idle: wait for spot on a spot node
        self.c.say(f"deadline: leaving {self.held} for {decision.mode}: {decision.why}")
        self.emit_switch(decision)
        return want

    def capacity(self) -> bool:
        """Spot capacity now, as the trace says (the same rule the simulator uses)."""
        return self.trace.available(time.time() - self.c.launched_at, self.c.preemptions)

    # ------------------------------------------------------------------ deciding
    def _after(self, now: float) -> float:
        """When the next decision is due: a period on, or the deadline itself if it falls first (a deadline
        that passes is said when it passes, not up to a period later)."""
        return min(now + self.period, self.at) if now < self.at else now + self.period

    def _startup_left(self, now: float) -> float:
        """What is left of the running attempt's start-up, by the prior, until its trainer's first step."""
        if self.nodes_started is None:
            return 0.0
        return max(0.0, dl.LOCAL_START_PRIOR_SECONDS - (now - self.nodes_started))

    def decide(self, mode: str, spot_available: Optional[bool], *, overhead_left: float = 0.0) -> dl.Decision:
        log = read_events_dir(Path(self.c.run_dir) / EVENTS_DIR)
        estimates = dl.estimates_for(
            log.events,
            self.plan,
            provision_seconds=self.c.spec.provision_delay,
            restart_prior=self.c.spec.provision_delay + dl.LOCAL_START_PRIOR_SECONDS,
        )
        if overhead_left and any(
            e.get("type") == EventType.STEP and (e.get("attempt") or 0) >= self.c.attempt for e in log.events
        ):
            overhead_left = 0.0  # this attempt steps: its changeover is over
        now = time.time()
        round_ = dl.next_round(
            self.policy,
            log.events,
            estimates,
            now=now,
            plan={**self.plan, "start": self.start},
            total_steps=self.c.spec.total_steps,
            mode=mode,
            spot_available=spot_available,
            committed=self.committed,
            margin=self.period,
            overhead_left=overhead_left,
        )
        self.next_check = self._after(now)
        decision = round_.decision
        self.committed = decision.committed
        self._emit(round_.event_fields())
        line = dl.news(self.last, decision, self.at)
        if line:
            self.c.say(line)
        self.last = decision
        return decision

    def emit_switch(self, decision: dl.Decision) -> None:
        self._emit(
            {
                "switch": True,
                "mode": decision.mode,
                "from_mode": self.held,
                "reason": decision.reason,
                "policy": self.policy,
                "deadline": self.at,
                "projected_finish": decision.projected_finish,
            }
        )

    def _emit(self, fields: dict[str, Any]) -> None:
        event = {
            "ts": time.time(),
            "run_id": self.c.spec.name,
            "attempt": max(self.c.attempt, 1),
            "node_rank": 0,
            "rank": None,
            "type": dl.DECISION_EVENT,
            **fields,
        }
        line = json.dumps(event, separators=(",", ":"), default=str) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line.encode("utf-8"))
        except OSError:
            pass  # a full disk loses a decision's record, never the run
        finally:
            os.close(fd)

    def _drop_passed_trace(self) -> None:
        """Trace times that passed while no spot instance was held took nothing."""
        elapsed = time.time() - self.c.launched_at
        self.c.pending_trace = [t for t in self.c.pending_trace if t > elapsed]
