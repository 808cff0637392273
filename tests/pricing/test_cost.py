"""Cost and recovery figures, checked against event logs built by hand and arithmetic done by hand.

Prices used (snapshot 2026-11-29):
  aws p4de.24xlarge us-east-1 use1-az6: spot 8.6505, on-demand 27.44705 (per node-hour)
  gcp a2-ultragpu-8g us-east5-a: spot 2.49544 + A100-80GB x8 10.6848 = 13.18024
  gcp a2-ultragpu-8g cheapest on-demand anywhere: us-central1 8.79698 + 14.76958 = 23.56656
"""

from __future__ import annotations

import pytest

from skyspot.pricing import cost
from skyspot.events import EventLog
from skyspot.executors.sky.sdk import placed
from tests.builders import event as ev

P4DE_SPOT = 8.6505
P4DE_ON_DEMAND = 27.44705
A2_ULTRA_SPOT_US_EAST5 = 13.18024
A2_ULTRA_ON_DEMAND_CHEAPEST = 23.56656

AWS_WHERE = {
    "cloud": "aws",
    "region": "us-east-1",
    "zone": "use1-az6",
    "instance_type": "p4de.24xlarge",
    "spot": True,
    "accelerators": {"A100-80GB": 8},
    "num_nodes": 1,
}


@pytest.fixture(autouse=True)
def no_catalog_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SKY_RUNTIME_DIR", str(tmp_path / "sky-runtime"))


def executor(ts, type, attempt, **fields):
    return ev(ts, type, attempt, rank=None, **fields)


def steps(attempt, first, last, t0, seconds=600.0):
    """Steps first..last, one every `seconds`, the first finishing at t0 + seconds."""
    return [
        ev(t0 + seconds * (k - first + 1), "step", attempt, step=k, loss=1.0, step_seconds=seconds)
        for k in range(first, last + 1)
    ]


def log_of(*groups):
    return EventLog(events=sorted((e for g in groups for e in g), key=lambda e: e["ts"]))


# --- scenario 1: no preemption --------------------------------------------------------------

T1 = 1_000_000


def scenario_no_preemption():
    return log_of(
        [executor(T1, "attempt_start", 0, where=AWS_WHERE), ev(T1 + 300, "start", 0, where=AWS_WHERE, world_size=8)],
        steps(0, 1, 10, T1 + 300),  # step 10 done at T1 + 6300
        [
            ev(T1 + 3320, "checkpoint_end", 0, step=5, kind="interval", blocked_seconds=20.0),
            ev(T1 + 6330, "checkpoint_end", 0, step=10, kind="final", blocked_seconds=30.0),
            ev(T1 + 6400, "exit", 0, code=0, reason="complete", step=10),
            executor(T1 + 7200, "attempt_end", 0, code=0, reason="complete"),
        ],
    )


def test_run_without_preemption():
    run = cost.run_cost(scenario_no_preemption())
    [attempt] = run.attempts
    # Billed from attempt_start to attempt_end: 7200 s = 2 h x 1 node at the spot price.
    assert (attempt.start, attempt.end, attempt.seconds, attempt.end_reason) == (T1, T1 + 7200, 7200, "complete")
    assert attempt.billed_hours == 2.0
    assert attempt.cost_usd == pytest.approx(2 * 8.6505)  # 17.301
    assert run.cost_usd == pytest.approx(17.301)
    # Useful: 10 steps x 600 s. Baseline: own instance on demand in us-east-1, for one start-up
    # (attempt start T1 -> step 1 starts T1+300) + the useful steps + one wind-down (step 10 ends
    # T1+6300 -> attempt end T1+7200): an uninterrupted run is billed as long as this one was.
    assert (run.useful_steps, run.useful_seconds) == (10, 6000)
    assert (run.startup_seconds, run.wind_down_seconds, run.baseline_seconds) == (300, 900, 7200)
    assert run.baseline_usd_per_hour == P4DE_ON_DEMAND
    assert run.on_demand_cost_usd == pytest.approx(7200 / 3600 * 27.44705)  # 54.8941
    assert run.savings_usd == pytest.approx(54.8941 - 17.301)  # 37.5931
    assert run.savings_pct == pytest.approx(100 * 37.5931 / 54.8941)  # 68.48 %: the spot discount
    assert run.sagemaker_savings_pct == 0.0  # 1 - 7200/7200
    assert run.goodput == pytest.approx(6000 / 7200)
    assert run.checkpoint_overhead_seconds == 50.0  # 20 + 30
    assert (run.preemptions, run.recoveries, run.mttr_seconds) == (0, 0, None)
    assert (run.lost_steps, run.lost_seconds) == (0, 0)
    assert (run.billed_seconds, run.training_seconds, run.billed_node_hours) == (7200, 7200, 2.0)
    assert (run.price_source, run.price_date) == ("snapshot", "2026-11-29")
    assert run.estimated is True and run.simulated is False and run.warnings == []
    assert run.name == "run-1"


