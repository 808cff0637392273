"""How a run's events split into attempts (skyspot/attempts.py), the one reader status, the cost report,
the trainer's preemption rate and the deadline's measurements share."""

from __future__ import annotations

import pytest

from skyspot.attempts import CAUSES, cause_of, count_causes, describe_causes, end_reason, is_spot, split
from tests.builders import event as ev


def test_executor_records_bound_an_attempt_and_say_where_it_ran():
    (a,) = split(
        [
            ev(10, "start", 1, where={"cloud": "gcp", "zone": "z"}),
            ev(0, "attempt_start", 1, where={"cloud": "aws", "spot": False}),
            ev(50, "attempt_end", 1, reason="complete"),
        ]
    )
    assert (a.start, a.end, a.reason, a.recorded_end, a.open) == (0, 50, "complete", True, False)
    assert a.where == {"cloud": "aws", "spot": False, "zone": "z"} and not a.spot and a.started


def test_an_attempt_without_an_end_record_before_a_later_one_was_killed_with_its_node():
    killed, last = split([ev(0, "start", 0), ev(40, "step", 0, step=4), ev(60, "start", 1)])
    assert (killed.end, killed.reason, killed.preempted) == (40, "preempted", True)
    assert last.open and last.reason == "unknown"
    assert split([ev(0, "start", 0)], now=90)[0].reason == "running"
    assert split([ev(0, "start", 0)], now=90)[0].end == 90


def test_a_preempted_attempt_ran_until_its_first_notice():
    (a,) = split(
        [ev(0, "start", 0), ev(30, "signal", 0), ev(20, "preemption_notice", 0), ev(45, "exit", 0, reason="sigterm")]
    )
    assert a.preempted and a.notice_at == 20 and a.uptime_s == 20


def test_a_notice_decides_only_when_nothing_says_how_the_attempt_ended():
    assert split([ev(0, "start", 0), ev(5, "signal", 0)])[0].preempted
    assert not split([ev(0, "start", 0), ev(5, "signal", 0), ev(9, "exit", 0, reason="complete")])[0].preempted


def test_a_missing_spot_is_spot_and_a_stated_one_is_read_as_stated():
    assert is_spot({}) and is_spot({"spot": None}) and is_spot(None)
    assert is_spot({"spot": "Spot"}) and is_spot({"spot": True})
    assert not is_spot({"spot": False}) and not is_spot({"spot": "unknown"}) and not is_spot({"spot": "false"})


def test_deadline_decisions_belong_to_no_attempt():
    attempts = split([ev(0, "start", 1), {"ts": 5.0, "type": "deadline_decision", "attempt": 2, "mode": "spot"}])
    assert [a.number for a in attempts] == [1]


def test_end_words_map_onto_one_list():
    assert [
        end_reason(w)
        for w in ("completed", "done", "preempted-fallback-ended", "SIGKILL", "cancelled by user", "failed", "", "odd")
    ] == ["complete", "complete", "preempted", "preempted", "cancelled", "error", "unknown", "unknown"]
    assert end_reason("switched") == "switched" and end_reason("setup_failed") == "setup_failed"


# --------------------------------------------------------------------------- why an attempt ended
# Shapes copied from a real run: `skyspot launch tiny --local --simulate aws --notice 1 --preempt-at-steps 20
# train.steps=200` (and --simulate gcp, azure), its events/attempt-1.*.jsonl, times made relative.

WHERE = {
    "cloud": "aws",
    "region": "us-east-1",
    "zone": "us-east-1a",
    "instance_type": "g5.48xlarge",
    "spot": True,
    "num_nodes": 1,
}


def executor(ts, type, attempt, **fields):
    return ev(ts, type, attempt, rank=None, **fields)


def preempted_attempt(attempt=1, t=0.0, source="aws", action="terminate", sigterm_seen=False):
    """The local executor's simulated spot preemption, as the trainer and the executor log it."""
    events = [
        executor(t, "attempt_start", attempt, where={**WHERE, "accelerators": None, "simulated": True}),
        ev(t + 5.5, "start", attempt, where=WHERE, world_size=2, total_steps=200, recipe="tiny", pid=5272),
        ev(t + 13.0, "step", attempt, step=21, loss=3.38, step_seconds=0.08, samples=168, tokens=10752),
        executor(t + 16.3, "preempt_notice_sent", attempt, deadline=t + 17.3, step=21),
        ev(t + 16.5, "preemption_notice", attempt, source=source, deadline=t + 17.0, action=action, received=t + 16.48),
        ev(
            t + 16.6,
            "emergency_checkpoint",
            attempt,
            step=24,
            signal_to_commit_seconds=0.11,
            durable_before_deadline=None,
            newest_durable_step=None,
        ),
        ev(
            t + 16.6,
            "exit",
            attempt,
            code=75,
            reason="preempted: emergency checkpoint step_24 committed",
            step=24,
            meaning="preempted: emergency checkpoint committed, recover me",
        ),
        executor(t + 17.3, "preempt_sigterm", attempt),
        executor(t + 18.5, "attempt_end", attempt, code=75, reason="preempted", node_codes=[75]),
    ]
    if sigterm_seen:  # GCP: SIGTERM comes with the notice, and the trainer logs it
        events.insert(5, ev(t + 16.55, "signal", attempt, signum=15, name="SIGTERM", received=t + 16.54))
    return events


