"""The SkyPilot executor at the SDK seam.

No cloud is reachable here, so SkyPilot's control plane (its API server's launch, queue,
cancel and log calls) is faked at the narrowest seam: the `sky.jobs.*` SDK functions and
`sky.get`. Everything else is real: the rendered task becomes a real `sky.Task`, the
ledger is real, and a cloud run's events are read from a real S3 server (moto) on loopback.
"""

from __future__ import annotations

import pytest

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

        from skyspot.executors.sky import sdk as sky_executor

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


@pytest.fixture(autouse=True)
def _amazons_efa_image(aws_env):
    """moto's EC2 on loopback holds Amazon's EFA image, which a launch with AWS EFA candidates resolves
    per region (tests/ec2_server.py): the AWS control plane is the one part stood in for."""


def test_launch_submits_the_rendered_task_with_the_secret_and_records_the_job(monkeypatch):
    fake = FakeSkyJobs(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_canary_value")
    result = runner.invoke(app, ["launch", "llama70b", "-y", "-n", "big-run", "--store", "s3://my-ckpts/runs"])
    assert result.exit_code == 0, result.output
    ((kind, task, name),) = [c for c in fake.calls if c[0] == "launch"]
    assert name == "big-run"
    assert task.num_nodes == 4 and len(list(task.resources)) == 12
    assert "storage.store=s3://my-ckpts/runs" in task.run
    assert task.secrets["HF_TOKEN"].get_secret_value() == "hf_canary_value"
    run = Ledger().get("big-run")
    assert (run.executor, run.job_id, run.store, run.total_steps) == ("sky", 42, "s3://my-ckpts/runs", 2000)
    assert "hf_canary_value" not in result.output


def test_the_dashboards_keys_go_as_secrets_and_a_missing_mlflow_token_leaves_no_reference(monkeypatch):
    fake = FakeSkyJobs(monkeypatch)
    monkeypatch.delenv("MLFLOW_TRACKING_TOKEN", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    args = ["launch", "smollm2-360m", "-y", "--store", "s3://my-ckpts/runs", "metrics.backends=[wandb,mlflow]"]
    refused = runner.invoke(app, [*args, "-n", "no-key"])
    assert refused.exit_code == 2 and "WANDB_API_KEY" in refused.output and "Traceback" not in refused.output
    monkeypatch.setenv("WANDB_API_KEY", "wandb_canary_value")
    result = runner.invoke(app, [*args, "-n", "dash-run"])
    assert result.exit_code == 0, result.output
    ((_, task, _),) = [c for c in fake.calls if c[0] == "launch"]
    # An MLflow server without authentication: no token, and no null left behind (an unresolvable reference).
    assert set(task.secrets) == {"WANDB_API_KEY", "SKYSPOT_WHEELHOUSE_KEY"}  # the run's own key (wheelhouse.py)
    assert task.secrets["WANDB_API_KEY"].get_secret_value() == "wandb_canary_value"
    assert "--extras wandb,mlflow" in task.setup and "SKYSPOT_PRICES" in task.envs
    assert "wandb_canary_value" not in result.output and "wandb_canary_value" not in json.dumps(
        Ledger().get("dash-run").info
    )


def _sky_run(store, name="cloud-run", job_id=7):
    Ledger().add(name, "llama8b", "sky", status="PENDING", store=store, job_id=job_id, total_steps=100, num_nodes=1)


P4DE_SPOT = {
    "cloud": "aws",
    "region": "us-east-2",
    "zone": "us-east-2a",
    "instance_type": "p4de.24xlarge",
    "spot": True,
}
"""Where the cloud run's attempts ran, as a node leader's `start` event says it."""


def _put_events(bucket_uri, name, events):
    from skyspot.storage import open_store

    store = open_store(bucket_uri)
    lines = "".join(json.dumps(e) + "\n" for e in events)
    store.put_bytes(f"{name}/events/attempt-1.node-0.rank-0.jsonl", lines.encode())


def test_status_merges_skypilot_queue_with_bucket_events(monkeypatch, s3_server):
    bucket = s3_server.bucket()
    now = time.time()
    where = P4DE_SPOT
    base = {"run_id": "cloud-run", "attempt": 1, "node_rank": 0, "rank": 0}
    _put_events(
        bucket,
        "cloud-run",
        [
            {**base, "ts": now - 600, "type": "start", "where": where, "world_size": 8, "total_steps": 100},
            {**base, "ts": now - 500, "type": "step", "step": 37, "loss": 2.0, "step_seconds": 1.0},
            {**base, "ts": now - 400, "type": "checkpoint_end", "step": 30, "kind": "interval", "blocked_seconds": 0.1},
            {**base, "ts": now - 300, "type": "upload_end", "step": 30, "durable": True, "bytes": 10, "seconds": 1},
        ],
    )
    _sky_run(bucket)
    fake = FakeSkyJobs(
        monkeypatch,
        records=[{"job_id": 7, "status": "RECOVERING", "recovery_count": 2, "cloud": "AWS", "region": "us-east-2"}],
    )
    result = runner.invoke(app, ["status", "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)
    assert (row["name"], row["executor"], row["status"], row["recoveries"]) == ("cloud-run", "sky", "RECOVERING", 2)
    assert (row["step"], row["total_steps"], row["last_checkpoint"]) == (37, 100, 30)
    assert row["cloud"] == "aws" and row["spot"] is True
    ((_, kwargs),) = [c for c in fake.calls if c[0] == "queue_v2"]
    assert kwargs["job_ids"] == [7] and kwargs["refresh"] is False
    assert {"recovery_count", "job_duration", "cluster_resources", "cloud", "region"} <= set(kwargs["fields"])


@pytest.mark.slow  # four `status` runs against moto: the default suite is at its ten-minute line
def test_status_keeps_a_cloud_runs_events_and_the_next_placement_reads_them(monkeypatch, s3_server):
    """The preemption history reads no store (no network at planning time): a cloud run's attempts reach it
    through the copy `status` keeps of the events it read from the bucket (skyspot/events_copy.py), and
    render's cache key moves with it."""
    from skyspot.cli import cache
    from skyspot.planning.spot_risk import rate_for, read_history

    bucket = s3_server.bucket()
    now = time.time()
    where = P4DE_SPOT
    events = []
    for n in range(1, 8):  # attempts 1-6 each followed by the next: taken away with their nodes; 7 runs on
        base = {"run_id": "cloud-run", "attempt": n, "node_rank": 0, "rank": 0}
        t0 = now - 8000 + n * 1000
        events.append({**base, "ts": t0, "type": "start", "where": where, "world_size": 8, "total_steps": 100})
        events.append({**base, "ts": t0 + 900, "type": "step", "step": 10 * n, "loss": 2.0, "step_seconds": 1.0})
    _put_events(bucket, "cloud-run", events)
    _sky_run(bucket)
    place = dict(region="us-east-2", instance_type="p4de.24xlarge", spot=True, accelerator="A100-80GB:8")
    before = rate_for(read_history(), "aws", **place)
    assert "observed" not in before.source
    FakeSkyJobs(monkeypatch, records=[{"job_id": 7, "status": "RUNNING", "recovery_count": 6, "cloud": "AWS"}])

    def status() -> None:
        result = runner.invoke(app, ["status", "--json"])
        assert result.exit_code == 0, result.output

    status()
    after = rate_for(read_history(), "aws", **place)
    # 6 x 900 s up before each was taken away, and the running 7th 1,000 s so far: 1.8 node-hours
    assert "+ 6 preemptions in 1.8 node-h observed" in after.source, after.source
    assert after.per_node_hour > before.per_node_hour
    key = cache.key("render", ["llama8b"], history=True)
    status()  # nothing new in the bucket (and the ledger's row as it was): render's cached plan still holds
    assert cache.key("render", ["llama8b"], history=True) == key
    from skyspot.storage import open_store

    bucket_store = open_store(bucket)
    bucket_store.delete(bucket_store.list("cloud-run/events/"))
    status()  # a read that finds no events (a bucket emptied by hand): the history keeps what it learnt
    assert rate_for(read_history(), "aws", **place).source == after.source
    events.append({**base, "ts": now - 60, "type": "step", "step": 75, "loss": 2.0, "step_seconds": 1.0})
    _put_events(bucket, "cloud-run", events)
    status()  # new events: a new copy, and render plans again
    assert cache.key("render", ["llama8b"], history=True) != key


def test_status_without_the_api_server_still_lists_runs_and_says_so(monkeypatch, tmp_path):
    from skyspot.executors.sky import sdk as sky_executor

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


# --------------------------------------------------------------------------- one run name, resume


def launched(fake):
    return [(task, name) for kind, task, name in (c for c in fake.calls if c[0] == "launch")]


def test_two_unnamed_launches_never_share_a_run_name_or_a_store_prefix(monkeypatch):
    fake = FakeSkyJobs(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    for _ in range(2):
        result = runner.invoke(app, ["launch", "llama70b", "-y", "-d", "--store", "s3://my-ckpts/runs"])
        assert result.exit_code == 0, result.output
    (first, first_name), (second, second_name) = launched(fake)
    assert first_name != second_name and first_name.startswith("llama70b-")
    # One name everywhere: the managed job's, the node's run id (hence its store prefix), the ledger's.
    for task, name in ((first, first_name), (second, second_name)):
        assert task.name == name and task.envs["SKYSPOT_RUN_NAME"] == name
        assert Ledger().get(name).job_id == 42


def test_launching_an_existing_name_says_to_resume_it(monkeypatch):
    fake = FakeSkyJobs(monkeypatch)
    _sky_run("s3://my-ckpts/runs", name="taken")
    result = runner.invoke(app, ["launch", "llama8b", "-y", "-n", "taken", "--store", "s3://my-ckpts/runs"])
    assert result.exit_code == 2
    assert "a run named 'taken' exists already" in result.stderr and "skyspot resume taken" in result.stderr
    assert not launched(fake)


def test_a_failed_submission_leaves_a_failed_row_not_a_ghost(monkeypatch):
    import sky

    FakeSkyJobs(monkeypatch)

    def refuse(task, name=None):
        raise RuntimeError("Failed to connect to the API server\nTraceback ...")

    monkeypatch.setattr(sky.jobs, "launch", refuse)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    result = runner.invoke(app, ["launch", "llama8b", "-y", "-n", "doomed", "--store", "s3://my-ckpts/runs"])
    assert result.exit_code == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == "error: SkyPilot could not launch 'doomed': Failed to connect to the API server"
    run = Ledger().get("doomed")
    assert (run.status, run.job_id, run.exit_code) == ("FAILED", None, 1)


def test_nothing_is_recorded_when_the_launch_is_refused_before_submission(monkeypatch):
    FakeSkyJobs(monkeypatch)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    result = runner.invoke(app, ["launch", "llama70b", "-y", "-n", "tokenless", "--store", "s3://my-ckpts/runs"])
    assert result.exit_code == 2 and "export HF_TOKEN" in result.stderr
    assert "tokenless" not in {r.name for r in Ledger().runs()}


def test_resume_resubmits_a_cancelled_cloud_run_under_its_own_name(monkeypatch):
    fake = FakeSkyJobs(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_canary_value")
    assert (
        runner.invoke(app, ["launch", "llama70b", "-y", "-d", "-n", "long-run", "--store", "s3://bkt-one/x"]).exit_code
        == 0
    )
    assert runner.invoke(app, ["cancel", "long-run", "-y"]).exit_code == 0
    result = runner.invoke(app, ["resume", "long-run", "-y", "-d"])
    assert result.exit_code == 0, result.output
    (first, _), (again, name) = launched(fake)
    assert name == "long-run" and again.envs["SKYSPOT_RUN_NAME"] == "long-run"
    assert "storage.store=s3://bkt-one/x" in again.run and again.run == first.run
    assert again.secrets["HF_TOKEN"].get_secret_value() == "hf_canary_value"
    run = Ledger().get("long-run")
    assert (run.status, run.job_id, run.info["previous_job_ids"]) == ("PENDING", 42, [42])
    assert "hf_canary_value" not in json.dumps(run.info)


def test_resume_refuses_a_finished_run_and_a_live_managed_job(monkeypatch):
    FakeSkyJobs(monkeypatch, records=[{"job_id": 7, "status": "RUNNING"}])
    _sky_run("s3://my-ckpts/runs", name="live", job_id=7)
    result = runner.invoke(app, ["resume", "live", "-y"])
    assert result.exit_code == 2 and "SkyPilot recovers a live managed job itself" in result.stderr
    _sky_run("s3://my-ckpts/runs", name="done", job_id=8)
    Ledger().set_status("done", "SUCCEEDED")
    result = runner.invoke(app, ["resume", "done", "-y"])
    assert result.exit_code == 2 and "nothing to resume" in result.stderr
