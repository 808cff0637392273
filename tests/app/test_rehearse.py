"""`skyspot launch RECIPE --rehearse`: one short job per (cloud, image, accelerators), recorded; the launch skips what failed.

The local executor runs the rehearsals for real (the controller, torchrun, DeepSpeed, the trainer, the store
round trip) in this environment (`FRESH_NODE_LOCAL` off: a fresh node takes minutes; tests/app/
test_rehearse_fresh_node.py, marked slow, runs them on fresh nodes); a failing setup comes from the local
executor's hook, SKYSPOT_TEST_FAIL_SETUP. The SkyPilot path is tested as tests/executors/sky does: its
control plane faked at the SDK seam (`FakeSkyJobs`), the tasks real `sky.Task`s, the store moto's S3 server.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skyspot.app import rehearsal_record, rehearse
from skyspot.app.launch import LaunchRequest, prepare
from skyspot.cli.main import app
from skyspot.ledger import Ledger
from skyspot.recipe import REGISTRY, load_recipe
from skyspot.task.rehearsal import SUPERVISOR_LINE, rehearsal_task
from skyspot.trainer import round_trip
from tests.executors.sky.test_sky_seam import FakeSkyJobs, launched

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


def _plan(recipe: str, *args: str, local: bool = True, **flags) -> rehearse.RehearsalPlan:
    return rehearse.plan_rehearsals(
        LaunchRequest(recipe=recipe, overrides=list(args), local=local, flags=flags, executor_flags={})
    )


def _wait_for_runs_to_end(timeout: float = 240.0) -> None:
    """A detached real launch keeps training after the command returns: no test leaves it behind."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        with Ledger() as ledger:
            if all(run.terminal for run in ledger.runs()):
                return
        time.sleep(0.5)
    raise AssertionError("a local run did not end")


def test_one_target_per_cloud_image_and_accelerator_among_the_spot_candidates():
    tiny = _plan("tiny")
    assert [t.key.text() for t in tiny.targets] == ["aws/default/CPU", "gcp/default/CPU", "azure/default/CPU"]
    assert {t.nodes for t in tiny.targets} == {1} and all(t.candidate.spot for t in tiny.targets)
    big = _plan("llama70b", local=False, **{"storage.store": "s3://my-ckpts/runs"})
    keys = [t.key for t in big.targets]
    spot = {(c.cloud, c.accelerators) for c in big.prepared.built.candidates if c.spot}
    assert len(keys) == len(set(keys)) == len(spot)  # every distinct spot pair once, no on-demand one
    assert {t.nodes for t in big.targets} == {2}  # a multi-node recipe: two nodes prove the fabric
    assert big.question and "Rehearse 'llama70b'" in big.question and tiny.question is None


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_recipes_rehearsal_is_the_tiny_model_for_five_steps_on_one_candidates_resources(name):
    recipe = load_recipe(name)
    target = rehearse.targets(_plan(name, local=False, **{"storage.store": "s3://my-ckpts/runs"}).prepared)[-1]
    rehearsal = load_recipe(name, rehearse.rehearsal_overrides(recipe, target))
    tiny = load_recipe("tiny")
    assert (rehearsal.model, rehearsal.data) == (tiny.model, tiny.data)
    assert rehearsal.train.steps == rehearse.REHEARSAL_STEPS and rehearsal.train.lora is None
    assert rehearsal.checkpoint.every_steps is None and rehearsal.metrics.backends == []
    resources = rehearsal.resources
    assert resources.clouds == [target.candidate.cloud] and resources.spot and not resources.on_demand_fallback
    assert resources.accelerators == ([target.candidate.accelerators] if target.candidate.accelerators else [])
    assert resources.num_nodes == target.nodes and resources.deadline is None
    assert (rehearsal.deepspeed, resources.disk_size, resources.network_tier) == (
        recipe.deepspeed,
        recipe.resources.disk_size,
        recipe.resources.network_tier,
    )  # the real run's own


