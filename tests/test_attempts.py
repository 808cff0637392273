"""How a run's events split into attempts (skyspot/attempts.py), the one reader status, the cost report,
the trainer's preemption rate and the deadline's measurements share."""

from __future__ import annotations

from skyspot.attempts import end_reason, is_spot, split


def ev(ts, type, attempt, **fields):
    return {"ts": float(ts), "run_id": "r", "attempt": attempt, "node_rank": 0,
            "rank": fields.pop("rank", 0), "type": type, **fields}


def test_executor_records_bound_an_attempt_and_say_where_it_ran():
    a, = split([ev(10, "start", 1, where={"cloud": "gcp", "zone": "z"}), ev(0, "attempt_start", 1,
                where={"cloud": "aws", "spot": False}), ev(50, "attempt_end", 1, reason="complete")])
    assert (a.start, a.end, a.reason, a.recorded_end, a.open) == (0, 50, "complete", True, False)
    assert a.where == {"cloud": "aws", "spot": False, "zone": "z"} and not a.spot and a.started


def test_an_attempt_without_an_end_record_before_a_later_one_was_killed_with_its_node():
    killed, last = split([ev(0, "start", 0), ev(40, "step", 0, step=4), ev(60, "start", 1)])
    assert (killed.end, killed.reason, killed.preempted) == (40, "preempted", True)
    assert last.open and last.reason == "unknown"
    assert split([ev(0, "start", 0)], now=90)[0].reason == "running"
    assert split([ev(0, "start", 0)], now=90)[0].end == 90


def test_a_preempted_attempt_ran_until_its_first_notice():
    a, = split([ev(0, "start", 0), ev(30, "signal", 0), ev(20, "preemption_notice", 0),
                ev(45, "exit", 0, reason="sigterm")])
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
    assert [end_reason(w) for w in ("completed", "done", "preempted-fallback-ended", "SIGKILL", "cancelled by user",
                                     "failed", "", "odd")] == [
        "complete", "complete", "preempted", "preempted", "cancelled", "error", "unknown", "odd"]