# --- scenario 2: two preemptions, both saved by emergency checkpoints -----------------------

T2 = 2_000_000
TWO_NODES = {**AWS_WHERE, "num_nodes": 2}


def scenario_two_preemptions_saved():
    return log_of(
        # attempt 0: 2 nodes (ranks 0 and 8 log lifecycle events), steps 1..6
        [
            executor(T2, "attempt_start", 0, where=TWO_NODES),
            ev(T2 + 100, "start", 0, where=TWO_NODES),
            ev(T2 + 100, "start", 0, rank=8, node_rank=1, where=TWO_NODES),
        ],
        steps(0, 1, 6, T2 + 100),  # step 6 at T2 + 3700
        [
            executor(T2 + 3750, "preempt_notice_sent", 0, deadline=T2 + 3870),
            ev(T2 + 3752, "preemption_notice", 0, source="aws", deadline=T2 + 3870, action="terminate"),
            ev(T2 + 3780, "emergency_checkpoint", 0, step=6, signal_to_commit_seconds=28.0),
            ev(T2 + 3781, "emergency_checkpoint", 0, rank=8, node_rank=1, step=6, signal_to_commit_seconds=29.0),
            ev(T2 + 3790, "exit", 0, code=0, reason="preempted", step=6),
            ev(T2 + 3795, "exit", 0, rank=8, node_rank=1, code=0, reason="preempted", step=6),
            executor(T2 + 3870, "attempt_end", 0, code=-9, reason="preempted"),
        ],
        # attempt 1: resumes at step 6 on both ranks, steps 7..12
        [
            executor(T2 + 4500, "attempt_start", 1, where=TWO_NODES),
            ev(T2 + 4600, "start", 1, where=TWO_NODES),
            ev(T2 + 4660, "resume", 1, step=6, source="emergency", load_seconds=40.0),
            ev(T2 + 4665, "resume", 1, rank=8, node_rank=1, step=6, source="emergency", load_seconds=45.0),
        ],
        steps(1, 7, 12, T2 + 4665),  # step 7 at T2+5265, 12 at T2+8265
        [
            executor(T2 + 8300, "preempt_notice_sent", 1, deadline=T2 + 8420),
            ev(T2 + 8330, "emergency_checkpoint", 1, step=12, signal_to_commit_seconds=30.0),
            ev(T2 + 8340, "exit", 1, code=0, reason="preempted", step=12),
            executor(T2 + 8420, "attempt_end", 1, code=-9, reason="preempted"),
        ],
        # attempt 2: resumes at step 12, steps 13..20, completes
        [
            executor(T2 + 9000, "attempt_start", 2, where=TWO_NODES),
            ev(T2 + 9100, "start", 2, where=TWO_NODES),
            ev(T2 + 9150, "resume", 2, step=12, source="emergency", load_seconds=30.0),
        ],
        steps(2, 13, 20, T2 + 9150),  # step 13 at T2+9750, 20 at T2+13950
        [
            ev(T2 + 14000, "exit", 2, code=0, reason="complete", step=20),
            executor(T2 + 14400, "attempt_end", 2, code=0, reason="complete"),
        ],
    )


def test_two_preemptions_with_emergency_checkpoints_lose_no_work():
    run = cost.run_cost(scenario_two_preemptions_saved())
    # Attempts: 3870 s, 8420-4500 = 3920 s, 14400-9000 = 5400 s; 2 nodes each.
    assert [a.seconds for a in run.attempts] == [3870, 3920, 5400]
    assert [a.end_reason for a in run.attempts] == ["preempted", "preempted", "complete"]
    assert [a.nodes for a in run.attempts] == [2, 2, 2]
    assert run.billed_seconds == 13190  # 3870 + 3920 + 5400
    assert run.billed_node_hours == pytest.approx(13190 / 3600 * 2)  # 7.32778
    assert run.cost_usd == pytest.approx(13190 / 3600 * 2 * 8.6505)  # 63.3889
    # Every step ran once: 20 x 600 s useful; baseline 2 nodes on demand, with one start-up
    # (T2 -> step 1 starts T2+100) and one wind-down (step 20 ends T2+13950 -> end T2+14400).
    assert (run.useful_steps, run.useful_seconds, run.lost_steps, run.lost_seconds) == (20, 12000, 0, 0)
    assert (run.startup_seconds, run.wind_down_seconds, run.baseline_seconds) == (100, 450, 12550)
    assert run.on_demand_cost_usd == pytest.approx(12550 / 3600 * 2 * 27.44705)  # 191.366932
    assert run.savings_usd == pytest.approx(191.366931944 - 63.388916667)  # 127.978015
    assert run.sagemaker_savings_pct == pytest.approx(100 * (1 - 13190 / 14400))  # 8.4028 %
    assert run.training_seconds == 14400
    assert run.goodput == pytest.approx(12000 / 13190)
    assert (run.preemptions, run.recoveries) == (2, 2)

    first, second = run.recovery_details
    # Notice T2+3750 (executor, before the trainer's 3752) -> checkpoint committed on the last
    # rank T2+3781 -> last rank exits T2+3795 -> attempt 1 nodes up T2+4500 -> restored on
    # every rank T2+4665 -> first step T2+5265.
    assert (
        first.notice_to_checkpoint_seconds,
        first.checkpoint_to_exit_seconds,
        first.notice_to_exit_seconds,
        first.exit_to_start_seconds,
        first.start_to_restore_seconds,
        first.restore_to_first_step_seconds,
        first.total_seconds,
    ) == (31, 14, 45, 705, 165, 600, 1515)
    assert (first.emergency_checkpoint, first.restored_step, first.load_seconds) == (True, 6, 40.0)
    assert (first.lost_steps, first.lost_seconds, first.cause) == (0, 0, "preempted")
    # 8300 -> 8330 -> 8340 -> 9000 -> 9150 -> 9750
    assert (
        second.notice_to_checkpoint_seconds,
        second.checkpoint_to_exit_seconds,
        second.notice_to_exit_seconds,
        second.exit_to_start_seconds,
        second.start_to_restore_seconds,
        second.restore_to_first_step_seconds,
        second.total_seconds,
    ) == (30, 10, 40, 660, 150, 600, 1450)
    assert run.mttr_seconds == 1482.5  # (1515 + 1450) / 2