def test_the_rehearsal_task_does_the_round_trip_before_the_trainer_and_never_retries():
    import sky

    built = _plan("llama8b", local=False, **{"storage.store": "s3://my-ckpts/runs"}).prepared.built
    task = rehearsal_task(built.task, "s3://my-ckpts/runs")
    lines = task["run"].splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(SUPERVISOR_LINE))
    assert (
        lines[at - 1]
        == '"$PY" -m skyspot.trainer.round_trip s3://my-ckpts/runs/"$SKYSPOT_RUN_NAME" "$SKYPILOT_NODE_RANK"'
    )
    assert task["resources"]["job_recovery"]["max_restarts_on_errors"] == 0
    assert built.task["resources"]["job_recovery"]["max_restarts_on_errors"] == 3  # the real task is untouched
    assert task["setup"] == built.task["setup"]
    sky.Task.from_yaml_config(task)  # still a task SkyPilot takes
    no_store = rehearsal_task(built.task, None)["run"]
    assert '"$PY" -m skyspot.trainer.round_trip "$RUN_DIR" "$SKYPILOT_NODE_RANK"' in no_store


def test_the_round_trip_writes_reads_back_and_deletes_through_the_store(s3_server, tmp_path, capsys):
    from skyspot.storage import open_store

    bucket = s3_server.bucket("rehearse")
    assert round_trip.main([f"{bucket}/runs/r1", "1"]) == 0
    assert "store round trip ok" in capsys.readouterr().out
    assert open_store(bucket).list("") == []  # nothing left behind
    assert round_trip.main([str(tmp_path / "run"), "0"]) == 0
    assert not (tmp_path / "run" / "rehearsal" / "round-trip-node-0").exists()
    assert round_trip.main(["s3://no-such-bucket-here/runs", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("skyspot rehearsal: store round trip failed:") and len(err.splitlines()) == 1


def _record(cloud: str, *, ok: bool, line: str = "FAILED_SETUP, exit 1: the image has no python3") -> None:
    rehearsal_record.write(
        [
            rehearsal_record.Record(
                cloud=cloud,
                image="default",
                accelerators="CPU",
                at=time.time(),
                ok=ok,
                line=line,
                minutes=1.0,
                cost_usd=0.01,
                run=f"r-{cloud}",
            )
        ]
    )


def test_a_failed_rehearsal_leaves_its_candidates_out_and_force_keeps_them():
    _record("aws", ok=False)
    prepared = prepare(LaunchRequest(recipe="tiny", dry_run=True))
    assert "aws" not in {c.cloud for c in prepared.built.candidates}
    assert all(e["cloud"] != "aws" for e in prepared.built.task["resources"]["ordered"])
    assert {c.cloud for c, _ in prepared.rehearsed} == {"aws"}
    forced = prepare(LaunchRequest(recipe="tiny", dry_run=True, force=True))
    assert "aws" in {c.cloud for c in forced.built.candidates}
    _record("aws", ok=True, line="works")  # the newest rehearsal counts
    assert "aws" in {c.cloud for c in prepare(LaunchRequest(recipe="tiny", dry_run=True)).built.candidates}


def test_the_dry_run_says_which_rehearsal_failed_when_and_why():
    _record("aws", ok=False)
    result = runner.invoke(app, ["launch", "tiny", "--dry-run"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "rehearsal failed" in line]
    assert lines == [
        f"aws any CPU {cap}: rehearsal failed {time.strftime('%Y-%m-%d')} "
        + lines[i].split(time.strftime("%Y-%m-%d") + " ", 1)[1]
        for i, cap in enumerate(("spot", "on-demand"))
    ]
    assert all(
        line.endswith("FAILED_SETUP, exit 1: the image has no python3; skipped (--force to keep)") for line in lines
    )
    forced = runner.invoke(app, ["launch", "tiny", "--dry-run", "--force"])
    assert forced.exit_code == 0 and "kept (--force)" in forced.output and "skipped" not in forced.output


def test_every_candidate_failed_and_a_simulated_cloud_that_failed_are_one_line_refusals():
    for cloud in ("aws", "gcp", "azure"):
        _record(cloud, ok=False)
    result = runner.invoke(app, ["launch", "tiny", "--dry-run"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert (
        result.output.strip()
        .splitlines()[-1]
        .endswith("failed its last rehearsal: fix what it said and `--rehearse` again, or pass --force to keep them")
    )
    _record("gcp", ok=True, line="works")
    refused = runner.invoke(app, ["launch", "tiny", "--simulate", "aws", "--dry-run"])
    assert refused.exit_code == 2 and "--simulate aws: every aws candidate failed" in refused.output


def test_bad_input_is_one_line_and_a_rehearsals_dry_run_starts_nothing():
    unknown = runner.invoke(app, ["launch", "tinyy", "--rehearse"])
    assert unknown.exit_code == 2 and "Traceback" not in unknown.output and "unknown recipe" in unknown.output
    dry = runner.invoke(app, ["launch", "tiny", "--local", "--rehearse", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert (
        "rehearsal of 'tiny': 3 spot candidate(s), 1 node(s) each, the tiny model for 5 steps: "
        "aws/default/CPU, gcp/default/CPU, azure/default/CPU"
    ) in dry.output
    assert Ledger().runs() == [] and not rehearsal_record.path().exists()
    cloud = runner.invoke(app, ["launch", "llama8b", "--cloud", "--rehearse", "--store", "s3://my-ckpts/runs"])
    assert cloud.exit_code == 1 and "then launch it? needs confirmation: pass -y/--yes" in cloud.output
    assert Ledger().runs() == [] and not rehearsal_record.path().exists()  # asked before anything is paid for


@pytest.mark.slow  # three local launches end to end (about 35 s): the slow set, as the fresh-node rehearsal
def test_a_local_rehearsal_whose_setup_fails_excludes_that_candidate_and_force_brings_it_back(monkeypatch):
    monkeypatch.setattr(rehearse, "FRESH_NODE_LOCAL", False)
    monkeypatch.setenv("SKYSPOT_TEST_FAIL_SETUP", "aws")
    # The nodes' `python -m skyspot...` runs in the node's directory: this checkout's skyspot, not another's.
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    result = runner.invoke(
        app, ["launch", "tiny", "--local", "--rehearse", "-d", "--clouds", "aws,gcp", "train.steps=2"]
    )
    try:
        assert result.exit_code == 0, result.output
        rows = {
            line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[1:-1]]
            for line in result.output.splitlines()
            if line.startswith("│") and line.split("│")[1].strip()
        }
        assert rows["aws"][3].startswith("failed: FAILED_SETUP, exit 1")
        assert rows["gcp"][3] == "works" and float(rows["gcp"][4]) < 5
        assert rows["gcp"][5].startswith("$") and float(rows["gcp"][5][1:]) > 0  # priced as cost-report does
        records = rehearsal_record.read()
        gcp = records[rehearsal_record.Key("gcp", "default", "CPU")]
        assert gcp.ok and gcp.cost_usd and gcp.cost_usd > 0
        with Ledger() as ledger:
            run = ledger.get(gcp.run)
        log = open(run.info["log"]).read()
        assert "store round trip ok: wrote, read back and deleted 65536 bytes" in log
        events = [
            json.loads(line)
            for path in sorted(Path(run.run_dir, "events").glob("*"))
            for line in path.read_text().splitlines()
        ]
        assert max(e.get("step", 0) for e in events) == rehearse.REHEARSAL_STEPS  # train.steps=2 is the real run's
        assert any(e["type"] == "node" for e in events)
        real = [r for r in Ledger().runs() if "rehearse" not in r.name]
        assert len(real) == 1 and real[0].info["cloud"] == "gcp"  # the real launch stands for the kept candidate
        _wait_for_runs_to_end()
        dry = runner.invoke(app, ["launch", "tiny", "--dry-run", "--clouds", "aws,gcp"])
        assert dry.exit_code == 0 and "aws any CPU spot: rehearsal failed" in dry.output
        assert "skipped (--force to keep)" in dry.output
        assert "cloud: aws" not in dry.stdout and "cloud: gcp" in dry.stdout
        forced = runner.invoke(app, ["launch", "tiny", "--dry-run", "--clouds", "aws,gcp", "--force"])
        assert forced.exit_code == 0 and "cloud: aws" in forced.stdout
    finally:
        _wait_for_runs_to_end()


class FakeQueue(FakeSkyJobs):
    """SkyPilot's control plane at the SDK seam: each launch a new job id; the queue says how each ended."""

    def __init__(self, monkeypatch, endings):
        super().__init__(monkeypatch)
        self.endings = endings  # by job name's cloud part: the status its job ends in
        self.jobs: dict[int, str] = {}

    def launch(self, task, name=None):
        self.calls.append(("launch", task, name))
        job_id = 100 + len(self.jobs)
        self.jobs[job_id] = name
        return lambda: ([job_id], None)

    def queue_v2(self, **kwargs):
        self.calls.append(("queue_v2", kwargs))
        now = time.time()
        records = [
            {
                "job_id": job_id,
                "job_name": name,
                "status": next(
                    (status for cloud, status in self.endings.items() if f"-rehearse-{cloud}-" in name), "RUNNING"
                ),
                "end_at": now,
            }
            for job_id, name in self.jobs.items()
            if job_id in kwargs.get("job_ids", [])
        ]
        return lambda: (records, len(records), {}, 0)


def test_a_cloud_rehearsal_submits_each_target_as_a_spot_managed_job_and_the_launch_skips_the_failed(
    monkeypatch, s3_server
):
    monkeypatch.setattr(rehearse, "CLOUD_POLL_SECONDS", 0.05)
    monkeypatch.setenv("HF_TOKEN", "hf_canary_value")
    fake = FakeQueue(monkeypatch, {"aws": "FAILED_SETUP", "gcp": "SUCCEEDED"})
    store = s3_server.bucket("rehearsals") + "/runs"
    result = runner.invoke(app, ["launch", "llama8b", "--cloud", "-y", "-d", "--clouds", "aws,gcp", "--store", store])
    assert result.exit_code == 0, result.output  # the plain launch, before any rehearsal: every candidate
    plain = launched(fake)[-1][0]
    fake.calls.clear()
    result = runner.invoke(
        app, ["launch", "llama8b", "--cloud", "-y", "-d", "--rehearse", "--clouds", "aws,gcp", "--store", store]
    )
    assert result.exit_code == 0, result.output
    jobs = launched(fake)
    rehearsals, (real, real_name) = jobs[:-1], jobs[-1]
    assert [name.split("-rehearse-")[1].split("-")[0] for _, name in rehearsals] == [
        t.key.cloud
        for t in _plan("llama8b", local=False, **{"storage.store": store, "resources.clouds": ["aws", "gcp"]}).targets
    ]
    for task, name in rehearsals:
        resources = list(task.resources)
        assert {r.use_spot for r in resources} == {True} and len({r.cloud for r in resources}) == 1
        assert task.num_nodes == 1 and "-m skyspot.trainer.round_trip" in task.run
        assert "steps: 5," in task.run and "hidden_size: 64" in task.run  # the tiny model's train and model sections
        # Setup is the real run's line for line; only the trainer's prepare step gets the rehearsal's overrides.
        pairs = list(zip(task.setup.splitlines(), plain.setup.splitlines(), strict=True))
        assert all(mine == real or mine.startswith(real + " 'model=") for mine, real in pairs)
        assert sum(mine != real for mine, real in pairs) == 1
    aws_row = next(line for line in result.output.splitlines() if line.startswith("│ aws"))
    assert "failed: FAILED_SETUP" in aws_row
    assert {str(r.cloud).lower() for r in real.resources} == {"gcp"}  # the failed aws candidates left out
    assert {str(r.cloud).lower() for r in plain.resources} == {"aws", "gcp"}
    assert Ledger().get(real_name).status == "PENDING"
