"""A deadline on SkyPilot, at the SDK seam.

SkyPilot's control plane is the only thing faked here, as in test_sky_seam.py: `sky.jobs.launch`,
`queue_v2` and `cancel` and `sky.get` answer like SkyPilot 0.14's API server, with job ids and
statuses a test scripts. The rest is real: `launch --deadline` through the CLI, the controller's
task as a real `sky.Task`, the ledger, the plan file, and the controller's loop reading the run's
events from (and writing its decisions to) a real store, here a local directory.
"""

from __future__ import annotations

import copy

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skyspot.planning import deadline as dl
from skyspot.cli.main import app
from skyspot.events import read_events_store
from skyspot.executors.sky import deadline as sky_deadline
from skyspot.ledger import Ledger
from skyspot.storage import open_store

runner = CliRunner()


class FakeSkyPilot:
    """SkyPilot's API server as managed jobs see it: launches get new job ids; statuses are scripted."""

    def __init__(self, monkeypatch):
        import sky

        from skyspot.executors.sky import sdk as sky_executor

        self.launched: list[tuple[int, object, str]] = []
        self.cancelled: list[int] = []
        self.status: dict[int, str] = {}
        self.where: dict[int, dict] = {}
        self.slow: set[int] = set()
        """The queue record's placement fields per job (cloud, region, zone, cluster_resources), when scripted."""
        self.next_id = 100
        monkeypatch.setattr(sky_executor, "api_server_healthy", lambda: True)
        monkeypatch.setattr(sky_executor, "enabled_clouds", lambda: ["aws", "gcp", "azure"])
        monkeypatch.setattr(sky.jobs, "launch", self.launch)
        monkeypatch.setattr(sky.jobs, "queue_v2", self.queue_v2)
        monkeypatch.setattr(sky.jobs, "cancel", self.cancel)
        monkeypatch.setattr(sky, "get", lambda request: request())
        monkeypatch.setattr(sky, "stream_and_get", lambda request: request())

    def launch(self, task, name=None):
        job_id = self.next_id
        self.next_id += 1
        self.launched.append((job_id, task, name))
        self.status[job_id] = "STARTING"
        return lambda: ([job_id], None)

    def queue_v2(self, refresh=False, job_ids=None, fields=None, **kwargs):
        records = [
            {"job_id": j, "status": self.status[j], **self.where.get(j, {})} for j in job_ids or [] if j in self.status
        ]
        return lambda: (records, len(records), {}, 0)

    def cancel(self, job_ids=None, **kwargs):
        for job_id in job_ids or []:
            self.cancelled.append(job_id)
            # A job in `slow` takes its time to end (its emergency checkpoint, its teardown): CANCELLING.
            self.status[job_id] = "CANCELLING" if job_id in self.slow else "CANCELLED"
        return lambda: None


@pytest.fixture
def remote_api_server(monkeypatch):
    monkeypatch.setattr(sky_deadline, "check_api_server", lambda: None)


