"""The local executor end to end: real DeepSpeed training under torchrun, real injected preemptions.

`tiny` is launched through the CLI with preemption notices at chosen steps. Each notice
goes through the simulated cloud's metadata endpoint (a loopback server) to the trainer's
watcher, which makes all ranks write an emergency checkpoint together and exit with the
recover code; the executor provisions a replacement and the next attempt resumes. The
result must equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.events import read_events_dir
from skyspot.ledger import Ledger

pytestmark = pytest.mark.slow
runner = CliRunner()

STEPS = 24
# Small, fast and exact: interval checkpoints every 10 steps, so an emergency checkpoint is what saves the work.
OVERRIDES = [f"train.steps={STEPS}", "checkpoint.every_steps=10", "train.log_every=4"]
FAST = ["--notice", "4", "--grace", "60", "--provision-delay", "0.5"]


def final_params(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted((run_dir / "final").glob("*.safetensors")):
        tensors.update(load_file(path))
    assert tensors, f"no final model in {run_dir}"
    return tensors


def launch(*args: str) -> "object":
    return runner.invoke(app, ["launch", "tiny", "--local", *args], catch_exceptions=False)


def status_rows() -> dict:
    result = runner.invoke(app, ["status", "--json", "-a"])
    assert result.exit_code == 0, result.output
    return {row["name"]: row for row in json.loads(result.stdout)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted local run of the same recipe and overrides (its own SKYSPOT_HOME)."""
    home = tmp_path_factory.mktemp("reference-home")
    env = {**os.environ, "SKYSPOT_HOME": str(home), "NO_COLOR": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("SKYPILOT_")}
    done = subprocess.run([sys.executable, "-m", "skyspot.cli.main", "launch", "tiny", "--local", "-n", "reference",
                           *OVERRIDES], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return home / "runs" / "reference"


def assert_same_params(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs after preemptions"


def check_preempted_run(name: str, reference_dir: Path, preempt_steps: list[int]) -> None:
    run = Ledger().get(name)
    run_dir = Path(run.run_dir)
    row = status_rows()[name]
    assert row["status"] == "SUCCEEDED"
    assert row["recoveries"] == len(preempt_steps)
    assert (row["step"], row["total_steps"]) == (STEPS, STEPS)
    log = read_events_dir(run_dir / "events")
    assert log.malformed == 0
    sent = log.of_type("preempt_notice_sent")
    assert [e["step"] >= s for e, s in zip(sent, preempt_steps)] == [True] * len(preempt_steps)
    # Each emergency checkpoint is at the step the trainer had reached when the notice arrived
    # (the step in flight completes first), and the next attempt resumes exactly there.
    for attempt in range(1, len(preempt_steps) + 1):
        events = [e for e in log.events if e.get("attempt") == attempt]
        notice = next(e for e in events if e["type"] == "preemption_notice" and e.get("rank") == 0)
        steps_before = [e["step"] for e in events if e["type"] == "step" and e["ts"] <= notice["ts"]]
        emergency = next(e for e in events if e["type"] == "emergency_checkpoint" and e.get("rank") == 0)
        assert emergency["step"] - max(steps_before) in (0, 1)
        resumed = next(e for e in log.events if e.get("attempt") == attempt + 1 and e["type"] == "resume"
                       and e.get("rank") == 0)
        assert resumed["step"] == emergency["step"]
    assert_same_params(final_params(run_dir), final_params(reference_dir))
    # The cost report counts exactly the injected preemptions.
    report = runner.invoke(app, ["cost-report", name, "--json"])
    assert report.exit_code == 0, report.output
    data = json.loads(report.stdout)[0]
    assert data["preemptions"] == len(preempt_steps) and data["lost_steps"] == 0 and data["simulated"] is True


def test_two_preemptions_recover_to_the_uninterrupted_result(reference):
    result = launch("-n", "spotty", "--preempt-at-steps", "6,15", *FAST, *OVERRIDES)
    assert result.exit_code == 0, result.output
    check_preempted_run("spotty", reference, [6, 15])


def test_two_nodes_recover_to_the_uninterrupted_result(reference):
    result = launch("-n", "two-nodes", "--preempt-at-steps", "6,15", *FAST, *OVERRIDES,
                    "resources.num_nodes=2", "resources.cpu_ranks=1")
    assert result.exit_code == 0, result.output
    assert "(node-1)" in (Path(Ledger().get("two-nodes").run_dir) / "logs" / "run.log").read_text()
    check_preempted_run("two-nodes", reference, [6, 15])


def test_detached_concurrent_runs_logs_follow_and_cancel():
    first = launch("-d", "-n", "left", *OVERRIDES, "train.steps=100000")  # runs until cancelled
    second = launch("-d", "-n", "right", *OVERRIDES, "train.steps=12", "--preempt-at-steps", "4", *FAST)
    assert first.exit_code == 0 and second.exit_code == 0
    # `logs -f` follows "right" across its recovery to the end.
    followed = runner.invoke(app, ["logs", "right", "-f"])
    assert followed.exit_code == 0
    assert "recovering" in followed.stdout and "run SUCCEEDED" in followed.stdout
    # "left" is still training; cancel it gracefully.
    deadline = time.time() + 300
    while status_rows()["left"]["step"] < 3 and time.time() < deadline:
        time.sleep(1)
    cancelled = runner.invoke(app, ["cancel", "left", "-y"])
    assert cancelled.exit_code == 0, cancelled.output
    rows = status_rows()
    assert rows["left"]["status"] == "CANCELLED" and rows["right"]["status"] == "SUCCEEDED"
    log = read_events_dir(Path(Ledger().get("left").run_dir) / "events")
    assert log.of_type("emergency_checkpoint"), "cancel stops with an emergency checkpoint"
