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

import pytest
import yaml
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.errors import SkyspotError
from skyspot.events import read_events_store
from skyspot.executors.sky import deadline as sky_deadline
from skyspot.executors.sky.relaunch import Loss, regions_for, relaunch_plan
from skyspot.ledger import Ledger
from skyspot.storage import open_store
from tests.conftest import REPO
from tests.executors.sky.test_sky_deadline import Clock, FakeSkyPilot, remote_api_server  # noqa: F401 (fixture)

runner = CliRunner()
RUNNING_IN = {"cloud": "AWS", "region": "us-east-1", "zone": "us-east-1a"}
SPOT_NODE = "1x[spot](gpus=A100-80GB:8, p4de.24xlarge, cpus=96, mem=1152, disk=512)"


def _llama70b_task() -> dict:
    return yaml.safe_load((REPO / "tasks" / "llama70b.yaml").read_text())


BURST, RESTART = 1800.0, 900.0


def test_after_a_preemption_the_clouds_spot_candidates_go_region_by_region_in_expected_cost_order():
    task = _llama70b_task()
    now = 1_000.0
    plan = relaunch_plan(
        task, [Loss("aws", "us-east-1", "us-east-1a", at=now - 60)], now=now, burst_s=BURST, restart_s=RESTART
    )
    before, after = task["resources"]["ordered"], plan.task["resources"]["ordered"]
    assert plan.leaves
    for accelerators in ("A100-80GB:8", "H100:8"):
        prices = regions_for("aws", accelerators, spot=True)
        pinned = [
            c["region"] for c in after if c["cloud"] == "aws" and c["use_spot"] and c["accelerators"] == accelerators
        ]
        assert sorted(pinned) == sorted(prices)  # every region stays a candidate, the one preempted too
        # us-east-1 counts 2 preemptions in 30 min x 15 min restarts: its expected cost is 2x its price.
        expected = {r: p * (2.0 if r == "us-east-1" else 1.0) for r, p in prices.items()}
        assert pinned == sorted(prices, key=lambda r: (expected[r], prices[r], r))
        assert pinned.index("us-east-1") > list(prices).index("us-east-1")  # moved back: SkyPilot would not
    assert "aws H100:8: us-east-1 from #4 to #9 of 11 regions (spot $17.63/h, expected $35.26/h after 1" in plan.why
    # Other clouds and every on-demand candidate as rendered, in the rendered order.
    assert [c for c in after if c["cloud"] != "aws" or not c["use_spot"]] == [
        c for c in before if c["cloud"] != "aws" or not c["use_spot"]
    ]
    assert task["resources"]["ordered"] == before  # the recorded task is left alone
    expired = relaunch_plan(
        task, [Loss("aws", "us-east-1", None, at=now - BURST)], now=now, burst_s=BURST, restart_s=RESTART
    )
    assert expired.task == task and not expired.leaves


def test_a_region_much_cheaper_than_the_rest_is_not_left():
    """The expected-cost rule, not 'always leave': with short restarts a preemption adds little, and the
    preempted region, still the least expected cost, is where SkyPilot's own recovery goes anyway."""
    task = _llama70b_task()
    short = relaunch_plan(task, [Loss("aws", "us-east-1", None, at=0.0)], now=10.0, burst_s=BURST, restart_s=10.0)
    assert not short.leaves and short.task == task and "staying pays" in short.why
    assert relaunch_plan(task, [], now=10.0, burst_s=BURST, restart_s=RESTART).task == task