def test_launch_with_a_deadline_submits_its_controller_as_a_managed_job(monkeypatch, remote_api_server):
    fake = FakeSkyPilot(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_canary_value")
    before = time.time()
    result = runner.invoke(
        app,
        [
            "launch",
            "llama8b",
            "-y",
            "-d",
            "-n",
            "due-friday",
            "--store",
            "s3://ckpts/runs",
            "--deadline",
            "30h",
            "resources.step_seconds_hint=20",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "all on-demand needs start-up 15m00s + 1,000 steps x 20s" in result.stderr
    ((job_id, task, name),) = fake.launched
    assert name == "due-friday" and task.name == "due-friday"
    # One cheap on-demand CPU node that restarts on errors; it installs skyspot without the training stack.
    resources = list(task.resources)
    assert all(not r.use_spot and r.accelerators is None for r in resources)
    assert "python -m skyspot.executors.sky.deadline /skyspot/deadline/plan.json" in task.run
    assert "--no-deps" in task.setup and "skypilot==" in task.setup and "torch" not in task.setup
    assert task.secrets["HF_TOKEN"].get_secret_value() == "hf_canary_value"  # the stages need it
    run = Ledger().get("due-friday")
    assert run.job_id == job_id and run.info["deadline"]["policy"] == "adaptive"
    assert before + 30 * 3600 <= run.info["deadline"]["at"] <= time.time() + 30 * 3600
    # The plan the controller reads: the run's own task, its wheel mounted on the controller too.
    plan_dir = Path(task.file_mounts[sky_deadline.CONTROLLER_MOUNT])
    plan = json.loads((plan_dir / sky_deadline.PLAN_FILE).read_text())
    assert (plan["run"], plan["store"], plan["total_steps"]) == ("due-friday", "s3://ckpts/runs", 1000)
    assert plan["task"]["envs"]["SKYSPOT_RUN_NAME"] == "due-friday"
    assert plan["task"]["file_mounts"]["/skyspot/package"] == "/skyspot/package"
    assert Path(task.file_mounts["/skyspot/package"]).is_dir()
    assert "hf_canary_value" not in (plan_dir / sky_deadline.PLAN_FILE).read_text()


def test_a_deadline_even_on_demand_cannot_make_is_refused_before_anything_is_recorded(monkeypatch, remote_api_server):
    fake = FakeSkyPilot(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    result = runner.invoke(
        app,
        [
            "launch",
            "llama8b",
            "-y",
            "-n",
            "too-soon",
            "--store",
            "s3://ckpts/runs",
            "--deadline",
            "5h",
            "resources.step_seconds_hint=20",
        ],
    )
    assert result.exit_code == 2
    assert (
        "even all on-demand cannot make the deadline" in result.stderr
        and "start-up 15m00s + 1,000 steps x 20s = 5h48m" in result.stderr
        and "only 5h00m" in result.stderr
    )
    assert not fake.launched and "too-soon" not in {r.name for r in Ledger().runs(include_finished=True)}


def test_a_deadline_on_a_local_api_server_says_what_it_needs(monkeypatch):
    fake = FakeSkyPilot(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    result = runner.invoke(
        app, ["launch", "llama8b", "-y", "-n", "local-api", "--store", "s3://ckpts/runs", "--deadline", "48h"]
    )
    assert result.exit_code == 2
    assert "needs a SkyPilot API server that managed jobs can reach" in result.stderr
    assert not fake.launched and "local-api" not in {r.name for r in Ledger().runs(include_finished=True)}


# --------------------------------------------------------------------------- the controller


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _plan(tmp_path, *, hours: float, steps: int = 100):
    from skyspot.app.launch import build

    built = build("llama8b", [f"train.steps={steps}"], run_name="due", flags={"storage.store": str(tmp_path / "s")})
    start = 1_000_000.0
    deadline = {
        "at": start + hours * 3600,
        "start": start,
        "policy": "uniform-progress",
        "step_seconds_hint": 300.0,
        "period": 60.0,
    }
    return sky_deadline.plan_for(
        built.task, run="due", store=str(tmp_path / "s"), deadline=deadline, total_steps=steps, recipe="llama8b"
    ), start


def _trainer_events(store, attempt: int, spot: bool, steps: range, t0: float, done: bool = False):
    base = {"run_id": "due", "attempt": attempt, "node_rank": 0, "rank": 0}
    lines = [{**base, "ts": t0, "type": "start", "where": {"cloud": "aws", "spot": spot}}]
    lines += [
        {**base, "ts": t0 + 300 * (i + 1), "type": "step", "step": s, "step_seconds": 300.0}
        for i, s in enumerate(steps)
    ]
    if done:
        lines.append({**base, "ts": lines[-1]["ts"] + 1, "type": "exit", "reason": "training complete", "code": 0})
    store.put_bytes(
        f"due/events/attempt-{attempt}.node-0.rank-0.jsonl", "".join(json.dumps(e) + "\n" for e in lines).encode()
    )


def test_the_controller_waits_for_spot_then_switches_to_on_demand_under_the_same_name(monkeypatch, tmp_path):
    fake = FakeSkyPilot(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    plan, start = _plan(tmp_path, hours=20)  # 100 steps x 300 s = 8.3 h of work
    clock = Clock(start)
    store = open_store(plan["store"])
    controller = sky_deadline.CloudController(plan, store=store, clock=clock, sleep=clock.sleep, say=lambda _: None)

    assert controller.step() is None  # the start: a spot stage
    ((spot_id, spot_task, name),) = fake.launched
    assert name == "due" and spot_task.envs["SKYSPOT_RUN_NAME"] == "due"
    assert {r.use_spot for r in spot_task.resources} == {True}

    # SkyPilot keeps retrying spot; within a restart's time that is a changeover, after it no capacity,
    # and with nothing done the run is behind its line: on-demand, under the same name.
    clock.now += 600
    assert controller.step() is None and len(fake.launched) == 1
    clock.now += 600
    assert controller.step() is None
    assert fake.cancelled == [spot_id]
    (od_id, od_task, name) = fake.launched[1]
    assert name == "due" and od_task.envs["SKYSPOT_RUN_NAME"] == "due"
    assert {r.use_spot for r in od_task.resources} == {False}
    assert od_task.run == spot_task.run  # the same trainer, resuming from the store

    # A controller restarted by SkyPilot carries on with the stage it launched.
    again = sky_deadline.CloudController(plan, store=store, clock=clock, sleep=clock.sleep, say=lambda _: None)
    assert (again.stage.job_id, again.stage.mode) == (od_id, dl.ON_DEMAND)

    fake.status[od_id] = "RUNNING"
    _trainer_events(store, 1, False, range(1, 101), clock.now, done=True)
    clock.now += 101 * 300
    fake.status[od_id] = "SUCCEEDED"
    assert again.loop() == 0
    decisions = read_events_store(store, "due").of_type(dl.DECISION_EVENT)
    # The policy's decisions, and the controller's own record of the switch it made (its stages' handover).
    assert [d["reason"] for d in decisions][:5] == ["start", "exploit", "switch", "handed-over", "behind"]
    assert decisions[-1]["reason"] == "done" and decisions[-1]["met"] is True
    assert all(d["deadline"] == plan["deadline"]["at"] for d in decisions)


def test_the_controller_returns_to_spot_once_ahead_of_the_line(monkeypatch, tmp_path):
    fake = FakeSkyPilot(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    plan, start = _plan(tmp_path, hours=40)
    clock = Clock(start)
    store = open_store(plan["store"])
    controller = sky_deadline.CloudController(plan, store=store, clock=clock, sleep=clock.sleep, say=lambda _: None)
    controller.step()
    clock.now += 1200
    controller.step()  # behind, no spot: on-demand
    od_id = fake.launched[-1][0]
    fake.status[od_id] = "RUNNING"
    # 60 of 100 steps done at 6 h: far ahead of 6/40 of the way, even 2 restarts on.
    _trainer_events(store, 1, False, range(1, 61), start + 1200)
    clock.now = start + 6 * 3600
    controller.step()
    # Make-before-break (issue 32): the spot stage is launched while the on-demand one trains on; its nodes
    # wait for the handover (trainer/handover.py) before they touch the store.
    assert od_id not in fake.cancelled
    back_id, back_task, _ = fake.launched[-1]
    assert {r.use_spot for r in back_task.resources} == {True}
    token = back_task.envs["SKYSPOT_HANDOVER"]
    decision = read_events_store(store, "due").of_type(dl.DECISION_EVENT)[-1]
    assert (decision["mode"], decision["reason"], decision["stage"]["job_id"]) == (dl.SPOT, "ahead", od_id)
    assert decision["next"]["job_id"] == back_id and decision["next"]["handover"] == token
    assert store.get_bytes(f"due/handover/{token}") is None
    # SkyPilot is still provisioning it: nothing changes; a restarted controller knows the stage in the making.
    clock.now += 60
    controller.step()
    assert od_id not in fake.cancelled and store.get_bytes(f"due/handover/{token}") is None
    again = sky_deadline.CloudController(plan, store=store, clock=clock, sleep=clock.sleep, say=lambda _: None)
    assert again.next is not None and (again.next.job_id, again.next.handover) == (back_id, token)
    # Its setup done, SkyPilot runs it (its nodes wait): only now is the on-demand stage cancelled (its
    # emergency checkpoint), and then the handover written, so the two never train at once.
    fake.status[back_id] = "RUNNING"
    clock.now += 60
    again.step()
    assert fake.cancelled[-1] == od_id and back_id not in fake.cancelled
    assert json.loads(store.get_bytes(f"due/handover/{token}")) == {
        "from_job_id": od_id,
        "to_job_id": back_id,
        "ts": clock.now,
    }
    handover = [d for d in read_events_store(store, "due").of_type(dl.DECISION_EVENT) if d["reason"] == "handover"]
    assert handover[-1]["stage"]["job_id"] == back_id and "next" not in handover[-1]
    assert again.stage is not None and again.stage.job_id == back_id and again.next is None


def test_a_stage_still_starting_counts_its_changeover_and_a_round_falls_at_the_deadline(monkeypatch, tmp_path):
    """While SkyPilot provisions a stage and runs its setup, the rest of a restart counts from now, and the
    deadline is judged when it passes, not up to a period later (issue 31, item 12)."""
    fake = FakeSkyPilot(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    plan, start = _plan(tmp_path, hours=9)  # 100 steps x 300 s = 30,000 s of work, a 900 s restart prior
    at = plan["deadline"]["at"]
    lines: list[str] = []
    clock = Clock(start)
    store = open_store(plan["store"])
    controller = sky_deadline.CloudController(plan, store=store, clock=clock, sleep=clock.sleep, say=lines.append)
    controller.step()  # too little slack for spot: an on-demand stage, STARTING
    ((stage_id, _, _),) = fake.launched
    clock.now += 600
    controller.step()
    decision = read_events_store(store, "due").of_type(dl.DECISION_EVENT)[-1]
    assert decision["overhead_left"] == 300.0  # 900 s of changeover, 600 s of it gone
    assert decision["projected_finish"] == start + 600 + 300 + 30_000
    clock.now = at - 10
    assert controller.pause() == 10.0  # the next round is the deadline itself
    fake.status[stage_id] = "RUNNING"
    clock.now = at
    controller.step()
    decision = read_events_store(store, "due").of_type(dl.DECISION_EVENT)[-1]
    assert decision["reason"] == dl.UNREACHABLE and decision["ts"] == at
    assert sum("deadline UNREACHABLE" in line for line in lines) == 1
    clock.now += 60
    controller.step()
    assert sum("deadline UNREACHABLE" in line for line in lines) == 1  # said once
    assert controller.pause() == 60.0


def test_a_cancelled_controller_cancels_its_stage(monkeypatch, tmp_path):
    fake = FakeSkyPilot(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    plan, start = _plan(tmp_path, hours=20)
    clock = Clock(start)
    controller = sky_deadline.CloudController(
        plan, store=open_store(plan["store"]), clock=clock, sleep=clock.sleep, say=lambda _: None
    )
    controller.step()
    controller.stop_requested.set()
    assert controller.loop() == 130
    assert fake.cancelled == [fake.launched[0][0]]


def test_a_stage_keeps_one_capacity_of_the_planned_candidates():
    from skyspot.app.launch import build

    task = build("llama8b", []).task
    planned = copy.deepcopy(task["resources"]["ordered"])
    spot = sky_deadline.stage_task(task, spot=True)["resources"]["ordered"]
    on_demand = sky_deadline.stage_task(task, spot=False)["resources"]["ordered"]
    assert spot == [c for c in planned if c["use_spot"]] and on_demand == [c for c in planned if not c["use_spot"]]
    spot_only = build("llama8b", ["resources.on_demand_fallback=false"]).task
    flipped = sky_deadline.stage_task(spot_only, spot=False)["resources"]["ordered"]
    assert flipped and all(not c["use_spot"] for c in flipped)
    assert task["resources"]["ordered"] == planned  # the recorded task is left alone
