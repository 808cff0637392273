"""`skyspot launch tiny --local --rehearse` as a user runs it: each rehearsal on a fresh node (slow).

A fresh node (executors/local/fresh_node.py) starts from a bare interpreter: the task's setup installs
skyspot's wheel and its stack from the index (about 3 GB on a cold cache, minutes), then the rehearsal
trains the tiny model for 5 steps and does its store round trip. aws's setup is made to fail by the local
executor's hook (SKYSPOT_TEST_FAIL_SETUP), so the table has one failure and one success, and the next
launch's dry run leaves aws out until --force. tests/app/test_rehearse.py does the same quickly, without
fresh nodes.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skyspot.app import rehearsal_record
from skyspot.cli.main import app
from skyspot.ledger import Ledger

pytestmark = pytest.mark.slow
runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


def test_a_fresh_node_rehearsal_prints_the_table_with_cost_and_the_failed_candidate_is_skipped(monkeypatch):
    monkeypatch.setenv("SKYSPOT_TEST_FAIL_SETUP", "aws")
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the controller's own imports: this checkout's skyspot
    result = runner.invoke(
        app, ["launch", "tiny", "--local", "--rehearse", "-d", "--clouds", "aws,gcp", "train.steps=2"]
    )
    try:
        print(result.output)
        assert result.exit_code == 0, result.output
        records = rehearsal_record.read()
        aws = records[rehearsal_record.Key("aws", "default", "CPU")]
        gcp = records[rehearsal_record.Key("gcp", "default", "CPU")]
        assert not aws.ok and aws.line.startswith("FAILED_SETUP")
        assert gcp.ok and gcp.line == "works" and gcp.cost_usd and gcp.cost_usd > 0, gcp
        with Ledger() as ledger:
            log = Path(ledger.get(gcp.run).info["log"]).read_text()
        assert "setup on the fresh node" in log and "store round trip ok" in log
        assert any(line.startswith("│ gcp") and "works" in line and "$" in line for line in result.output.splitlines())
        dry = runner.invoke(app, ["launch", "tiny", "--dry-run", "--clouds", "aws,gcp"])
        assert dry.exit_code == 0 and "aws any CPU spot: rehearsal failed" in dry.output
        assert "cloud: aws" not in dry.stdout
        forced = runner.invoke(app, ["launch", "tiny", "--dry-run", "--clouds", "aws,gcp", "--force"])
        assert forced.exit_code == 0 and "cloud: aws" in forced.stdout
    finally:
        give_up = time.monotonic() + 600
        while time.monotonic() < give_up:
            with Ledger() as ledger:
                if all(run.terminal for run in ledger.runs()):
                    break
            time.sleep(1)