# --- scenario 3: SIGKILL without an emergency checkpoint (SkyPilot run, trainer events only) -

T3 = 3_000_000
GCP_WHERE = {
    "cloud": "gcp",
    "region": "us-east5",
    "zone": "us-east5-a",
    "instance_type": "a2-ultragpu-8g",
    "spot": True,
    "accelerators": "A100-80GB:8",
    "num_nodes": 1,
}


def scenario_lost_work():
    return log_of(
        [ev(T3, "start", 0, where=GCP_WHERE)],
        steps(0, 1, 8, T3),  # step 8 at T3 + 4800, then killed
        [ev(T3 + 3020, "checkpoint_end", 0, step=5, kind="interval", blocked_seconds=20.0)],
        [
            ev(T3 + 6000, "start", 1, where=GCP_WHERE),
            ev(T3 + 6100, "resume", 1, step=5, source="interval", load_seconds=60.0),
        ],
        steps(1, 6, 12, T3 + 6100),  # step 6 at T3+6700, 12 at T3+10300
        [
            ev(T3 + 9120, "checkpoint_end", 1, step=10, kind="interval", blocked_seconds=20.0),
            ev(T3 + 10400, "exit", 1, code=0, reason="complete", step=12),
        ],
    )


CANDIDATES = [("gcp", "A100-80GB", 8, None), ("aws", "p4de.24xlarge", 8, "us-east-1")]


def test_sigkill_without_emergency_checkpoint_recomputes_steps_since_the_interval_checkpoint():
    run = cost.run_cost(scenario_lost_work(), candidates=CANDIDATES)
    a0, a1 = run.attempts
    # No executor events: attempt 0 spans trainer start to its last event (step 8, T3+4800);
    # it wrote no exit and a later attempt exists, so it was preempted.
    assert (a0.start, a0.end, a0.end_reason) == (T3, T3 + 4800, "preempted")
    assert (a1.start, a1.end, a1.end_reason) == (T3 + 6000, T3 + 10400, "complete")
    assert a0.usd_per_hour == pytest.approx(2.49544 + 10.6848)  # 13.18024, GCP VM + GPU
    assert run.billed_seconds == 9200  # 4800 + 4400
    assert run.cost_usd == pytest.approx(9200 / 3600 * 13.18024)  # 33.682836
    # Steps 6, 7, 8 of attempt 0 ran again in attempt 1: 3 x 600 s lost; 12 steps useful.
    assert (run.lost_steps, run.lost_seconds) == (3, 1800)
    assert (run.useful_steps, run.useful_seconds) == (12, 7200)
    # Baseline: cheapest on demand among candidates = min(gcp 23.56656, aws us-east-1 27.44705).
    assert run.baseline_usd_per_hour == pytest.approx(A2_ULTRA_ON_DEMAND_CHEAPEST)
    assert run.baseline_instance == "gcp a2-ultragpu-8g us-central1"
    # Trainer events only: billing starts at the trainer's start, so the start-up is 0 (a floor);
    # the wind-down is step 12's end T3+10300 -> exit T3+10400.
    assert (run.startup_seconds, run.wind_down_seconds, run.baseline_seconds) == (0, 100, 7300)
    assert run.on_demand_cost_usd == pytest.approx(7300 / 3600 * 23.56656)  # 47.787747
    assert run.savings_usd == pytest.approx(47.787746667 - 33.682835556)  # 14.104911
    assert run.sagemaker_savings_pct == pytest.approx(100 * (1 - 9200 / 10400))  # 11.538 %
    assert run.goodput == pytest.approx(7200 / 9200)
    assert run.checkpoint_overhead_seconds == 40.0

    [recovery] = run.recovery_details
    # No notice, no checkpoint: the clock starts at the last sign of life, T3+4800.
    # 4800 -> start 6000 (1200) -> restored 6100 (100) -> first step 6700 (600); total 1900.
    assert (recovery.notice_at, recovery.checkpoint_at, recovery.emergency_checkpoint) == (None, None, False)
    assert (
        recovery.exit_to_start_seconds,
        recovery.start_to_restore_seconds,
        recovery.restore_to_first_step_seconds,
        recovery.total_seconds,
    ) == (1200, 100, 600, 1900)
    assert (recovery.restored_step, recovery.lost_steps, recovery.lost_seconds) == (5, 3, 1800)
    assert run.mttr_seconds == 1900


