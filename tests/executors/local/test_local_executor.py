"""The local executor end to end: real DeepSpeed training under torchrun, real injected preemptions.

`tiny` is launched through the CLI with preemption notices at chosen steps. Each notice
goes through the simulated cloud's metadata endpoint (a loopback server) to the trainer's
watcher, which makes all ranks write an emergency checkpoint together and exit with the
recover code; the executor provisions a replacement and the next attempt resumes. The
result must equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.events import read_events_dir
from skyspot.ledger import Ledger
from skyspot.trainer.interval import daly_interval
from tests.conftest import REFERENCE_STEPS

pytestmark = pytest.mark.slow
runner = CliRunner()

STEPS = REFERENCE_STEPS  # compared with the shared uninterrupted run (tests/conftest.py `reference`)
# Small, fast and exact: interval checkpoints every 10 steps, so an emergency checkpoint is what saves the work.
# Saving at the notice's step (not training through the window, tests/executors/local/test_notice_window.py
# covers that) makes each chosen preemption step cost exactly one resume, whatever the machine's load.
OVERRIDES = [
    f"train.steps={STEPS}",
    "checkpoint.every_steps=10",
    "train.log_every=4",
    "checkpoint.train_through_notice=false",
]
FAST = ["--notice", "4", "--grace", "60", "--provision-delay", "0.5"]
PREEMPT_AT = [6, 15]


@pytest.fixture
def notices_read_in_time(monkeypatch):
    """The controller sends a notice when it reads step 6's (15's) event, and the notice reaches the ranks
    through the supervisor's watcher; rank 0 waits 3 s at the end of the next step, before the ranks vote,
    so it is read by then however loaded the machine (without it, a notice sent at step 16 of 24 tiny
    steps could arrive after training had finished: no second preemption)."""
    monkeypatch.setenv("SKYSPOT_FAULT", ",".join(f"step_end@{s + 1}/0:pause=3" for s in PREEMPT_AT))


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
        resumed = next(
            e for e in log.events if e.get("attempt") == attempt + 1 and e["type"] == "resume" and e.get("rank") == 0
        )
        assert resumed["step"] == emergency["step"]
    assert_same_params(final_params(run_dir), final_params(reference_dir))
    # The cost report counts exactly the injected preemptions.
    report = runner.invoke(app, ["cost-report", name, "--json"])
    assert report.exit_code == 0, report.output
    data = json.loads(report.stdout)[0]
    assert data["preemptions"] == len(preempt_steps) and data["lost_steps"] == 0 and data["simulated"] is True


def test_two_preemptions_recover_to_the_uninterrupted_result(reference, notices_read_in_time):
    # Also the planned interval (checkpoint.every_seconds=auto): a short prior and floor so it matters
    # in a run of seconds; checkpoint timing never changes the arithmetic, so the result stays bitwise.
    auto = ["checkpoint.every_seconds=auto", "checkpoint.mtbp_prior_seconds=3600", "checkpoint.min_every_seconds=1"]
    result = launch("-n", "spotty", "--preempt-at-steps", ",".join(map(str, PREEMPT_AT)), *FAST, *OVERRIDES, *auto)
    assert result.exit_code == 0, result.output
    check_preempted_run("spotty", reference, PREEMPT_AT)

    # The interval adapts to the preemptions it observed: attempt 3 plans from 2 preemptions.
    run_dir = Path(Ledger().get("spotty").run_dir)
    plans = read_events_dir(run_dir / "events").of_type("interval_plan")
    first = next(p for p in plans if p["attempt"] == 1 and p["reason"] == "start")
    third = next(p for p in plans if p["attempt"] == 3 and p["reason"] == "start")
    assert first["inputs"]["mtbp_s"] == 3600 and first["inputs"]["sources"]["mtbp_s"].startswith("prior")
    assert "observed+prior (2 preemptions" in third["inputs"]["sources"]["mtbp_s"]
    assert third["inputs"]["mtbp_s"] < 3600 / 2  # (3600 + two short uptimes) / (1 + 2)
    # At the same observed checkpoint cost, the prior alone would have planned about sqrt(3) times longer.
    cost = third["inputs"]["blocking_cost_s"]
    assert third["every_seconds"] == pytest.approx(max(1.0, daly_interval(cost, third["inputs"]["mtbp_s"])))
    assert third["every_seconds"] < 0.7 * daly_interval(cost, 3600)
    report = json.loads(runner.invoke(app, ["cost-report", "spotty", "--json"]).stdout)[0]
    assert [p["every_seconds"] for p in report["interval_plans"]] == [p["every_seconds"] for p in plans]
    assert report["interruptions_by_cause"] == {"spot-preemption": 2}  # the simulated AWS notices, named
    text = runner.invoke(app, ["cost-report", "spotty"]).stdout
    assert "checkpoint interval (auto)" in text and "2 spot preemptions" in text


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


def test_spot_capacity_shrinks_to_one_node_and_grows_back_to_the_same_result(reference, tmp_path, notices_read_in_time):
    """2 nodes, then only 1 granted (resources.min_nodes=1), then 2 again: each change of world size
    resumes through a universal checkpoint (node 1's part read from the store when node 0 is alone),
    the global batch is kept, and the run ends where the uninterrupted one does."""
    store = tmp_path / "store"
    # A notice long enough for each emergency checkpoint to become durable on a loaded machine: the
    # next, differently sized attempt reads the other nodes' parts from the store.
    result = launch(
        "-n",
        "elastic",
        "--preempt-at-steps",
        ",".join(map(str, PREEMPT_AT)),
        "--spot-nodes",
        "2,1,2",
        "--store",
        str(store),
        "--notice",
        "15",
        "--grace",
        "60",
        "--provision-delay",
        "0.5",
        *OVERRIDES,
        "resources.num_nodes=2",
        "resources.cpu_ranks=1",
        "resources.min_nodes=1",
        "checkpoint.train_through_notice=false",
    )  # saves at the notice step, as checked below
    assert result.exit_code == 0, result.output
    run_dir = Path(Ledger().get("elastic").run_dir)
    assert "(node-1)" in (run_dir / "logs" / "run.log").read_text()
    log = read_events_dir(run_dir / "events")
    nodes = [e["where"]["num_nodes"] for e in log.of_type("attempt_start")]
    assert nodes == [2, 1, 2]
    resumes = [(e["world_size_from"], e["world_size"]) for e in log.of_type("resume") if e.get("rank") == 0]
    assert resumes == [(2, 1), (1, 2)]
    # Everything a two-node run with two preemptions must show (emergency checkpoints at the notice
    # steps, resumed exactly there, nothing lost) and the uninterrupted run's parameters, bitwise:
    # 2 nodes x 1 rank average the same fp32 gradients that 1 rank accumulates over 2 micro batches.
    check_preempted_run("elastic", reference, PREEMPT_AT)


def test_spot_nodes_below_min_nodes_or_without_a_store_are_refused():
    result = launch("-n", "tight", "--spot-nodes", "2,1", *OVERRIDES, "resources.num_nodes=2", "resources.cpu_ranks=1")
    assert result.exit_code != 0 and "outside 2..2" in result.output and "min_nodes" in result.output
    result = launch(
        "-n",
        "storeless",
        "--spot-nodes",
        "2,1",
        *OVERRIDES,
        "resources.num_nodes=2",
        "resources.cpu_ranks=1",
        "resources.min_nodes=1",
    )
    assert result.exit_code != 0 and "needs storage.store" in result.output
    assert "tight" not in status_rows() and "storeless" not in status_rows()


def test_a_cancelled_run_resumes_under_its_name_and_ends_equal_to_an_uninterrupted_run(reference):
    started = launch("-d", "-n", "paused", *OVERRIDES)
    assert started.exit_code == 0, started.output
    deadline = time.time() + 300
    while status_rows()["paused"]["step"] < 6 and time.time() < deadline:
        time.sleep(0.5)
    assert runner.invoke(app, ["cancel", "paused", "-y"]).exit_code == 0
    assert status_rows()["paused"]["status"] == "CANCELLED"

    again = launch("-n", "paused", *OVERRIDES)  # the name is taken: resume it, do not start over
    assert again.exit_code == 2 and "skyspot resume paused" in again.output

    resumed = runner.invoke(app, ["resume", "paused"], catch_exceptions=False)
    assert resumed.exit_code == 0, resumed.output
    row = status_rows()["paused"]
    assert (row["status"], row["step"]) == ("SUCCEEDED", STEPS)
    run_dir = Path(Ledger().get("paused").run_dir)
    log = read_events_dir(run_dir / "events")
    cancelled_at = next(e["step"] for e in log.of_type("emergency_checkpoint") if e.get("rank") == 0)
    resume = next(e for e in log.of_type("resume") if e.get("rank") == 0)
    assert resume["step"] == cancelled_at >= 6  # from the checkpoint the cancel wrote, nothing redone
    assert_same_params(final_params(run_dir), final_params(reference))
    assert runner.invoke(app, ["resume", "paused"]).exit_code == 2  # finished: nothing to resume


def test_a_killed_controller_ends_its_trainer_and_every_follower(tmp_path):
    """Issue 31, item 7: after `kill -9` of a local controller, `logs -f` followed forever and the orphaned
    trainer trained on while `status` said FAILED_CONTROLLER. Now the node's shell has the controller's
    death as its parent-death signal (SIGTERM, forwarded by the supervisor as a preemption's would be):
    the trainer ends; the follower ends with one FAILED_CONTROLLER line."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    from skyspot.executors.local import controller_lock

    started = launch("-d", "-n", "orphan", *OVERRIDES, "train.steps=100000")
    assert started.exit_code == 0, started.output
    deadline = time.time() + 300
    while status_rows()["orphan"]["step"] < 3 and time.time() < deadline:
        time.sleep(0.5)
    run_dir = Path(Ledger().get("orphan").run_dir)
    held, pid = controller_lock.state(run_dir)
    assert held and pid
    controller = psutil.Process(pid)
    trainers = [p for p in controller.children(recursive=True) if "skyspot.trainer" in " ".join(p.cmdline())]
    assert trainers, "the run has trainer processes"
    follower = subprocess.Popen(
        [sys.executable, "-m", "skyspot.cli.main", "logs", "orphan", "-f"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    time.sleep(2)
    os.kill(pid, signal.SIGKILL)
    out, err = follower.communicate(timeout=60)  # it ends: it asks the lock, not only the ledger
    assert follower.returncode == 1, (out, err)
    assert "run 'orphan' FAILED_CONTROLLER: the local controller ended without recording how the run ended" in err
    killed_at = time.time()
    gone, alive = psutil.wait_procs(trainers, timeout=90)  # no orphan trains on unseen
    assert not alive, [p.cmdline() for p in alive]
    print(f"\ntrainer processes gone {time.time() - killed_at:.1f} s after the controller's SIGKILL")
    assert status_rows()["orphan"]["status"] == "FAILED_CONTROLLER"
    # (Its emergency checkpoint is not promised: the node's output pipe died with the controller.)
