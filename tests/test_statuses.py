"""A run's status is SkyPilot's, with SkyPilot's behaviour: every ManagedJobStatus member maps, and
is_terminal / is_failed agree with SkyPilot's own for each (sky/jobs/state.py, the installed package)."""

from __future__ import annotations

import json

import pytest
from sky.jobs.state import ManagedJobStatus

from skyspot.attempts import Attempt, cause_of, end_of_status
from skyspot.events import EventLog
from skyspot.pricing import cost
from skyspot.statuses import TERMINAL, RunStatus


@pytest.mark.parametrize("sky_status", list(ManagedJobStatus), ids=lambda s: s.name)
def test_every_sky_status_maps_and_agrees_with_skypilot(sky_status):
    for given in (sky_status, sky_status.value, sky_status.name):
        ours = RunStatus.from_sky(given)
        assert ours is not None and ours == sky_status.value
        assert ours.is_terminal() is sky_status.is_terminal()
        assert ours.is_failed() is sky_status.is_failed()


def test_every_status_of_ours_is_skypilots():
    assert {s.value for s in RunStatus} == {s.value for s in ManagedJobStatus}


@pytest.mark.parametrize("unlisted", ["FAILED_QUOTA", "failed_future_reason"])
def test_an_unlisted_failed_status_is_failed(unlisted):
    assert RunStatus.from_sky(unlisted) is RunStatus.FAILED
    assert end_of_status(unlisted) == "error"


@pytest.mark.parametrize("odd", ["", None, "SOMETHING_NEW", 7, "FAILED"[:4]])
def test_an_unknown_status_is_none_and_ends_unknown(odd):
    assert RunStatus.from_sky(odd) is None
    assert end_of_status(odd) == "unknown"


def test_members_are_their_strings():
    assert RunStatus.FAILED_SETUP == "FAILED_SETUP" and "RUNNING" in {RunStatus.RUNNING}
    assert {"SUCCEEDED": 1}[RunStatus.SUCCEEDED] == 1 and f"{RunStatus.CANCELLED}" == "CANCELLED"
    assert json.dumps({"status": RunStatus.RECOVERING}) == '{"status": "RECOVERING"}'
    assert "FAILED_CONTROLLER" in TERMINAL and "RUNNING" not in TERMINAL


def _open_attempt() -> Attempt:
    return Attempt(
        number=0,
        events=[{"ts": 1.0, "type": "start", "attempt": 0, "rank": 0}],
        where={},
        spot=True,
        start=1.0,
        started=True,
        end=1.0,
        reason="unknown",
        recorded_end=False,
        open=True,
        notice_at=None,
    )


def test_an_unlisted_failed_status_is_an_error_in_both_the_causes_and_the_cost_report():
    assert cause_of(_open_attempt(), reason=end_of_status("FAILED_QUOTA"), queue_status="FAILED_QUOTA") == (
        "error",
        None,
    )
    log = EventLog(
        events=[
            {
                "ts": 1000.0,
                "type": "start",
                "attempt": 0,
                "node_rank": 0,
                "rank": 0,
                "run_id": "r",
                "where": {
                    "cloud": "aws",
                    "region": "us-east-1",
                    "instance_type": "p4d.24xlarge",
                    "spot": True,
                    "num_nodes": 1,
                },
            }
        ]
    )
    for status, ended, why in (
        ("FAILED_QUOTA", "error", "error"),
        ("FAILED", "error", "error"),
        ("FAILED_SETUP", "error", "setup-failed"),
        ("CANCELLED", "cancelled", "cancelled"),
        ("SUCCEEDED", "complete", None),
    ):
        report = cost.run_cost(log, queue_record={"status": status, "end_at": 4600.0})
        assert (report.attempts[0].end_reason, report.attempts[0].cause) == (ended, why), status
        assert report.attempts[0].end == 4600.0


def test_has_ended_reads_what_skypilot_reports_and_a_newer_failure_ends_the_wait():
    from skyspot.statuses import has_ended

    assert has_ended("SUCCEEDED") and has_ended("failed_setup") and has_ended("FAILED_SOMETHING_NEWER")
    assert not has_ended("RUNNING") and not has_ended("RECOVERING") and not has_ended(None)
    assert not has_ended("WHATEVER")  # unknown: asked again, not taken for an end


def test_the_status_view_names_each_failed_run_with_a_cause_and_nothing_else():
    from skyspot.app.runs import StatusView

    rows = [
        {"name": "a", "status": "FAILED_SETUP", "cause": "no GPU driver"},
        {"name": "b", "status": "FAILED_NEWER", "cause": "quota"},
        {"name": "c", "status": "FAILED", "cause": None},
        {"name": "d", "status": "CANCELLED", "cause": "by you"},
        {"name": "e", "status": "RUNNING", "cause": "FAILED once"},
    ]
    assert StatusView(rows=rows).failures == ["a FAILED_SETUP: no GPU driver", "b FAILED_NEWER: quota"]
