"""Training through a preemption notice's window, end to end on the local executor.

A 30 s notice (AWS's instance-action through the loopback metadata server), SIGTERM at its
deadline as the controller does: the trainer keeps training after the notice while its own
measured save time still fits, commits (and makes durable in the store) its emergency checkpoint
before the deadline, so before SIGTERM, and the next attempt resumes at exactly that step.
Steps are slowed to about 1.6 s (a pause at each step's end, which changes no arithmetic) so the
window holds a dozen of them; the run ends bitwise equal to the shared uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.events import read_events_dir
from skyspot.ledger import Ledger
from tests.conftest import REFERENCE_STEPS
from tests.reliability.conftest import same_params

pytestmark = pytest.mark.slow
runner = CliRunner()


def test_a_30s_notice_is_trained_through_and_saved_before_sigterm(reference, tmp_path, monkeypatch):
    monkeypatch.setenv("SKYSPOT_FAULT", "step_end:pause=1.5")
    result = runner.invoke(
        app,
        [
            "launch",
            "tiny",
            "--local",
            "-n",
            "window",
            "--preempt-at-steps",
            "4",
            "--notice",
            "30",
            "--grace",
            "60",
            "--provision-delay",
            "0.5",
            "--store",
            str(tmp_path / "store"),
            f"train.steps={REFERENCE_STEPS}",
            "checkpoint.every_steps=2",
            "train.log_every=4",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    run_dir = Path(Ledger().get("window").run_dir)
    log = read_events_dir(run_dir / "events")
    first = [e for e in log.events if e.get("attempt") == 1]
    sent = next(e for e in first if e["type"] == "preempt_notice_sent")
    emergency = next(e for e in first if e["type"] == "emergency_checkpoint" and e.get("rank") == 0)
    window = next(e for e in first if e["type"] == "notice_window" and e.get("rank") == 0)
    # Training went on after the notice, and the checkpoint was durable before the deadline ...
    assert emergency["steps_after_notice"] >= 3 and emergency["step"] > window["step"]
    assert emergency["signaled"] is False and emergency["durable_before_deadline"] is True
    assert emergency["ts"] < sent["deadline"] and emergency["slack_seconds"] > 0
    assert 0 < emergency["trained_after_notice_seconds"] < emergency["window_seconds"] <= 30
    # ... before the controller's SIGTERM (if the trainer's teardown is slower than the slack on a loaded
    # machine, SIGTERM may still find it exiting: harmless, the checkpoint is safe), asking for recovery.
    late = [e for e in first if e["type"] in ("signal", "preempt_sigterm")]
    assert all(e["ts"] > emergency["ts"] for e in late), (emergency, late)
    assert next(e for e in first if e["type"] == "attempt_end")["code"] == 75
    # Nothing was lost: the next attempt resumes at the emergency step, and the end is bitwise the same.
    resumed = next(e for e in log.events if e.get("attempt") == 2 and e["type"] == "resume" and e.get("rank") == 0)
    assert resumed["step"] == emergency["step"]
    assert not same_params(run_dir, reference)