# --- scenario 3b: the same run with its store on another cloud (docs/cost.md, worked example) ---

# One checkpoint of Llama-3.1-8B: 8,030,261,248 parameters x 12 bytes (docs/planning.md).
CKPT_8B = 96_363_134_976


def scenario_lost_work_with_store_traffic():
    """Scenario 3, plus what the trainer writes about the store: each interval checkpoint uploaded
    (one `upload_end` per node, here one node), and attempt 1 resuming from the store's copy."""
    events = [
        dict(e, source="store", bytes=CKPT_8B) if e["type"] == "resume" else e for e in scenario_lost_work().events
    ]
    events += [
        ev(T3 + 3400, "upload_end", 0, step=5, bytes=CKPT_8B, seconds=380.0, durable=True, error=None, node=0, nodes=1),
        ev(
            T3 + 9500, "upload_end", 1, step=10, bytes=CKPT_8B, seconds=380.0, durable=True, error=None, node=0, nodes=1
        ),
    ]
    return EventLog(events=sorted(events, key=lambda e: e["ts"]))


def test_an_attempt_on_another_cloud_than_the_store_pays_egress_for_uploads_and_resumes():
    log = scenario_lost_work_with_store_traffic()
    run = cost.run_cost(log, candidates=CANDIDATES, store="s3://my-bucket/runs")
    a0, a1 = run.attempts
    # GPUs on GCP, store on S3. Uploads leave GCP: 96,363,134,976 B = 89.7454 GiB x $0.12 = $10.76942.
    upload = CKPT_8B / 2**30 * 0.12
    # The resume's download leaves AWS: 96.363 GB x $0.09 = $8.67268.
    download = CKPT_8B / 1e9 * 0.09
    assert (a0.egress_upload_bytes, a0.egress_download_bytes) == (CKPT_8B, 0)
    assert (a1.egress_upload_bytes, a1.egress_download_bytes) == (CKPT_8B, CKPT_8B)
    assert a0.egress_usd == pytest.approx(upload) == pytest.approx(10.769420, abs=1e-6)
    assert a1.egress_usd == pytest.approx(upload + download) == pytest.approx(19.442102, abs=1e-6)
    assert a0.compute_usd == pytest.approx(4800 / 3600 * A2_ULTRA_SPOT_US_EAST5)  # 17.573653
    assert a0.cost_usd == pytest.approx(a0.compute_usd + a0.egress_usd)  # 28.343073
    assert "out of gcp at $0.12/GiB" in a0.egress_detail
    assert (run.store_cloud, run.egress_bytes) == ("aws", 3 * CKPT_8B)
    assert run.egress_usd == pytest.approx(30.211521, abs=1e-6)  # 2 uploads + 1 download
    assert run.cost_usd == pytest.approx(33.682836 + 30.211521, abs=1e-5)  # 63.894357
    # The on-demand baseline is compute only, so egress eats the savings: 47.78775 - 63.89436 < 0.
    assert run.on_demand_cost_usd == pytest.approx(47.787747)
    assert run.savings_usd == pytest.approx(47.787747 - 63.894357, abs=1e-5)
    assert run.warnings == []


def test_an_attempt_on_the_store_cloud_or_a_local_store_pays_no_egress():
    log = scenario_lost_work_with_store_traffic()
    for store in ("gs://my-bucket/runs", "/tmp/runs", None):
        run = cost.run_cost(log, candidates=CANDIDATES, store=store)
        assert run.egress_usd == 0 and run.egress_bytes == 0
        assert all(a.egress_usd == 0 and a.egress_upload_bytes == 0 for a in run.attempts)
        assert run.cost_usd == pytest.approx(9200 / 3600 * A2_ULTRA_SPOT_US_EAST5)  # 33.682836, as scenario 3


