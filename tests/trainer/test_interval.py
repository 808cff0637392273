"""checkpoint.every_seconds=auto in the trainer: the planner over a run's events (interval.py).
Hand-computed against the interval policy's formulas; no training needed."""

from __future__ import annotations

import json
import math

import pytest

from skyspot.events import EVENTS_DIR, event_file_name
from skyspot.recipe import load_recipe
from skyspot.trainer.interval import IntervalPlanner


def _recipe(**checkpoint):
    overrides = ["checkpoint.every_seconds=auto"] + [f"checkpoint.{k}={v}" for k, v in checkpoint.items()]
    return load_recipe("tiny", overrides)


def _attempt(number: int, start: float, up: float, preempted: bool, blocked: float = 0.5) -> list[dict]:
    base = {"run_id": "r", "attempt": number, "node_rank": 0, "rank": 0}
    events = [
        {**base, "ts": start, "type": "start", "where": {"cloud": "aws", "spot": True}},
        {
            **base,
            "ts": start + 1,
            "type": "checkpoint_end",
            "step": number * 10,
            "kind": "interval",
            "blocked_seconds": blocked,
        },
    ]
    if preempted:
        events += [
            {**base, "ts": start + up, "type": "preemption_notice"},
            {**base, "ts": start + up + 1, "type": "exit", "reason": "preempted", "code": 75},
        ]
    return events


def _planner(tmp_path, history=(), **checkpoint):
    said, emitted = [], []
    planner = IntervalPlanner(
        _recipe(**checkpoint),
        "aws",
        tmp_path / EVENTS_DIR,
        history=history,
        emit=lambda type, **f: emitted.append({"type": type, **f}),
        say=said.append,
    )
    return planner, said, emitted


def test_before_any_preemption_the_prior_decides(tmp_path):
    planner, said, emitted = _planner(tmp_path, mtbp_prior_seconds=7200, min_every_seconds=1)
    every = planner.replan("start")
    # No checkpoint observed yet: C is the estimate for tiny's state; Daly with M = 7200 s.
    c = planner.cost_s
    assert every == pytest.approx(
        math.sqrt(2 * c * 7200) * (1 + math.sqrt(c / (2 * 7200)) / 3 + c / (9 * 2 * 7200)) - c, rel=1e-6
    )
    assert 5 < every < 15  # about 9.7 s for tiny's 1.3 MB state at the default write bandwidth
    assert emitted[0]["type"] == "interval_plan" and emitted[0]["inputs"]["mtbp_s"] == 7200
    assert emitted[0]["inputs"]["sources"]["prior"] == "checkpoint.mtbp_prior_seconds"
    assert said and said[0].startswith("checkpoint interval")


def test_observed_preemptions_and_checkpoint_costs_replace_the_estimates(tmp_path):
    # Two attempts preempted after 100 s and 200 s, each checkpoint blocking 0.5 s.
    history = _attempt(1, 1000.0, 100.0, True) + _attempt(2, 1200.0, 200.0, True)
    planner, said, emitted = _planner(tmp_path, history, mtbp_prior_seconds=3600, min_every_seconds=1)
    every = planner.replan("start")
    plan = emitted[-1]["inputs"]
    assert plan["blocking_cost_s"] == 0.5 and plan["sources"]["blocking_cost_s"] == "observed median"
    assert plan["mtbp_s"] == pytest.approx((3600 + 300) / 3)  # Gamma posterior: (prior + exposure) / (1 + 2)
    m, c = (3600 + 300) / 3, 0.5
    assert every == pytest.approx(math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c, rel=1e-6)


def test_a_change_under_ten_percent_is_not_logged_and_a_larger_one_is(tmp_path):
    events_dir = tmp_path / EVENTS_DIR
    events_dir.mkdir()
    planner, said, emitted = _planner(
        tmp_path,
        _attempt(1, 1000.0, 100.0, True) + _attempt(2, 1200.0, 200.0, True),
        mtbp_prior_seconds=3600,
        min_every_seconds=1,
    )
    first = planner.replan("start")
    # This attempt's own checkpoint at the same cost: no change worth a line.
    path = events_dir / event_file_name(3, 0, 0)
    path.write_text("".join(json.dumps(e) + "\n" for e in _attempt(3, 1500.0, 0, False, blocked=0.5)))
    assert planner.replan("after step_30") == first and len(emitted) == 1
    # Checkpoints get 16x dearer: the interval grows about 4x, and the change is logged with its reason.
    with open(path, "a") as handle:
        for step, cost in ((40, 8.0), (50, 8.0), (60, 8.0), (70, 8.0)):
            handle.write(
                json.dumps(
                    {
                        "run_id": "r",
                        "attempt": 3,
                        "node_rank": 0,
                        "rank": 0,
                        "ts": 1500.0 + step,
                        "type": "checkpoint_end",
                        "step": step,
                        "kind": "interval",
                        "blocked_seconds": cost,
                    }
                )
                + "\n"
            )
    second = planner.replan("after step_70")
    assert second > 3 * first and len(emitted) == 2
    assert emitted[1]["reason"] == "after step_70" and emitted[1]["previous_seconds"] == first
    assert "was" in said[-1]


def test_the_floor_and_a_fixed_interval(tmp_path):
    planner, _, emitted = _planner(tmp_path, mtbp_prior_seconds=10)
    assert planner.replan("start") == 60  # skyspot's floor: below a minute other costs dominate
    assert emitted[0]["inputs"]["bound"] == "min_interval"
