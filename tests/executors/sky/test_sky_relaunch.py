"""A recovery that leaves the region just preempted, on SkyPilot (issue 32; executors/sky/relaunch.py and the
controller in executors/sky/deadline.py).

SkyPilot's control plane is the only thing faked, at the SDK seam, as in test_sky_deadline.py (its
FakeSkyPilot): job ids, statuses and the place a job runs are scripted. The rest is real: `launch` through the
CLI with `resources.supervise=true`, the controller's task and every stage as real `sky.Task`s parsed by
SkyPilot 0.14.1 (the regions below are what SkyPilot's own `Resources` hold), the ledger, the plan file and a
store (a local directory) the controller keeps its decisions in.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.events import read_events_store
from skyspot.executors.sky import deadline as sky_deadline
from skyspot.executors.sky.relaunch import Left, avoiding, regions_for
from skyspot.ledger import Ledger
from skyspot.storage import open_store
from tests.conftest import REPO
from tests.executors.sky.test_sky_deadline import Clock, FakeSkyPilot, remote_api_server  # noqa: F401 (fixture)

runner = CliRunner()
RUNNING_IN = {"cloud": "AWS", "region": "us-east-1", "zone": "us-east-1a"}
SPOT_NODE = "1x[spot](gpus=A100-80GB:8, p4de.24xlarge, cpus=96, mem=1152, disk=512)"


def _llama70b_task() -> dict:
    return yaml.safe_load((REPO / "tasks" / "llama70b.yaml").read_text())


def test_the_relaunch_pins_the_preempted_clouds_spot_candidates_to_its_other_regions():
    task = _llama70b_task()
    now = 1_000.0
    changed = avoiding(task, [Left("aws", "us-east-1", "us-east-1a", until=now + 60)], now=now)
    before, after = task["resources"]["ordered"], changed["resources"]["ordered"]
    aws_spot = [c for c in after if c["cloud"] == "aws" and c["use_spot"]]
    assert aws_spot and all(c.get("region") and c["region"] != "us-east-1" for c in aws_spot)
    for accelerators in ("A100-80GB:8", "H100:8"):
        pinned = [c["region"] for c in aws_spot if c["accelerators"] == accelerators]
        assert pinned == [r for r in regions_for("aws", accelerators, spot=True) if r != "us-east-1"]
        assert "us-east-1" in regions_for("aws", accelerators, spot=True)  # it was a candidate before
    # Other clouds and every on-demand candidate as rendered, in the rendered order.
    assert [c for c in after if c["cloud"] != "aws" or not c["use_spot"]] == [
        c for c in before if c["cloud"] != "aws" or not c["use_spot"]
    ]
    assert task["resources"]["ordered"] == before  # the recorded task is left alone
    assert avoiding(task, [Left("aws", "us-east-1", None, until=now - 1)], now=now) == task  # expired


def test_a_place_left_that_would_leave_nothing_changes_nothing():
    task = {"resources": {"cloud": "aws", "region": "us-east-1", "accelerators": "H100:8", "use_spot": True}}
    assert avoiding(task, [Left("aws", "us-east-1", None, until=10.0)], now=0.0) == task
    inline = {"resources": {"cloud": "aws", "accelerators": "H100:8", "use_spot": True}}
    changed = avoiding(inline, [Left("aws", "us-east-1", None, until=10.0)], now=0.0)["resources"]
    assert changed["cloud"] == "aws" and [c["region"] for c in changed["ordered"]] == [
        r for r in regions_for("aws", "H100:8", spot=True) if r != "us-east-1"
    ]


def test_a_supervised_launch_submits_the_controller_which_leaves_a_preempted_region(
    monkeypatch,
    tmp_path,
    remote_api_server,  # noqa: F811
):
    fake = FakeSkyPilot(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    result = runner.invoke(
        app,
        ["launch", "llama8b", "-y", "-d", "-n", "kept", "--store", "s3://ckpts/runs", "resources.supervise=true"],
    )
    assert result.exit_code == 0, result.output
    ((_, controller_task, name),) = fake.launched
    assert name == "kept" and "python -m skyspot.executors.sky.deadline" in controller_task.run
    assert all(not r.use_spot and r.accelerators is None for r in controller_task.resources)
    plan_dir = Path(controller_task.file_mounts[sky_deadline.CONTROLLER_MOUNT])
    plan = json.loads((plan_dir / sky_deadline.PLAN_FILE).read_text())
    assert plan["deadline"] is None and plan["leave_seconds"] == 1800.0  # resources.burst_minutes: 30
    assert Ledger().get("kept").info["supervised"] == {"leave_seconds": 1800.0}

    # The controller, as it runs on its VM: the first stage is the task as rendered. Its store here is a
    # directory (the store's protocol is the same for a bucket: tests/storage).
    plan["store"] = str(tmp_path / "store")
    clock = Clock(1_000_000.0)
    store = open_store(plan["store"])
    lines: list[str] = []
    controller = sky_deadline.CloudController(plan, store=store, clock=clock, sleep=clock.sleep, say=lines.append)
    assert controller.step() is None
    first_id, first, _ = fake.launched[1]
    assert any(r.cloud is not None and str(r.cloud) == "AWS" and r.region is None for r in first.resources)
    # Running in us-east-1a, then preempted: SkyPilot recovers it (RECOVERING) in price order, us-east-1 first.
    fake.status[first_id] = "RUNNING"
    fake.where[first_id] = {**RUNNING_IN, "cluster_resources": SPOT_NODE}
    clock.now += 3600
    assert controller.step() is None and len(fake.launched) == 2
    fake.status[first_id] = "RECOVERING"
    clock.now += 60
    assert controller.step() is None
    assert fake.cancelled == [first_id]
    second_id, second, name = fake.launched[2]
    assert name == "kept" and second.envs["SKYSPOT_RUN_NAME"] == "kept"
    aws_spot = [r for r in second.resources if str(r.cloud) == "AWS" and r.use_spot]
    assert aws_spot and all(r.region is not None and r.region != "us-east-1" for r in aws_spot)
    assert any(str(r.cloud) == "AWS" and not r.use_spot and r.region is None for r in second.resources)
    assert any("preempted in aws/us-east-1 (us-east-1a)" in line and "30 min" in line for line in lines)
    decision = read_events_store(store, "kept").of_type(sky_deadline.PLACEMENT_EVENT)[-1]
    assert decision["reason"] == "left" and decision["previous_job_id"] == first_id
    assert decision["stage"]["job_id"] == second_id
    assert decision["left"] == [
        {"cloud": "aws", "region": "us-east-1", "zone": "us-east-1a", "until": clock.now + 1800}
    ]

    # A controller restarted by SkyPilot keeps avoiding the region until its time is up.
    again = sky_deadline.CloudController(plan, store=store, clock=clock, sleep=clock.sleep, say=lines.append)
    assert again.stage is not None and again.stage.job_id == second_id
    assert [(p.cloud, p.region) for p in again.left] == [("aws", "us-east-1")]
    fake.status[second_id] = "SUCCEEDED"
    assert again.step() == 0
    assert read_events_store(store, "kept").of_type(sky_deadline.PLACEMENT_EVENT)[-1]["reason"] == "done"


def test_an_unsupervised_launch_is_the_training_task_itself(monkeypatch, tmp_path):
    fake = FakeSkyPilot(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    result = runner.invoke(app, ["launch", "llama8b", "-y", "-d", "-n", "plain", "--store", "s3://ckpts/runs"])
    assert result.exit_code == 0, result.output
    ((_, task, _),) = fake.launched
    assert "skyspot.executors.sky.deadline" not in task.run and "supervised" not in Ledger().get("plain").info