def test_a_multi_node_resume_from_the_store_is_counted_as_recorded_and_says_so():
    # Two nodes: each uploader reports its own part; `resume` (global rank 0 only) records node 0's part.
    where = {**GCP_WHERE, "num_nodes": 2}
    events = [
        dict(e, where=where) if e["type"] == "start" else e for e in scenario_lost_work_with_store_traffic().events
    ]
    events.append(
        ev(
            T3 + 3401,
            "upload_end",
            0,
            rank=8,
            node_rank=1,
            step=5,
            bytes=CKPT_8B,
            seconds=381.0,
            durable=True,
            error=None,
            node=1,
            nodes=2,
        )
    )
    run = cost.run_cost(EventLog(events=sorted(events, key=lambda e: e["ts"])), store="s3://my-bucket/runs")
    assert run.attempts[0].egress_upload_bytes == 2 * CKPT_8B
    assert run.attempts[1].egress_download_bytes == CKPT_8B
    assert any("node 0's part only" in w for w in run.warnings)


def test_baseline_candidates_may_be_dicts_or_plan_candidates():
    from types import SimpleNamespace

    log = scenario_lost_work()
    # A plan.Candidate-like object: accelerators "A100-80GB:8" on AWS -> p4de.24xlarge, cheapest
    # on-demand region 27.44705; a dict naming the GCP instance in us-east5: 8.79698 + 35.39358.
    as_object = SimpleNamespace(cloud="aws", accelerators="A100-80GB:8", region=None, instance_type=None, spot=True)
    as_dict = {"cloud": "gcp", "instance_type": "a2-ultragpu-8g", "region": "us-east5"}
    run = cost.run_cost(log, candidates=[as_object, as_dict])
    assert run.baseline_usd_per_hour == 27.44705
    assert run.baseline_instance == "aws p4de.24xlarge us-east-1"


def test_queue_record_fills_what_trainer_events_lack():
    # A trainer that only knew its cloud; SkyPilot's queue knows the rest, and one recovery
    # the events never saw (an attempt that died before the trainer started).
    bare = [{**e, "where": {"cloud": "gcp"}} if e["type"] == "start" else e for e in scenario_lost_work().events]
    record = {
        "recovery_count": 2,
        "cloud": "GCP",
        "region": "us-east5",
        "zone": "us-east5-a",
        "cluster_resources": "1x[spot](gpus=A100-80GB:8, a2-ultragpu-8g, ...)",
        "submitted_at": T3 - 600,
        "end_at": T3 + 10400,
        "job_duration": 9200.0,
    }
    run = cost.run_cost(EventLog(events=bare), queue_record=placed(record))  # as SkyExecutor.refresh hands it on
    assert run.attempts[0].instance_type == "a2-ultragpu-8g" and run.attempts[0].spot is True
    assert run.cost_usd == pytest.approx(9200 / 3600 * 13.18024)
    assert run.recoveries == 2


def test_every_attempt_that_did_not_complete_says_why_and_the_run_sums_them_by_cause():
    run = cost.run_cost(scenario_two_preemptions_saved())
    # Attempt 0: the trainer's AWS instance-action notice; attempt 1: the executor's simulated notice only.
    assert [(a.cause, a.cloud_cause) for a in run.attempts] == [
        ("spot-preemption", "terminate"),
        ("spot-preemption", None),
        (None, None),
    ]
    assert [(r.cause, r.interruption_cause, r.cloud_cause) for r in run.recovery_details] == [
        ("preempted", "spot-preemption", "terminate"),
        ("preempted", "spot-preemption", None),
    ]
    assert run.interruptions_by_cause == {"spot-preemption": 2}
    assert run.interruptions == "2 spot preemptions"
    # Scenario 3's attempt 0 wrote nothing after step 8 and a later attempt exists: its node went.
    lost = cost.run_cost(scenario_lost_work(), candidates=CANDIDATES)
    assert [a.cause for a in lost.attempts] == ["node-lost", None] and lost.interruptions == "1 lost node"
    assert cost.run_cost(scenario_no_preemption()).interruptions_by_cause == {}


def test_a_last_attempt_the_queue_record_ends_takes_its_cause_from_the_queue():
    events = [e for e in scenario_lost_work().events if e["attempt"] == 0]
    record = {
        "status": "FAILED_SETUP",
        "end_at": T3 + 5000,
        "cloud": "GCP",
        "region": "us-east5",
        "zone": "us-east5-a",
        "cluster_resources": "1x[spot](gpus=A100-80GB:8, a2-ultragpu-8g, ...)",
    }
    run = cost.run_cost(EventLog(events=events), queue_record=placed(record))
    assert (run.attempts[0].end_reason, run.attempts[0].cause) == ("error", "setup-failed")
    running = cost.run_cost(EventLog(events=events), now=T3 + 5000)
    assert (running.attempts[0].end_reason, running.attempts[0].cause, running.interruptions) == ("running", None, "")


# --- scenario 4: two spot preemptions, then on-demand fallback (local executor, simulated) -

T4 = 4_000_000
SIM_SPOT = {**AWS_WHERE, "simulated": True}
SIM_ON_DEMAND = {**SIM_SPOT, "spot": False}


