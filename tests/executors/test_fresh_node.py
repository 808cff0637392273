"""The task a cloud launch hands SkyPilot, run on a fresh node: its `setup` installs skyspot, its `run` trains.

SkyPilot's control plane cannot be reached from here, so it is faked at the SDK seam
(`FakeSkyJobs`, tests/executors/test_sky_seam.py) only to capture the sky.Task that
`skyspot launch` submits. What SkyPilot does with it on a new VM is done for real: the
task's local file mounts are copied onto a node whose Python is a new virtual environment
without skyspot, its `setup` runs there (pip installs the wheel launch built, with its
pinned stack, and prepares DeepSpeed's ops), then its `run` trains with the environment
variables SkyPilot sets on node 0 of 1, into a bucket on moto's S3 server. `status` and
`cost-report` must then show that run, finished, under the launched name.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.executors import fresh_node
from tests.executors.test_sky_seam import FakeSkyJobs, launched

pytestmark = pytest.mark.slow
runner = CliRunner()


def skypilot_node_env(name: str) -> dict[str, str]:
    """What SkyPilot sets for the `run` of node 0 of a 1-node managed job (docs: 'Environment variables')."""
    return {"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "127.0.0.1", "SKYPILOT_NUM_NODES": "1",
            "SKYPILOT_NUM_GPUS_PER_NODE": "0", "SKYPILOT_TASK_ID": f"sky-managed-2026-11-30-12-00-00-000000_{name}_1-0",
            "SKYPILOT_CLUSTER_INFO": json.dumps({"cluster_name": f"{name}-1", "cloud": "AWS", "region": "us-east-2",
                                                 "zone": "us-east-2a", "num_nodes": 1, "instance_type": "m6i.large",
                                                 "use_spot": True}),
            "SKYSPOT_MASTER_PORT": "29611"}


def test_a_cloud_launch_installs_on_a_fresh_node_trains_into_the_bucket_and_is_reported(monkeypatch, tmp_path,
                                                                                          s3_server):
    store = s3_server.bucket() + "/runs"
    fake = FakeSkyJobs(monkeypatch)
    result = runner.invoke(app, ["launch", "tiny", "--cloud", "-y", "-d", "-n", "fresh-run", "--store", store,
                                 "train.steps=8", "checkpoint.every_steps=4", "train.log_every=4"])
    assert result.exit_code == 0, result.output
    (task, name), = launched(fake)
    assert name == "fresh-run"

    node = fresh_node.make(tmp_path / "node", task.file_mounts)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SKYSPOT_", "SKYPILOT_"))}
    env = {**node.env({**base, "HOME": str(tmp_path / "home")}, task.envs), **skypilot_node_env(name)}
    # Test time only: pip skips byte-compiling the stack (tens of seconds here); what it installs is the same.
    env["PIP_NO_COMPILE"] = "1"
    log = tmp_path / "node.log"
    with open(log, "w") as handle:
        assert fresh_node.run_setup(node, task.setup, env, handle) == 0, log.read_text()[-3000:]
    where = subprocess.run(["python", "-c", "import skyspot, importlib.metadata as m; print(skyspot.__file__, "
                            "m.version('skyspot'))"], env=env, cwd=tmp_path, capture_output=True, text=True)
    path, version = where.stdout.split()
    assert path.startswith(str(node.venv)) and version.startswith("0.1.0+")  # the wheel, not this checkout

    done = subprocess.run(["bash", "-c", task.run], env=env, cwd=tmp_path / "node", capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]

    fake.records[:] = [{"job_id": 42, "status": "SUCCEEDED", "recovery_count": 0, "cloud": "AWS",
                        "region": "us-east-2"}]
    status = runner.invoke(app, ["status", "--json", "-a"])
    row, = json.loads(status.stdout)
    assert (row["name"], row["status"], row["step"], row["total_steps"]) == ("fresh-run", "SUCCEEDED", 8, 8)
    assert row["last_checkpoint"] == 8 and row["last_checkpoint_durable"] is True
    report = runner.invoke(app, ["cost-report", "fresh-run", "--json"])
    assert report.exit_code == 0, report.output
    entry, = json.loads(report.stdout)
    assert entry["name"] == "fresh-run" and entry["status"] == "SUCCEEDED"
