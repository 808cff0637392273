"""The ledger's named changes: each one read-modify-write in one transaction, so writers that meet on a
run (the controller, a `cancel`, a `status` refresh) never lose one another's update."""

from __future__ import annotations

import threading

import pytest

from skyspot.ledger import Ledger

ROUNDS = 150


@pytest.fixture
def ledger_path(tmp_path):
    path = tmp_path / "ledger.db"
    with Ledger(path) as ledger:
        ledger.add("run-1", "tiny", "local", total_steps=10, num_nodes=1, info={"candidates": ["aws"]})
    return path


def _together(path, writers) -> None:
    """Run each writer on its own thread with its own connection, as separate commands would, all at once."""
    start = threading.Barrier(len(writers))
    failures: list[BaseException] = []

    def run(writer):
        try:
            with Ledger(path) as ledger:
                start.wait()
                for i in range(ROUNDS):
                    writer(ledger, i)
        except BaseException as error:  # surfaced below: a thread's assertion must fail the test
            failures.append(error)

    threads = [threading.Thread(target=run, args=(writer,)) for writer in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not failures, failures
    assert not any(thread.is_alive() for thread in threads)


def test_concurrent_writers_lose_no_info_key(ledger_path):
    def controller(ledger, i):
        ledger.record_attempt("run-1", i, {"cloud": "aws", "attempt": i}, controller_pid=1000, preemptions=i)
        ledger.set_activity("run-1", f"attempt {i} running", preemptions=i)

    def cancel(ledger, i):
        ledger.set_cancelling("run-1")
        ledger.merge_info("run-1", cancel_requests=i)

    def status_refresh(ledger, i):
        ledger.cache_summary("run-1", {"status": "RUNNING", "round": i}, f"sig-{i}")

    def tagger(key):
        return lambda ledger, i: ledger.merge_info("run-1", **{key: i})

    _together(ledger_path, [controller, cancel, status_refresh, tagger("note_a"), tagger("note_b")])
    with Ledger(ledger_path) as ledger:
        info = ledger.get("run-1").info
    last = ROUNDS - 1
    assert {
        key: info.get(key)
        for key in (
            "attempt",
            "preemptions",
            "activity",
            "cancel_requests",
            "summary_of",
            "note_a",
            "note_b",
            "candidates",
        )
    } == {
        "attempt": last,
        "preemptions": last,
        "activity": f"attempt {last} running",
        "cancel_requests": last,
        "summary_of": f"sig-{last}",
        "note_a": last,
        "note_b": last,
        "candidates": ["aws"],
    }
    assert info["where"] == {"cloud": "aws", "attempt": last} and info["summary"]["round"] == last


def test_a_cancel_meeting_the_runs_end_leaves_the_end(ledger_path):
    names = [f"run-{i}" for i in range(2, 2 + ROUNDS)]
    with Ledger(ledger_path) as ledger:
        for name in names:
            ledger.add(name, "tiny", "local", status="RUNNING")

    def controller(ledger, i):
        ledger.set_finished(names[i], "SUCCEEDED", exit_code=0, cause=None)

    def cancel(ledger, i):
        ledger.set_cancelling(names[i])
        ledger.set_cancelled(names[i], unless_ended=True)

    def refresh(ledger, i):
        ledger.merge_info(names[i], seen=True)

    _together(ledger_path, [controller, cancel, refresh])
    with Ledger(ledger_path) as ledger:
        runs = [ledger.get(name) for name in names]
    # Either the cancel came first (CANCELLED, then the controller's own end) or the end came first and the
    # cancel left it: the controller's ending is always the last word, and no info key went missing.
    assert {run.status for run in runs} == {"SUCCEEDED"}
    assert all(run.exit_code == 0 and run.ended_at and run.info.get("seen") is True for run in runs)


def test_changes_that_spare_an_ended_run(ledger_path):
    with Ledger(ledger_path) as ledger:
        ledger.set_finished("run-1", "SUCCEEDED", exit_code=0, cause=None)
        assert ledger.set_cancelling("run-1") is False
        assert ledger.set_cancelled("run-1", unless_ended=True) is False
        assert ledger.set_controller_gone("run-1", "gone") is False
        assert ledger.set_status("run-1", "RUNNING", unless_ended=True) is False
        run = ledger.get("run-1")
        assert (run.status, run.exit_code, run.info.get("cause")) == ("SUCCEEDED", 0, None)


def test_a_resume_clears_the_end_and_keeps_the_earlier_jobs(ledger_path):
    with Ledger(ledger_path) as ledger:
        ledger.set_job("run-1", 7)
        ledger.set_finished("run-1", "FAILED", exit_code=1, cause="boom")
        assert ledger.get("run-1").ended_at is not None
        ledger.set_resumed("run-1", previous_job_id=7, task={"run": "x"})
        ledger.set_job("run-1", 8)
        ledger.set_finished("run-1", "CANCELLED", exit_code=None)
        ledger.set_resumed("run-1", previous_job_id=8)
        run = ledger.get("run-1")
    assert (run.status, run.ended_at, run.exit_code, run.job_id) == ("PENDING", None, None, 8)
    assert run.info["previous_job_ids"] == [7, 8] and run.info["task"] == {"run": "x"}
    assert run.info["cause"] == "boom" and run.info["candidates"] == ["aws"]


def test_the_controller_gone_is_marked_once_with_why(ledger_path):
    with Ledger(ledger_path) as ledger:
        ledger.set_status("run-1", "RUNNING")
        assert ledger.set_controller_gone("run-1", "killed") is True
        assert ledger.set_controller_gone("run-1", "again") is False
        run = ledger.get("run-1")
    assert (run.status, run.info["cause"], run.terminal) == ("FAILED_CONTROLLER", "killed", True)


def test_unknown_status_and_non_endings_are_refused(ledger_path):
    with Ledger(ledger_path) as ledger:
        with pytest.raises(ValueError):
            ledger.set_status("run-1", "DONE")
        with pytest.raises(ValueError):
            ledger.set_finished("run-1", "RUNNING", exit_code=0)
        assert ledger.get("run-1").status == "PENDING"


def test_every_status_skypilot_reports_is_recorded_and_its_end_is_known(ledger_path):
    """The ledger takes SkyPilot's statuses from skyspot.statuses: a list of its own once lacked WINDING_DOWN."""
    from skyspot.statuses import RunStatus

    with Ledger(ledger_path) as ledger:
        for status in RunStatus:
            assert ledger.set_status("run-1", status) is True
            run = ledger.get("run-1")
            assert run.status == status and run.terminal == status.is_terminal()
        with pytest.raises(ValueError):
            ledger.set_status("run-1", "NOT_A_STATUS")