def scenario_fallback_to_on_demand():
    return log_of(
        [executor(T4, "attempt_start", 0, where=SIM_SPOT), ev(T4 + 60, "start", 0, where=SIM_SPOT)],
        steps(0, 1, 3, T4 + 60),  # step 3 at T4 + 1860
        [
            executor(T4 + 1900, "preempt_notice_sent", 0, deadline=T4 + 2020),
            ev(T4 + 1920, "emergency_checkpoint", 0, step=3, signal_to_commit_seconds=20.0),
            ev(T4 + 1930, "exit", 0, code=0, reason="preempted", step=3),
            executor(T4 + 2020, "attempt_end", 0, code=-9, reason="preempted"),
        ],
        [
            executor(T4 + 2400, "attempt_start", 1, where=SIM_SPOT),
            ev(T4 + 2460, "start", 1, where=SIM_SPOT),
            ev(T4 + 2500, "resume", 1, step=3, source="emergency", load_seconds=20.0),
        ],
        steps(1, 4, 5, T4 + 2500),  # step 4 at T4+3100, 5 at T4+3700
        [
            executor(T4 + 3720, "preempt_notice_sent", 1, deadline=T4 + 3840),
            ev(T4 + 3740, "emergency_checkpoint", 1, step=5, signal_to_commit_seconds=20.0),
            ev(T4 + 3750, "exit", 1, code=0, reason="preempted", step=5),
            executor(T4 + 3840, "attempt_end", 1, code=-9, reason="preempted"),
        ],
        [
            executor(T4 + 4200, "attempt_start", 2, where=SIM_ON_DEMAND),
            ev(T4 + 4260, "start", 2, where=SIM_ON_DEMAND),
            ev(T4 + 4300, "resume", 2, step=5, source="emergency", load_seconds=20.0),
        ],
        steps(2, 6, 10, T4 + 4300),  # step 6 at T4+4900, 10 at T4+7300
        [
            ev(T4 + 7350, "exit", 2, code=0, reason="complete", step=10),
            executor(T4 + 7400, "attempt_end", 2, code=0, reason="complete"),
        ],
    )


def test_fallback_to_on_demand_bills_the_last_attempt_at_the_on_demand_price():
    run = cost.run_cost(scenario_fallback_to_on_demand())
    assert [a.spot for a in run.attempts] == [True, True, False]
    assert [a.seconds for a in run.attempts] == [2020, 1440, 3200]  # 3840-2400, 7400-4200
    assert [a.usd_per_hour for a in run.attempts] == [8.6505, 8.6505, 27.44705]
    spot_cost = (2020 + 1440) / 3600 * 8.6505  # 8.314092
    on_demand_cost = 3200 / 3600 * 27.44705  # 24.397378
    assert run.cost_usd == pytest.approx(spot_cost + on_demand_cost)  # 32.711469
    # One start-up (T4 -> step 1 starts T4+60), one wind-down (step 10 ends T4+7300 -> T4+7400).
    assert (run.startup_seconds, run.wind_down_seconds, run.baseline_seconds) == (60, 100, 6160)
    assert run.on_demand_cost_usd == pytest.approx(6160 / 3600 * 27.44705)  # 46.964952
    assert run.savings_usd == pytest.approx(46.964952222 - 32.711469444)  # 14.253483
    assert run.savings_pct == pytest.approx(100 * 14.253482778 / 46.964952222)  # 30.35 %
    assert run.sagemaker_savings_pct == pytest.approx(10.0)  # 1 - 6660/7400
    assert (run.preemptions, run.recoveries, run.lost_steps) == (2, 2, 0)
    first, second = run.recovery_details
    # 1900 -> 1920 -> 1930 -> 2400 -> 2500 -> 3100 ; 3720 -> 3740 -> 3750 -> 4200 -> 4300 -> 4900
    assert (first.notice_to_exit_seconds, first.exit_to_start_seconds, first.total_seconds) == (30, 470, 1200)
    assert (second.notice_to_exit_seconds, second.exit_to_start_seconds, second.total_seconds) == (30, 450, 1180)
    assert run.mttr_seconds == 1190  # (1200 + 1180) / 2
    assert run.goodput == pytest.approx(6000 / 6660)
    # A local run is priced as the cloud instance it simulated, and says so.
    assert run.simulated is True and all(a.simulated for a in run.attempts)


# --- running runs, output shape ---------------------------------------------------------------


def test_cost_so_far_bills_the_running_attempt_up_to_now():
    # Scenario 2 cut off during attempt 1 (no attempt_end yet), looked at T2 + 6300.
    events = [e for e in scenario_two_preemptions_saved().events if e["ts"] <= T2 + 6000]
    log = EventLog(events=events)
    assert cost.cost_so_far(log, now=T2 + 6300) == pytest.approx((3870 + 1800) / 3600 * 2 * 8.6505)
    run = cost.run_cost(log, now=T2 + 6300)
    assert run.attempts[-1].end_reason == "running" and run.attempts[-1].end == T2 + 6300