def test_an_inline_candidate_is_pinned_by_region_and_a_pinned_one_is_left_alone():
    pinned = {"resources": {"cloud": "aws", "region": "us-east-1", "accelerators": "H100:8", "use_spot": True}}
    loss = [Loss("aws", "us-east-1", None, at=0.0)]
    assert relaunch_plan(pinned, loss, now=1.0, burst_s=BURST, restart_s=RESTART).task == pinned
    inline = {"resources": {"cloud": "aws", "accelerators": "H100:8", "use_spot": True}}
    changed = relaunch_plan(inline, loss, now=1.0, burst_s=BURST, restart_s=RESTART).task["resources"]
    assert changed["cloud"] == "aws" and sorted(c["region"] for c in changed["ordered"]) == sorted(
        regions_for("aws", "H100:8", spot=True)
    )
    regions = [c["region"] for c in changed["ordered"]]
    assert regions.index("us-east-1") > list(regions_for("aws", "H100:8", spot=True)).index("us-east-1")


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
    assert plan["deadline"] is None and plan["burst_seconds"] == BURST  # resources.burst_minutes: 30
    assert Ledger().get("kept").info["supervised"] == {"burst_seconds": BURST}

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
    seen = clock.now
    assert controller.step() is None
    assert fake.cancelled == [first_id]
    second_id, second, name = fake.launched[2]
    assert name == "kept" and second.envs["SKYSPOT_RUN_NAME"] == "kept"
    # SkyPilot's own parse of the next stage: its AWS spot candidates pinned region by region, us-east-1 (twice
    # its price now) behind every region cheaper than that; on-demand as rendered.
    aws_spot = [r for r in second.resources if str(r.cloud) == "AWS" and r.use_spot]
    assert aws_spot and all(r.region is not None for r in aws_spot)
    assert any(str(r.cloud) == "AWS" and not r.use_spot and r.region is None for r in second.resources)
    assert any(
        "preempted in aws/us-east-1 (us-east-1a): relaunching: aws A100-80GB:8: us-east-1 from #2 to #5" in line
        for line in lines
    )
    events = read_events_store(store, "kept").of_type(sky_deadline.PLACEMENT_EVENT)
    assert [e["reason"] for e in events] == ["start", "left", "handed-over"]
    decision = events[1]
    assert decision["previous_job_id"] == first_id and decision["stage"]["job_id"] == second_id
    assert decision["retiring"]["job_id"] == first_id  # recorded before the cancel
    # The next stage's nodes wait for the handover, written once SkyPilot reported the old stage ended.
    token = second.envs["SKYSPOT_HANDOVER"]
    assert store.get_bytes(f"kept/handover/{token}") is not None
    assert decision["losses"] == [{"cloud": "aws", "region": "us-east-1", "zone": "us-east-1a", "at": seen}]

    # A controller restarted by SkyPilot keeps avoiding the region until its time is up.
    again = sky_deadline.CloudController(plan, store=store, clock=clock, sleep=clock.sleep, say=lines.append)
    assert again.stage is not None and again.stage.job_id == second_id
    assert [(p.cloud, p.region) for p in again.losses] == [("aws", "us-east-1")]
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


