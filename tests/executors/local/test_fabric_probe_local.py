"""The fabric probe on a local 2-node run (one rank per node, gloo over loopback): the `fabric` event
records its bus bandwidth and transport on every node, `status` and `cost-report` show them, and
`fabric.require=best` refuses the start on gloo in one line with exit 2, which the local executor does not
retry (executors/local/controller.py NOT_RETRIED)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.events import read_events_dir
from skyspot.ledger import Ledger
from tests.conftest import REPO

pytestmark = pytest.mark.slow
runner = CliRunner()
TWO_NODES = ["train.steps=2", "resources.num_nodes=2", "resources.cpu_ranks=1"]


@pytest.fixture(autouse=True)
def this_checkout(monkeypatch):
    """The trainer processes import this checkout's skyspot (as tests/trainer/launch.py has them do)."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))


def _fabric_events(name: str) -> list[dict]:
    """Every simulated node's `fabric` events: node 0 writes in the run root, node k in nodes/node-k."""
    base = Path(Ledger().get(name).run_dir)
    dirs = [base / "events", *sorted((base / "nodes").glob("node-*/events"))]
    return [e for d in dirs if d.is_dir() for e in read_events_dir(d).events if e["type"] == "fabric"]


def test_a_two_node_run_records_the_probe_and_status_and_cost_report_show_it():
    result = runner.invoke(app, ["launch", "tiny", "--local", "-n", "probed", *TWO_NODES], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    events = _fabric_events("probed")
    assert sorted(e["node_rank"] for e in events) == [0, 1]
    for e in events:
        assert e["transport"] == "gloo" and e["busbw_gbps"] > 0 and e["probe_bytes"] == 4 << 20
        assert e["probe_iters"] >= 1 and e["on_sockets"] is True and e["require"] == "warn"
    status = runner.invoke(app, ["status", "--json", "-a"])
    (row,) = [r for r in json.loads(status.stdout) if r["name"] == "probed"]
    assert row["fabric"]["transport"] == "gloo" and row["fabric"]["busbw_gbps"] == min(e["busbw_gbps"] for e in events)
    text = runner.invoke(app, ["status", "-a"])
    assert "FABRIC" in text.stdout and f"gloo {row['fabric']['busbw_gbps']:.3g} GB/s" in text.stdout
    report = runner.invoke(app, ["cost-report", "probed", "--json"])
    assert report.exit_code == 0, report.output
    assert "busbw_gbps" in report.stdout and '"transport": "gloo"' in report.stdout


def test_require_best_refuses_a_start_on_gloo_in_one_line_with_exit_2():
    result = runner.invoke(
        app, ["launch", "tiny", "--local", "-n", "refused", *TWO_NODES, "fabric.require=best"], catch_exceptions=False
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if "fabric.require=best: the fabric between 2 nodes" in line]
    assert lines and all("plain TCP (gloo): measured " in line and "GB/s bus bandwidth" in line for line in lines)
    assert "attempt 2" not in result.output  # not retried: a usage-class ending
    run = Ledger().get("refused")
    assert run.status.startswith("FAILED") and run.exit_code == 2
    assert any(e.get("refused") for e in _fabric_events("refused"))
