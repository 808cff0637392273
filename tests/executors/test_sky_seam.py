"""The SkyPilot executor at the SDK seam.

No cloud is reachable here, so SkyPilot's control plane (its API server's launch, queue,
cancel and log calls) is faked at the narrowest seam: the `sky.jobs.*` SDK functions and
`sky.get`. Everything else is real: the rendered task becomes a real `sky.Task`, the
ledger is real, and a cloud run's events are read from a real S3 server (moto) on loopback.
"""

from __future__ import annotations

import json
import time

from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.ledger import Ledger

runner = CliRunner()


class FakeSkyJobs:
    """Records calls to the SDK and answers like SkyPilot 0.14's API server would."""

    def __init__(self, monkeypatch, records=None):
        import sky

        from skyspot.executors import sky as sky_executor

        self.calls = []
        self.records = records or []
        monkeypatch.setattr(sky_executor, "api_server_healthy", lambda: True)
        monkeypatch.setattr(sky_executor, "enabled_clouds", lambda: ["aws", "gcp"])
        monkeypatch.setattr(sky.jobs, "launch", self.launch)
        monkeypatch.setattr(sky.jobs, "queue_v2", self.queue_v2)
        monkeypatch.setattr(sky.jobs, "cancel", self.cancel)
        monkeypatch.setattr(sky.jobs, "tail_logs", self.tail_logs)
        monkeypatch.setattr(sky, "get", lambda request: request())
        monkeypatch.setattr(sky, "stream_and_get", lambda request: request())

    def launch(self, task, name=None):
        self.calls.append(("launch", task, name))
        return lambda: ([42], None)

    def queue_v2(self, **kwargs):
        self.calls.append(("queue_v2", kwargs))
        return lambda: (self.records, len(self.records), {}, 0)

    def cancel(self, **kwargs):
        self.calls.append(("cancel", kwargs))
        return lambda: None

    def tail_logs(self, **kwargs):
        self.calls.append(("tail_logs", kwargs))
        return 0


def test_launch_submits_the_rendered_task_with_the_secret_and_records_the_job(monkeypatch):
    fake = FakeSkyJobs(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_canary_value")
    result = runner.invoke(app, ["launch", "llama70b", "-y", "-n", "big-run", "--store", "s3://my-ckpts/runs"])
    assert result.exit_code == 0, result.output
    (kind, task, name), = [c for c in fake.calls if c[0] == "launch"]
    assert name == "big-run"
    assert task.num_nodes == 4 and len(list(task.resources)) == 12
    assert task.envs["SKYSPOT_STORE"] == "s3://my-ckpts/runs"
    assert task.secrets["HF_TOKEN"].get_secret_value() == "hf_canary_value"
    run = Ledger().get("big-run")
    assert (run.executor, run.job_id, run.store, run.total_steps) == ("sky", 42, "s3://my-ckpts/runs", 2000)
    assert "hf_canary_value" not in result.output


def _sky_run(store, name="cloud-run", job_id=7):
    Ledger().add(name, "llama8b", "sky", status="PENDING", store=store, job_id=job_id, total_steps=100, num_nodes=1)


def _put_events(bucket_uri, name, events):
    from skyspot.storage import open_store

    store = open_store(bucket_uri)
    lines = "".join(json.dumps(e) + "\n" for e in events)
    store.put_bytes(f"{name}/events/attempt-1.node-0.rank-0.jsonl", lines.encode())


def test_status_merges_skypilot_queue_with_bucket_events(monkeypatch, s3_server):
    bucket = s3_server.bucket()
    now = time.time()
    where = {"cloud": "aws", "region": "us-east-2", "zone": "us-east-2a", "instance_type": "p4de.24xlarge",
             "spot": True}
    base = {"run_id": "cloud-run", "attempt": 1, "node_rank": 0, "rank": 0}
    _put_events(bucket, "cloud-run", [
        {**base, "ts": now - 600, "type": "start", "where": where, "world_size": 8, "total_steps": 100},
        {**base, "ts": now - 500, "type": "step", "step": 37, "loss": 2.0, "step_seconds": 1.0},
        {**base, "ts": now - 400, "type": "checkpoint_end", "step": 30, "kind": "interval", "blocked_seconds": 0.1},
        {**base, "ts": now - 300, "type": "upload_end", "step": 30, "durable": True, "bytes": 10, "seconds": 1},
    ])
    _sky_run(bucket)
    fake = FakeSkyJobs(monkeypatch, records=[{"job_id": 7, "status": "RECOVERING", "recovery_count": 2,
                                              "cloud": "AWS", "region": "us-east-2"}])
    result = runner.invoke(app, ["status", "--json"])
    assert result.exit_code == 0, result.output
    row, = json.loads(result.stdout)
    assert (row["name"], row["executor"], row["status"], row["recoveries"]) == ("cloud-run", "sky", "RECOVERING", 2)
    assert (row["step"], row["total_steps"], row["last_checkpoint"]) == (37, 100, 30)
    assert row["cloud"] == "aws" and row["spot"] is True
    (_, kwargs), = [c for c in fake.calls if c[0] == "queue_v2"]
    assert kwargs["job_ids"] == [7] and kwargs["refresh"] is False
    assert {"recovery_count", "job_duration", "cluster_resources", "cloud", "region"} <= set(kwargs["fields"])


def test_status_without_the_api_server_still_lists_runs_and_says_so(monkeypatch, tmp_path):
    from skyspot.executors import sky as sky_executor

    monkeypatch.setattr(sky_executor, "api_server_healthy", lambda: False)
    _sky_run(str(tmp_path / "store"))
    result = runner.invoke(app, ["status", "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)[0]["name"] == "cloud-run"
    assert "SkyPilot managed jobs were not refreshed" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cancel_and_logs_call_skypilot_with_the_job_id(monkeypatch, tmp_path):
    fake = FakeSkyJobs(monkeypatch)
    _sky_run(str(tmp_path / "store"), job_id=9)
    assert runner.invoke(app, ["logs", "cloud-run", "-f"]).exit_code == 0
    assert runner.invoke(app, ["cancel", "cloud-run", "-y"]).exit_code == 0
    assert ("tail_logs", {"job_id": 9, "follow": True}) in fake.calls
    assert ("cancel", {"job_ids": [9]}) in fake.calls
    assert Ledger().get("cloud-run").status == "CANCELLED"


def test_unknown_run_suggests_the_closest(monkeypatch, tmp_path):
    _sky_run(str(tmp_path / "store"))
    result = runner.invoke(app, ["logs", "cloud-rum"])
    assert result.exit_code == 2
    assert "no run named 'cloud-rum'; did you mean 'cloud-run'?" in result.stderr