def test_a_preemption_that_moves_no_region_is_left_to_skypilots_recovery(monkeypatch, tmp_path):
    """With restarts that cost little, the region just preempted keeps its place in every candidate's order:
    the controller counts the preemption, cancels nothing and says why."""
    from skyspot.app.launch import build

    fake = FakeSkyPilot(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    built = build("llama8b", [], run_name="kept", flags={"storage.store": str(tmp_path / "s")})
    plan = sky_deadline.plan_for(
        built.task,
        run="kept",
        store=str(tmp_path / "s"),
        deadline=None,
        total_steps=10,
        recipe="llama8b",
        burst_seconds=BURST,
    )
    clock = Clock(1_000_000.0)
    lines: list[str] = []
    controller = sky_deadline.CloudController(
        plan, store=open_store(plan["store"]), clock=clock, sleep=clock.sleep, say=lines.append
    )
    controller.restart_seconds = 10.0
    controller.step()
    ((stage_id, _, _),) = fake.launched
    fake.status[stage_id], fake.where[stage_id] = "RUNNING", {**RUNNING_IN, "cluster_resources": SPOT_NODE}
    controller.step()
    fake.status[stage_id] = "RECOVERING"
    controller.step()
    controller.step()  # the same recovery is counted once
    assert fake.cancelled == [] and len(fake.launched) == 1
    events = read_events_store(open_store(plan["store"]), "kept").of_type(sky_deadline.PLACEMENT_EVENT)
    assert [e["reason"] for e in events] == ["start", "stays"] and len(events[-1]["losses"]) == 1
    assert any("SkyPilot recovers it (staying pays" in line for line in lines)


def test_the_dry_run_says_where_a_recovery_goes():
    supervised = runner.invoke(
        app, ["launch", "llama8b", "--store", "s3://ckpts/runs", "--dry-run", "resources.supervise=true"]
    )
    plain = runner.invoke(app, ["launch", "llama8b", "--store", "s3://ckpts/runs", "--dry-run"])
    assert supervised.exit_code == 0 and plain.exit_code == 0, supervised.output + plain.output
    assert "recovery: supervised (resources.supervise): skyspot's controller job" in supervised.stderr
    assert "behind every region cheaper than its expected cost for 30 min" in supervised.stderr
    assert "recovery: SkyPilot's own (EAGER_NEXT_REGION" in plain.stderr and "#10021" in plain.stderr


ON_DEMAND_NODE = "1x(gpus=A100-80GB:8, p4de.24xlarge, cpus=96, mem=1152, disk=512)"


def _supervised(monkeypatch, tmp_path, steps: int):
    from skyspot.app.launch import build

    fake = FakeSkyPilot(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    built = build("llama8b", [f"train.steps={steps}"], run_name="due", flags={"storage.store": str(tmp_path / "s")})
    plan = sky_deadline.plan_for(
        built.task,
        run="due",
        store=str(tmp_path / "s"),
        deadline=None,
        total_steps=steps,
        recipe="llama8b",
        burst_seconds=BURST,
    )
    clock = Clock(1_000_000.0)
    lines: list[str] = []
    store = open_store(plan["store"])
    controller = sky_deadline.CloudController(plan, store=store, clock=clock, sleep=clock.sleep, say=lines.append)
    controller.step()
    ((stage_id, _, _),) = fake.launched
    # SkyPilot fell back to on-demand (the task's candidates after spot): RUNNING there, 10 steps at 30 s done.
    fake.status[stage_id] = "RUNNING"
    fake.where[stage_id] = {**RUNNING_IN, "cluster_resources": ON_DEMAND_NODE}
    base = {"run_id": "due", "attempt": 1, "node_rank": 0, "rank": 0}
    t0 = clock.now
    events = [{**base, "ts": t0, "type": "start", "where": {"cloud": "aws", "spot": False}}]
    events += [{**base, "ts": t0 + 30 * i, "type": "step", "step": i, "step_seconds": 30.0} for i in range(1, 11)]
    store.put_bytes("due/events/attempt-1.node-0.rank-0.jsonl", "".join(json.dumps(e) + "\n" for e in events).encode())
    clock.now += 400
    return fake, controller, store, clock, lines, stage_id


def test_a_supervised_run_on_on_demand_goes_back_to_spot_make_before_break(monkeypatch, tmp_path):
    fake, controller, store, clock, lines, od_id = _supervised(monkeypatch, tmp_path, steps=1000)
    controller.step()
    # 990 steps x 30 s left: the switch pays. A spot stage is launched beside the on-demand one, which trains on.
    spot_id, spot_task, name = fake.launched[-1]
    assert spot_id != od_id and name == "due" and {r.use_spot for r in spot_task.resources} == {True}
    token = spot_task.envs["SKYSPOT_HANDOVER"]
    assert fake.cancelled == [] and store.get_bytes(f"due/handover/{token}") is None
    assert any("runs on on-demand: stage" in line and "it pays: 29700s of training left" in line for line in lines)
    clock.now += 60
    controller.step()  # SkyPilot is still getting spot capacity: nothing changes
    assert fake.cancelled == []
    fake.status[spot_id] = "RUNNING"  # its setup done, its nodes wait for the handover
    clock.now += 60
    controller.step()
    assert fake.cancelled == [od_id] and store.get_bytes(f"due/handover/{token}") is not None
    assert controller.stage is not None and (controller.stage.job_id, controller.stage.mode) == (spot_id, "spot")
    reasons = [e["reason"] for e in read_events_store(store, "due").of_type(sky_deadline.PLACEMENT_EVENT)]
    assert reasons == ["start", "spot-back", "handover", "handed-over"]


def test_a_supervised_run_near_its_end_stays_on_on_demand_and_says_why(monkeypatch, tmp_path):
    fake, controller, store, clock, lines, od_id = _supervised(monkeypatch, tmp_path, steps=11)
    controller.step()
    controller.step()
    assert len(fake.launched) == 1 and fake.cancelled == []
    said = [line for line in lines if "going back to spot does not pay" in line]
    assert len(said) == 1 and "30s of training left" in said[0]
    declined = read_events_store(store, "due").of_type(sky_deadline.PLACEMENT_EVENT)[-1]
    assert declined["reason"] == "spot-declined"


def test_the_handover_waits_until_the_old_stage_really_ended(monkeypatch, tmp_path):
    """A stage slow to end after its cancel (a 70B emergency checkpoint, a teardown) keeps its successor's
    nodes waiting: the handover is written only once SkyPilot reports it ended, rounds later."""
    fake, controller, store, clock, lines, od_id = _supervised(monkeypatch, tmp_path, steps=1000)
    controller.step()
    spot_id, spot_task, _ = fake.launched[-1]
    token = spot_task.envs["SKYSPOT_HANDOVER"]
    fake.slow.add(od_id)
    fake.status[spot_id] = "RUNNING"
    clock.now += 60
    controller.step()  # cancels the on-demand stage, which does not end within the wait
    assert fake.status[od_id] == "CANCELLING" and store.get_bytes(f"due/handover/{token}") is None
    assert controller.retiring is not None and controller.retiring.job_id == od_id
    again = sky_deadline.CloudController(controller.plan, store=store, clock=clock, sleep=clock.sleep, say=lines.append)
    assert (
        again.retiring is not None and again.stage is not None and again.stage.job_id == spot_id
    )  # a restart keeps it
    again.step()
    assert store.get_bytes(f"due/handover/{token}") is None
    fake.status[od_id] = "CANCELLED"
    again.step()
    assert store.get_bytes(f"due/handover/{token}") is not None and again.retiring is None


def test_an_error_in_the_middle_of_a_switch_does_not_end_the_run(monkeypatch, tmp_path):
    """SkyPilot's queue out of reach while the old stage is cancelled: the round fails, the next one finishes
    the switch. The old stage's CANCELLED is never read as the run's end."""
    from skyspot.executors.sky import sdk as sky_sdk

    fake, controller, store, clock, lines, od_id = _supervised(monkeypatch, tmp_path, steps=1000)
    controller.step()
    spot_id, spot_task, _ = fake.launched[-1]
    fake.status[spot_id] = "RUNNING"
    real_queue, calls = sky_sdk.queue, []

    def flaky(job_ids):
        calls.append(job_ids)
        if job_ids == [od_id] and od_id in fake.cancelled and len(calls) < 50:
            raise SkyspotError("the SkyPilot API server is not running")
        return real_queue(job_ids)

    monkeypatch.setattr(sky_sdk, "queue", flaky)
    clock.now += 60
    with pytest.raises(SkyspotError):
        controller.step()
    monkeypatch.setattr(sky_sdk, "queue", real_queue)
    clock.now += 60
    assert controller.step() is None  # not 1: the run goes on on the spot stage
    assert controller.stage is not None and controller.stage.job_id == spot_id and controller.retiring is None
    assert store.get_bytes(f"due/handover/{spot_task.envs['SKYSPOT_HANDOVER']}") is not None
    assert not any("the run stops here" in line for line in lines)


def test_a_next_stage_that_fails_before_it_is_ready_is_not_relaunched_every_round(monkeypatch, tmp_path):
    fake, controller, store, clock, lines, od_id = _supervised(monkeypatch, tmp_path, steps=1000)
    controller.step()
    spot_id = fake.launched[-1][0]
    fake.status[spot_id] = "FAILED_NO_RESOURCE"
    for _ in range(5):
        clock.now += 60
        controller.step()
    assert len(fake.launched) == 2 and od_id not in fake.cancelled  # one spot stage, the on-demand one trains on
    reasons = [e["reason"] for e in read_events_store(store, "due").of_type(sky_deadline.PLACEMENT_EVENT)]
    assert reasons.count("next-failed") == 1


def test_a_resumed_supervised_run_starts_a_new_stage(monkeypatch, tmp_path):
    fake, controller, store, clock, lines, od_id = _supervised(monkeypatch, tmp_path, steps=1000)
    controller.stop_requested.set()
    assert controller.loop() == 130 and od_id in fake.cancelled
    resumed = sky_deadline.CloudController(
        controller.plan, store=store, clock=clock, sleep=clock.sleep, say=lines.append
    )
    assert resumed.stage is None
    assert resumed.step() is None and resumed.stage is not None and resumed.stage.job_id != od_id