def completed_attempt(attempt=2, t=100.0):
    return [
        executor(t, "attempt_start", attempt, where=WHERE),
        ev(t + 5, "start", attempt, where=WHERE, world_size=2, total_steps=200, recipe="tiny", pid=7),
        ev(t + 6, "resume", attempt, step=24, checkpoint="step_24", source="local", load_seconds=0.2),
        ev(t + 20, "exit", attempt, code=0, reason="training complete", step=200),
        executor(t + 21, "attempt_end", attempt, code=0, reason="complete", node_codes=[0]),
    ]


def causes(events, now=None):
    return [(a.cause, a.cloud_cause) for a in split(events, now=now)]


@pytest.mark.parametrize(
    "source, action, sigterm_seen, cloud_name",
    [
        ("aws", "terminate", False, "terminate"),
        ("aws", "hibernate", False, "hibernate"),
        ("gcp", "preempt", True, "preempted"),
        ("azure", "preempt", False, "Preempt"),
    ],
)
def test_a_spot_preemption_says_so_with_the_clouds_own_word(source, action, sigterm_seen, cloud_name):
    events = preempted_attempt(source=source, action=action, sigterm_seen=sigterm_seen) + completed_attempt()
    assert causes(events) == [("spot-preemption", cloud_name), (None, None)]


@pytest.mark.parametrize(
    "source, action, cloud_name",
    [
        ("gcp", "maintenance", "TERMINATE_ON_HOST_MAINTENANCE"),
        ("aws", "system-reboot", "system-reboot"),
        ("aws", "instance-retirement", "instance-retirement"),
        ("azure", "reboot", "Reboot"),
        ("azure", "redeploy", "Redeploy"),
        ("azure", "terminate", "Terminate"),
    ],
)
def test_a_planned_shutdown_is_planned_maintenance_not_a_spot_preemption(source, action, cloud_name):
    # The trainer turns a planned shutdown into a `preemption_notice` whose action names it (docs/notices.md);
    # Azure's `terminate` is planned, AWS's `terminate` (instance-action) is a spot interruption.
    trainer_only = [e for e in preempted_attempt(source=source, action=action) if e["rank"] is not None]
    assert causes(trainer_only + completed_attempt()) == [("planned-maintenance", cloud_name), (None, None)]


def test_a_warning_that_came_alone_names_the_ending_unless_the_vm_lives_through_it():
    def warned(action, source="aws"):
        return [
            ev(0, "start", 0, where=WHERE),
            ev(5, "shutdown_warning", 0, source=source, deadline=None, action=action, received=4.9),
            ev(40, "signal", 0, signum=15, name="SIGTERM", received=40),
            ev(41, "exit", 0, code=75, reason="preempted: emergency checkpoint step_9 committed", step=9),
            ev(100, "start", 1, where=WHERE),
        ]

    assert causes(warned("rebalance"))[0] == ("rebalance", None)
    assert causes(warned("maintenance", "gcp"))[0] == ("planned-maintenance", "TERMINATE_ON_HOST_MAINTENANCE")
    # Freeze, live migration and AWS system-maintenance end nothing: the SIGTERM did.
    assert causes(warned("freeze", "azure"))[0] == ("sigterm", None)
    assert causes(warned("migrate", "gcp"))[0] == ("sigterm", None)
    assert causes(warned("system-maintenance"))[0] == ("sigterm", None)


