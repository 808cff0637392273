"""End to end: planned maintenance an hour ahead (time-scaled) on a GCP node, through the real trainer.

The loopback metadata server plays a GPU VM's `maintenance-event` turning TERMINATE_ON_HOST_MAINTENANCE
with `upcoming-maintenance` giving the window 45 s out (an hour, scaled). The trainer, under the
supervisor and torchrun like a node, must:

    1. checkpoint early, at the next step boundary, and keep training (a `shutdown_warning` event);
    2. 30 s before the window (GCP's notice window, the time the emergency path is built for),
       save an emergency checkpoint of a later step, make it durable locally, and exit 75 for
       recovery, with a `preemption_notice` whose action names the cause: `maintenance`.
"""

from __future__ import annotations

import json
import time

import pytest

from skyspot.executors.local.metadata_server import MetadataServer
from skyspot.trainer.exit_codes import PREEMPTED
from tests.trainer.launch import events, finish, log_text, start, wait_for_file

pytestmark = pytest.mark.slow

GCP_NODE = json.dumps({"cluster_name": "c1", "cloud": "GCP", "region": "us-central1", "zone": "us-central1-a"})
WINDOW_S = 45.0  # the scaled hour
LEAD_S = 30.0  # notice.GCP_NOTICE_WINDOW_S


def test_maintenance_an_hour_ahead_checkpoints_early_trains_on_and_exits_before_the_window(tmp_path):
    run_dir, faults = tmp_path / "run", tmp_path / "faults"
    overrides = ["train.steps=100000", "checkpoint.every_steps=100000", "train.log_every=50", "checkpoint.keep=3"]
    with MetadataServer() as metadata:
        proc = start(
            run_dir,
            overrides,
            SKYPILOT_CLUSTER_INFO=GCP_NODE,
            SKYSPOT_NOTICE_POLL_SECONDS="0.2",
            SKYPILOT_NUM_GPUS_PER_NODE="0",
            SKYSPOT_FAULT="step_end@3/0:hold=120",
            SKYSPOT_FAULT_DIR=str(faults),
            **metadata.env_for("gcp"),
        )
        try:
            wait_for_file(faults / "step_end@3.rank0", proc)
            assert metadata.count("gcp.maintenance_event") >= 1  # watched since setup
            window = time.time() + WINDOW_S
            metadata.announce_maintenance(window)
            deadline = int(window)  # the metadata's own time, to its second
            deadline_seen = time.time() + 10
            while metadata.count("gcp.upcoming_maintenance") == 0 and time.time() < deadline_seen:
                time.sleep(0.05)
            (faults / "step_end@3.rank0.release").write_text("go")
            code = finish(proc, timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert code == PREEMPTED, log_text(run_dir)

    [warning] = events(run_dir, "shutdown_warning")
    assert (warning["source"], warning["action"]) == ("gcp", "maintenance")
    assert warning["deadline"] == pytest.approx(deadline, abs=1.0)
    early = [e for e in events(run_dir, "checkpoint_end") if e["kind"] == "requested"]
    assert early and early[0]["step"] >= 3 and early[0]["ts"] < deadline - LEAD_S  # checkpointed early

    [final] = events(run_dir, "preemption_notice")
    assert (final["source"], final["action"]) == ("gcp", "maintenance")  # the cause, for the cost report
    assert final["received"] >= deadline - LEAD_S - 1.0  # not before the lead ...
    [emergency] = events(run_dir, "emergency_checkpoint")
    assert emergency["step"] > early[0]["step"]  # ... and training went on in between
    steps_between = [e["step"] for e in events(run_dir, "step") if early[0]["step"] < e["step"] <= emergency["step"]]
    assert steps_between  # step events are written by global rank 0 every step
    [exit_] = events(run_dir, "exit")
    assert exit_["code"] == PREEMPTED and exit_["ts"] < deadline  # gone before the maintenance window