def test_an_unpriceable_attempt_is_a_warning_not_a_crash():
    odd = {**AWS_WHERE, "instance_type": "p9.96xlarge"}
    log = log_of(
        [executor(T1, "attempt_start", 0, where=odd), executor(T1 + 3600, "attempt_end", 0, reason="complete")]
    )
    run = cost.run_cost(log)
    assert run.attempts[0].cost_usd is None and run.cost_usd == 0
    assert any("p9.96xlarge" in w for w in run.warnings)


def test_to_dict_field_names_are_stable():
    data = cost.run_cost(scenario_two_preemptions_saved()).to_dict()
    assert list(data) == [
        "name",
        "attempts",
        "recovery_details",
        "cost_usd",
        "on_demand_cost_usd",
        "baseline_usd_per_hour",
        "baseline_instance",
        "savings_usd",
        "savings_pct",
        "sagemaker_savings_pct",
        "preemptions",
        "recoveries",
        "mttr_seconds",
        "lost_steps",
        "lost_seconds",
        "checkpoint_overhead_seconds",
        "useful_steps",
        "useful_seconds",
        "billed_seconds",
        "billed_node_hours",
        "training_seconds",
        "goodput",
        "nodes",
        "price_source",
        "price_date",
        "simulated",
        "estimated",
        "warnings",
        "interval_plans",
        "store_cloud",
        "egress_usd",
        "egress_bytes",
        "startup_seconds",
        "wind_down_seconds",
        "baseline_seconds",
        "interruptions_by_cause",
        "interruptions",
        "restarts_in_place",
        "hangs",
        "in_place_details",
        "mttr_reprovisioned_seconds",
        "mttr_in_place_seconds",
        "lost_steps_reprovisioned",
        "lost_seconds_reprovisioned",
        "lost_steps_in_place",
        "lost_seconds_in_place",
        "evals",
        "eval_seconds",
        "useful_eval_seconds",
        "final_eval_loss",
        "final_eval_perplexity",
        "final_eval_step",
        "final_eval_at",
        "final_train_loss",
        "final_train_step",
        "final_train_diverged",
        "goodput_breakdown",
    ]
    assert list(data["attempts"][0]) == [
        "attempt",
        "cloud",
        "region",
        "zone",
        "instance_type",
        "nodes",
        "spot",
        "start",
        "end",
        "end_reason",
        "seconds",
        "billed_hours",
        "usd_per_hour",
        "cost_usd",
        "price_source",
        "price_date",
        "price_detail",
        "simulated",
        "compute_usd",
        "egress_upload_bytes",
        "egress_download_bytes",
        "egress_usd",
        "egress_detail",
        "cause",
        "cloud_cause",
        "transport",
        "fabric",
    ]
    assert list(data["recovery_details"][0]) == [
        "from_attempt",
        "to_attempt",
        "cause",
        "notice_at",
        "checkpoint_at",
        "exit_at",
        "start_at",
        "restored_at",
        "first_step_at",
        "notice_to_checkpoint_seconds",
        "checkpoint_to_exit_seconds",
        "notice_to_exit_seconds",
        "exit_to_start_seconds",
        "start_to_restore_seconds",
        "restore_to_first_step_seconds",
        "total_seconds",
        "emergency_checkpoint",
        "restored_step",
        "load_seconds",
        "lost_steps",
        "lost_seconds",
        "interruption_cause",
        "cloud_cause",
    ]


def test_plot_draws_a_png():
    from skyspot.pricing.cost_plot import plot_run

    log = scenario_lost_work()
    data = plot_run(cost.run_cost(log, candidates=CANDIDATES), log, "png")
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_checkpoint_intervals_a_run_used_are_reported_oldest_first():
    base = scenario_two_preemptions_saved().events
    plans = [
        {
            "ts": T1 + 10,
            "type": "interval_plan",
            "run_id": "r",
            "attempt": 0,
            "node_rank": 0,
            "rank": 0,
            "every_seconds": 1200.0,
            "reason": "start",
            "inputs": {"bound": "daly", "mtbp_s": 5400.0, "blocking_cost_s": 120.0},
        },
        {
            "ts": T2 + 10,
            "type": "interval_plan",
            "run_id": "r",
            "attempt": 1,
            "node_rank": 0,
            "rank": 0,
            "every_seconds": 900.0,
            "reason": "start",
            "inputs": "not a mapping",
        },
    ]
    run = cost.run_cost(EventLog(events=base + plans))
    assert run.interval_plans == [
        {
            "attempt": 0,
            "every_seconds": 1200.0,
            "bound": "daly",
            "reason": "start",
            "mtbp_s": 5400.0,
            "blocking_cost_s": 120.0,
        },
        {
            "attempt": 1,
            "every_seconds": 900.0,
            "bound": None,
            "reason": "start",
            "mtbp_s": None,
            "blocking_cost_s": None,
        },
    ]
    assert cost.run_cost(scenario_two_preemptions_saved()).interval_plans == []


