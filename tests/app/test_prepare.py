"""app.launch.prepare: every check a launch makes, once, for every kind of run (issue 33); the executor
builds its own options from the launch's raw flags, so neither the CLI nor app/ knows LocalOptions."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from skyspot.app.launch import LaunchRequest, prepare
from skyspot.cli.main import app
from skyspot.errors import UsageError
from skyspot.ledger import Ledger

runner = CliRunner()


def test_a_local_launch_gets_its_options_from_the_executor_and_records_nothing():
    prepared = prepare(
        LaunchRequest(
            recipe="tiny",
            local=True,
            dry_run=True,
            executor_flags={
                "preempt_at_steps": "7,3",
                "simulate": "gcp",
                "crash_at_steps": "5:0.1",
                "provision_delay": 4.0,
            },
        )
    )
    options = prepared.executor.options
    assert options.preempt_at_steps == [3, 7] and options.cloud == "gcp" and options.provision_delay == 4.0
    assert [(f["action"], f["step"], f["node"], f["local_rank"]) for f in options.rank_faults] == [("crash", 5, 0, 1)]
    assert prepared.question is None and prepared.built.run_name is None
    with Ledger() as ledger:
        assert ledger.runs(include_finished=True) == []


@pytest.mark.parametrize(
    "flags, said",
    [
        ({"preempt_every": 5.0}, "--preempt-every inject(s) faults into a local run: add --local"),
        ({"fresh_node": True}, "--fresh-node is for local runs: add --local"),
    ],
)
def test_a_cloud_launch_refuses_the_local_executor_s_flags(flags, said):
    with pytest.raises(UsageError, match=said.replace("(", r"\(").replace(")", r"\)")):
        prepare(LaunchRequest(recipe="llama8b", local=False, dry_run=True, executor_flags=flags))


def test_a_local_flag_that_does_not_fit_the_recipe_is_refused_by_the_executor():
    with pytest.raises(UsageError, match="--crash-at-steps: node 3 of a run on 1 node"):
        prepare(LaunchRequest(recipe="tiny", local=True, dry_run=True, executor_flags={"crash_at_steps": "4:3"}))


def test_a_dry_run_makes_the_preflight_checks_that_need_no_network(tmp_path):
    """Issue 31, item 13: `--dry-run` skipped preflight, so a missing held-out file passed."""
    source = tmp_path / "train.jsonl"
    source.write_text(json.dumps({"text": "hello world"}) + "\n")
    args = ["launch", "tiny", "--local", "--dry-run", f"data.source={source}", "data.format=text"]
    ok = runner.invoke(app, args)
    assert ok.exit_code == 0, ok.output
    missing = runner.invoke(app, args + [f"data.eval_split={tmp_path / 'held-out.jsonl'}"])
    assert missing.exit_code == 2
    assert "data.eval_split" in missing.output and "is not an existing file" in missing.output
    assert "Traceback" not in missing.output
