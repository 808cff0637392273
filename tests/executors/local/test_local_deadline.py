"""A deadline on the local executor, end to end: real training under torchrun, a real spot outage.

`tiny` starts on spot; 10 s in, the trace takes spot capacity away for good. The policy waits for
spot while the slack lasts, then switches to on-demand (never preempted) and the run ends before
its deadline. Steps are slowed to about 0.3 s (a test fault hook) so the run's timeline has the
shape of a real one: minutes of work, restarts that cost a fraction of the slack. The five shipped
traces are replayed in `python -m bench --only deadline` (docs/benchmarks.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.planning.deadline import DECISION_EVENT
from skyspot.events import read_events_dir
from skyspot.ledger import Ledger

pytestmark = pytest.mark.slow
runner = CliRunner()


def test_spot_gone_for_longer_than_the_slack_switches_to_on_demand_and_meets_the_deadline(tmp_path, monkeypatch):
    monkeypatch.setenv("SKYSPOT_FAULT", "step_end/0:pause=0.25")
    trace = tmp_path / "outage.yaml"
    trace.write_text("unavailable: [[10, 100000]]\nnotice: 2\n")
    result = runner.invoke(
        app,
        [
            "launch",
            "tiny",
            "--local",
            "-n",
            "due",
            "--spot-trace",
            str(trace),
            "--deadline",
            "110s",
            "--grace",
            "60",
            "--provision-delay",
            "1",
            "train.steps=60",
            "checkpoint.every_steps=20",
            "train.log_every=20",
            "resources.step_seconds_hint=0.3",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    run = Ledger().get("due")
    log = read_events_dir(Path(run.run_dir) / "events")
    starts = log.of_type("attempt_start")
    assert [s["where"]["spot"] for s in starts][-1] is False  # it finished on on-demand
    assert starts[0]["where"]["spot"] is True
    # No spot attempt ran during the outage: after the first, only on-demand.
    assert all(s["where"]["spot"] is False for s in starts[1:])
    decisions = log.of_type(DECISION_EVENT)
    for field in ("mode", "reason", "progress", "projected_finish", "deadline", "policy"):
        assert all(field in d for d in decisions if not d.get("switch")), field
    to_on_demand = next(d for d in decisions if d.get("mode") == "on-demand")
    assert to_on_demand["reason"] in ("safety-net", "behind") and to_on_demand["from_mode"] == "idle"
    assert to_on_demand["ts"] < starts[-1]["ts"]

    status = json.loads(runner.invoke(app, ["status", "-a", "--json"]).stdout)
    row = next(r for r in status if r["name"] == "due")
    assert row["status"] == "SUCCEEDED" and row["deadline"]["met"] is True
    assert row["deadline"]["finished_at"] <= run.info["deadline"]["at"]

    report = json.loads(runner.invoke(app, ["cost-report", "due", "--json"]).stdout)[0]["deadline"]
    assert report["met"] is True and report["greedy_usd"] > 0 and report["all_on_demand_usd"] > 0
    assert report["cost_usd"] <= report["all_on_demand_usd"] * 1.5
    text = runner.invoke(app, ["cost-report", "due"]).stdout
    assert "deadline" in text and "all on-demand" in text and "greedy" in text