# --- the README quickstart's shape: a one-time op build in attempt 1, two short recoveries ---

G5_SPOT_US_EAST_1A = 4.5408
G5_ON_DEMAND = 16.288
SIM_G5 = {
    "cloud": "aws",
    "region": "us-east-1",
    "zone": "us-east-1a",
    "instance_type": "g5.48xlarge",
    "spot": True,
    "accelerators": None,
    "num_nodes": 1,
    "simulated": True,
}


def scenario_quickstart():
    """`skyspot launch tiny --local --preempt-at-steps 60,130 --notice 5` on a fresh machine: attempt 1
    builds DeepSpeed's op for 75 s before step 1; steps take 0.08 s; each recovery costs ~14 s."""
    t = 5_000_000.0
    return log_of(
        [executor(t, "attempt_start", 1, where=SIM_G5), ev(t + 4, "start", 1, where=SIM_G5)],
        steps(1, 1, 62, t + 85, seconds=0.08),  # step 62 ends t+89.96
        [
            executor(t + 90, "preempt_notice_sent", 1, deadline=t + 95),
            ev(t + 90.4, "emergency_checkpoint", 1, step=62, signal_to_commit_seconds=0.4),
            ev(t + 90.5, "exit", 1, code=75, reason="preempted", step=62),
            executor(t + 93, "attempt_end", 1, code=75, reason="preempted"),
            executor(t + 95, "attempt_start", 2, where=SIM_G5),
            ev(t + 99, "start", 2, where=SIM_G5),
            ev(t + 104, "resume", 2, step=62, source="local", load_seconds=0.02),
        ],
        steps(2, 63, 132, t + 104, seconds=0.08),  # step 132 ends t+109.6
        [
            executor(t + 110, "preempt_notice_sent", 2, deadline=t + 115),
            ev(t + 110.4, "emergency_checkpoint", 2, step=132, signal_to_commit_seconds=0.4),
            ev(t + 110.5, "exit", 2, code=75, reason="preempted", step=132),
            executor(t + 113, "attempt_end", 2, code=75, reason="preempted"),
            executor(t + 115, "attempt_start", 3, where=SIM_G5),
            ev(t + 119, "start", 3, where=SIM_G5),
            ev(t + 124, "resume", 3, step=132, source="local", load_seconds=0.02),
        ],
        steps(3, 133, 200, t + 124, seconds=0.08),  # step 200 ends t+129.44
        [
            ev(t + 129.6, "exit", 3, code=0, reason="complete", step=200),
            executor(t + 133, "attempt_end", 3, code=0, reason="complete"),
        ],
    )


def test_the_quickstart_saves_money_because_an_on_demand_run_pays_the_first_start_too():
    run = cost.run_cost(scenario_quickstart())
    assert [a.usd_per_hour for a in run.attempts] == [G5_SPOT_US_EAST_1A] * 3
    assert run.baseline_usd_per_hour == G5_ON_DEMAND
    assert run.billed_seconds == pytest.approx(93 + 18 + 18)  # 129 s of spot
    # One start-up (t -> step 1 starts t+85: the op build included), 200 x 0.08 s, one wind-down
    # (step 200 ends t+129.44 -> t+133).
    assert run.startup_seconds == pytest.approx(85)
    assert run.useful_seconds == pytest.approx(16)
    assert run.wind_down_seconds == pytest.approx(3.56)
    assert run.on_demand_cost_usd == pytest.approx(104.56 / 3600 * G5_ON_DEMAND)  # 0.47308
    assert run.cost_usd == pytest.approx(129 / 3600 * G5_SPOT_US_EAST_1A)  # 0.16271
    assert run.savings_usd == pytest.approx(0.473076 - 0.162712, abs=1e-5)
    assert 60 < run.savings_pct < 70  # 65.6 %
    # Counting only the useful step time, as before, would have shown spot losing money.
    assert run.useful_seconds / 3600 * G5_ON_DEMAND < run.cost_usd


def test_an_uninterrupted_run_saves_exactly_the_spot_discount():
    run = cost.run_cost(scenario_no_preemption())
    assert run.baseline_seconds == run.billed_seconds
    assert run.savings_pct == pytest.approx(100 * (1 - P4DE_SPOT / P4DE_ON_DEMAND))


def test_the_plotted_baseline_ends_at_the_reported_baseline_and_money_keeps_its_sign():
    from skyspot.pricing.cost_plot import _usd, baseline_curve

    run = cost.run_cost(scenario_quickstart())
    points = baseline_curve(run, cost.step_runs(scenario_quickstart()), run.attempts[0].start)
    assert points[1][1] == pytest.approx(85 / 3600 * G5_ON_DEMAND)  # the start-up comes first
    assert points[-1][1] == pytest.approx(run.on_demand_cost_usd)
    assert [p[1] for p in points] == sorted(p[1] for p in points)
    assert _usd(-0.0912) == r"-\$0.09" and _usd(1234.5) == r"\$1,234.50"
