"""The local controller's deadline planner without training: a stand-in controller, events written by
hand, the trace's capacity and the clock as they are."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

from skyspot.planning.deadline import DECISION_EVENT, ON_DEMAND, SPOT
from skyspot.events import read_events_dir
from skyspot.executors.local.deadline import Planner
from skyspot.ledger import Ledger


class FakeController:
    def __init__(self, run_dir, *, at: float, unavailable=(), policy="uniform-progress", total_steps=100):
        now = time.time()
        self.run_dir = run_dir
        self.launched_at = now
        self.spec = SimpleNamespace(
            name="r",
            total_steps=total_steps,
            provision_delay=1.0,
            trace_times=[],
            capacity_gone_after=None,
            unavailable=[list(w) for w in unavailable],
            deadline={"at": now + at, "start": now, "policy": policy, "step_seconds_hint": 1.0, "period": 0.01},
        )
        self.cancel = threading.Event()
        self.attempt, self.preemptions, self.pending_trace = 0, 0, []
        self.ledger = Ledger(run_dir / "ledger.db")
        self.ledger.add("r", "tiny", "local")
        self.lines: list[str] = []

    def say(self, line):
        self.lines.append(line)

    def activity(self, text):
        self.lines.append(text)


def _steps(run_dir, n: int, *, spot: bool):
    events = run_dir / "events"
    events.mkdir(exist_ok=True)
    now = time.time()
    lines = [
        {
            "ts": now - n - 5,
            "run_id": "r",
            "attempt": 1,
            "node_rank": 0,
            "rank": None,
            "type": "attempt_start",
            "where": {"spot": spot},
        }
    ]
    lines += [
        {
            "ts": now - n + i,
            "run_id": "r",
            "attempt": 1,
            "node_rank": 0,
            "rank": 0,
            "type": "step",
            "step": i,
            "step_seconds": 1.0,
        }
        for i in range(1, n + 1)
    ]
    (events / "attempt-1.node-0.rank-0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))


def test_the_first_attempt_is_spot_when_the_trace_has_capacity(tmp_path):
    controller = FakeController(tmp_path, at=1000)
    assert Planner(controller).choose() is True
    (decision,) = read_events_dir(tmp_path / "events").of_type(DECISION_EVENT)
    assert (decision["mode"], decision["reason"], decision["policy"]) == (SPOT, "start", "uniform-progress")


def test_behind_in_an_outage_the_next_attempt_is_on_demand(tmp_path):
    controller = FakeController(tmp_path, at=120, unavailable=[(0, 10_000)])
    controller.spec.deadline["start"] -= 60  # half the time gone, nothing done
    assert Planner(controller).choose() is False


def test_ahead_on_demand_switches_back_to_spot(tmp_path):
    controller = FakeController(tmp_path, at=1000)
    _steps(tmp_path, 80, spot=False)  # 80 % done a few seconds in: far ahead of the line
    planner = Planner(controller)
    planner.started(spot=False)
    planner.next_check = 0.0
    assert planner.switch_due(time.time()) == SPOT
    switch = [d for d in read_events_dir(tmp_path / "events").of_type(DECISION_EVENT) if d.get("switch")]
    assert switch and (switch[0]["from_mode"], switch[0]["mode"]) == (ON_DEMAND, SPOT)


def test_a_cancel_while_waiting_for_spot_ends_the_wait(tmp_path):
    controller = FakeController(tmp_path, at=10_000, unavailable=[(0, 10_000)])
    controller.cancel.set()
    assert Planner(controller).choose() is None
    assert controller.ledger.get("r").status == "STARTING"  # it waited for capacity before its first attempt