def test_a_sigterm_without_notice_and_a_node_that_vanished_are_told_apart():
    events = [
        ev(0, "start", 0, where=WHERE),
        ev(30, "signal", 0, signum=15, name="SIGTERM", received=30),
        ev(31, "exit", 0, code=75, reason="preempted: emergency checkpoint step_3 committed", step=3),
        ev(60, "start", 1, where=WHERE),
        ev(70, "step", 1, step=4, step_seconds=1.0),  # then gone
        ev(90, "start", 2, where=WHERE),
        ev(95, "signal", 2, signum=10, name="SIGUSR1", received=95),
        ev(96, "exit", 2, code=75, reason="preempted", step=5),
        ev(120, "start", 3, where=WHERE),
    ]
    assert causes(events) == [("sigterm", None), ("node-lost", None), ("signal", None), (None, None)]
    assert causes(events, now=200)[-1] == (None, None)  # running: not ended, no cause


def test_what_the_executor_recorded_wins_over_the_signal_it_sent():
    sigterm = ev(10, "signal", 1, signum=15, name="SIGTERM", received=10)
    for said, cause in (("cancelled", "cancelled"), ("switched", "deadline-switch"), ("setup_failed", "setup-failed")):
        events = [
            executor(0, "attempt_start", 1, where=WHERE),
            sigterm,
            executor(12, "attempt_end", 1, code=75 if said == "switched" else 1, reason=said, node_codes=[1]),
        ]
        assert causes(events) == [(cause, None)], said
    failed = [
        executor(0, "attempt_start", 1, where=WHERE),
        ev(5, "exit", 1, code=1, reason="RuntimeError: boom"),
        executor(6, "attempt_end", 1, code=1, reason="error", node_codes=[1], cause="RuntimeError: boom"),
    ]
    assert causes(failed) == [("error", None)]


def test_a_deadline_controller_switch_on_skypilot_names_the_sigterm_it_caused():
    # On SkyPilot the controller cancels the spot stage (SIGTERM to the trainer) when it decides on-demand.
    decision = {
        "ts": 40.0,
        "run_id": "r",
        "attempt": 1,
        "node_rank": 0,
        "rank": None,
        "type": "deadline_decision",
        "mode": "on-demand",
        "from_mode": "spot",
        "reason": "safety-net",
    }
    between = {**decision, "ts": 80.0, "mode": "spot", "from_mode": "idle", "reason": "spot"}
    events = [
        ev(0, "start", 1, where=WHERE),
        decision,
        ev(45, "signal", 1, signum=15, name="SIGTERM", received=45),
        ev(46, "exit", 1, code=75, reason="preempted: emergency checkpoint step_30 committed", step=30),
        between,
        ev(90, "start", 2, where={**WHERE, "spot": False}),
        ev(95, "signal", 2, signum=15, name="SIGTERM"),
        ev(96, "exit", 2, code=75, reason="preempted"),
        ev(99, "start", 3, where=WHERE),
    ]
    assert causes(events) == [("deadline-switch", None), ("sigterm", None), (None, None)]


def test_odd_notice_fields_still_give_a_cause():
    events = [
        ev(0, "start", 0),
        ev(5, "preemption_notice", 0, source=None, action=["terminate"]),
        ev(6, "exit", 0, code=75, reason="preempted"),
    ]
    assert causes(events) == [("spot-preemption", None)]


def test_a_last_attempt_only_the_queue_record_ends_gets_the_queues_cause():
    (open_attempt,) = split([ev(0, "start", 0, where=WHERE), ev(9, "step", 0, step=1)])
    assert cause_of(open_attempt) == (None, None)
    assert cause_of(open_attempt, reason="error", queue_status="FAILED_SETUP") == ("setup-failed", None)
    assert cause_of(open_attempt, reason="cancelled", queue_status="CANCELLED") == ("cancelled", None)
    assert cause_of(open_attempt, reason="error", queue_status="FAILED") == ("error", None)
    assert cause_of(open_attempt, reason="complete", queue_status="SUCCEEDED") == (None, None)


def test_interruptions_are_counted_by_cause_and_said_in_words():
    attempts = (
        preempted_attempt(0, 0)
        + preempted_attempt(1, 100, "gcp", "preempt")
        + preempted_attempt(2, 200, "gcp", "maintenance")
        + completed_attempt(3, 300)
    )
    counts = count_causes(split(attempts))
    assert counts == {"spot-preemption": 2, "planned-maintenance": 1} and list(counts)[0] == "spot-preemption"
    assert describe_causes(counts) == "2 spot preemptions, 1 planned maintenance"
    assert describe_causes({"rebalance": 1, "sigterm": 3}) == "1 rebalance recommendation, 3 SIGTERMs without notice"
    assert describe_causes({}) == "" and set(CAUSES) >= {
        "spot-preemption",
        "planned-maintenance",
        "rebalance",
        "sigterm",
        "deadline-switch",
        "cancelled",
        "error",
        "setup-failed",
        "node-lost",
    }
