"""Each simulated cloud takes a spot VM back on its own timeline, on the local executor.

AWS: the notice's `time` two minutes ahead, SIGTERM then, the VM gone a short shutdown later. GCP: the
notice and SIGTERM together, the VM gone 30 s later. Azure: a Preempt with NotBefore, no signal, the
VM gone at NotBefore. `--notice` scales the whole shape, and the watchers' period with it.

The fast tests drive `launch tiny --local` with a stand-in node (tests/executors/local/test_local_controller.py's
`nodes`) that runs the real notice watcher against the controller's real loopback metadata server and
records what reached it; the slow ones run the real trainer under torchrun, one per cloud.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from skyspot.clouds import AWS_POLL_S, AZURE_POLL_S, NOTICE_WINDOWS_S
from skyspot.events import read_events_dir
from skyspot.executors.local.controller import AWS_SHUTDOWN_S, Timeline, timeline_for
from skyspot.ledger import Ledger
from skyspot.executors.local.metadata_server import AZURE_RATE_LIMIT
from tests.executors.local.test_local_controller import launch, nodes  # noqa: F401 (nodes is a fixture)

CLOUDS = ("aws", "gcp", "azure")


# --------------------------------------------------------------------------- the shapes


def test_each_cloud_has_its_own_timeline_at_full_scale():
    assert timeline_for("aws") == Timeline("aws", 120.0, 120.0, 120.0 + AWS_SHUTDOWN_S, AWS_POLL_S, 1.0)
    assert timeline_for("gcp") == Timeline("gcp", 30.0, 0.0, 30.0, 1.0, 1.0)  # SIGTERM with the notice, 30 s in all
    assert timeline_for("azure") == Timeline("azure", 30.0, None, 30.0, AZURE_POLL_S, 1.0)  # no signal at all


def test_gcps_period_is_the_watchers_own_retry_period():
    from skyspot.clouds.gcp import GCP_RETRY_S

    assert timeline_for("gcp").poll_seconds == GCP_RETRY_S  # the controller may not import the watcher


@pytest.mark.parametrize("cloud", CLOUDS)
@pytest.mark.parametrize("notice", [1.0, 4.0, 10.0, 20.0])
def test_a_scaled_window_scales_the_whole_shape_and_the_watchers_period(cloud, notice):
    full, scaled = timeline_for(cloud), timeline_for(cloud, notice)
    scale = notice / NOTICE_WINDOWS_S[cloud]
    assert scaled.window == notice and scaled.scale == pytest.approx(scale)
    assert scaled.kill_after == pytest.approx(full.kill_after * scale)
    assert (scaled.sigterm_after is None) == (full.sigterm_after is None)
    if full.sigterm_after is not None:
        assert scaled.sigterm_after == pytest.approx(full.sigterm_after * scale)
    # The cloud's period shrinks with the window, never below Azure's rate limit, never above a quarter.
    assert scaled.poll_seconds <= max(notice / 4, 1.0 / (AZURE_RATE_LIMIT - 1))
    assert scaled.poll_seconds < full.poll_seconds
    if cloud == "azure":
        assert 1.0 / scaled.poll_seconds < AZURE_RATE_LIMIT


def test_a_window_longer_than_the_clouds_keeps_the_clouds_period_and_grace_replaces_only_aws_shutdown():
    assert timeline_for("aws", 600).poll_seconds == AWS_POLL_S
    assert timeline_for("aws", 4, grace=60).kill_after == 64.0
    assert timeline_for("gcp", 4, grace=60).kill_after == 4.0  # GCP's hard off is the window itself
    assert timeline_for("azure", 4, grace=60).kill_after == 4.0  # Azure's is NotBefore


# --------------------------------------------------------------------------- the controller, a stand-in node

# A node that runs the real watcher the way the trainer starts it (its period from the environment the
# controller sets), writes what reached it, and ignores SIGTERM, so only the cloud's hard off ends it.
STAND_IN = """
import json, os, signal, time
from skyspot.trainer.notice import start_notice_watcher

out = os.path.join(os.environ["SKYSPOT_RUN_DIR"], "node.jsonl")

def note(**fields):
    with open(out, "a") as f:
        f.write(json.dumps({"ts": time.time(), **fields}) + "\\n")

signal.signal(signal.SIGTERM, lambda *_: note(kind="sigterm"))
poll = float(os.environ["SKYSPOT_NOTICE_POLL_SECONDS"])
note(kind="start", poll=poll, cloud=json.loads(os.environ["SKYPILOT_CLUSTER_INFO"])["cloud"])
watcher = start_notice_watcher(on_notice=lambda n: note(kind="notice", source=n.source, deadline=n.deadline),
                               poll_interval=poll)
while True:
    time.sleep(0.05)
"""


@pytest.mark.parametrize("cloud", CLOUDS)
def test_a_preemption_follows_the_simulated_clouds_timeline(cloud, nodes, tmp_path):  # noqa: F811
    script = tmp_path / "node.py"
    script.write_text(STAND_IN)
    nodes["run"] = [f"exec {sys.executable} {script}", "exit 0"]  # attempt 2 runs on-demand and succeeds
    result = launch("--simulate", cloud, "--preempt-every", "1", "--notice", "4", "--fallback-after", "1")
    assert result.exit_code == 0, result.output
    run_dir = Path(Ledger().get("run-1").run_dir)
    events = [e for e in read_events_dir(run_dir / "events").events if e.get("attempt") == 1]
    timeline = timeline_for(cloud, 4)

    # What the controller did, in order, and when it planned each step (all from one clock reading).
    kinds = [e["type"] for e in events if e["type"].startswith("preempt_")]
    assert kinds == (
        ["preempt_notice_sent", "preempt_sigkill"]
        if cloud == "azure"
        else ["preempt_notice_sent", "preempt_sigterm", "preempt_sigkill"]
    )
    sent = next(e for e in events if e["type"] == "preempt_notice_sent")
    assert sent["cloud"] == cloud
    assert sent["kill_at"] - sent["deadline"] == pytest.approx(timeline.kill_after - timeline.window)
    if cloud == "azure":
        assert sent["sigterm_at"] is None
    else:
        assert sent["sigterm_at"] - sent["deadline"] == pytest.approx(timeline.sigterm_after - timeline.window)
    by_type = {e["type"]: e for e in events}
    assert by_type["preempt_sigkill"]["ts"] >= sent["kill_at"]  # never before the cloud's hard off
    if cloud != "azure":
        assert by_type["preempt_sigterm"]["ts"] >= sent["sigterm_at"]
    end = by_type["attempt_end"]
    assert end["reason"] == "preempted" and end["node_codes"] == [-9]

    # What reached the node: the cloud's period, the notice through its own endpoint, SIGTERM or not.
    seen = [json.loads(line) for line in (run_dir / "node.jsonl").read_text().splitlines()]
    first = [s for s in seen if s["ts"] < end["ts"]]
    start = next(s for s in first if s["kind"] == "start")
    assert start["poll"] == pytest.approx(timeline.poll_seconds)
    notice = next(s for s in first if s["kind"] == "notice")
    assert notice["source"] == cloud
    sigterms = [s for s in first if s["kind"] == "sigterm"]
    assert len(sigterms) == (0 if cloud == "azure" else 1)
    if cloud in ("aws", "azure"):  # the cloud's own deadline, to its second (IMDS and NotBefore carry whole seconds)
        assert sent["deadline"] - 1 < notice["deadline"] <= sent["deadline"]
    if cloud == "aws":
        assert notice["ts"] < sigterms[0]["ts"]  # two (scaled) minutes of warning before the signal


# --------------------------------------------------------------------------- the real trainer, one run per cloud


@pytest.mark.slow
# AWS's timeline with the real trainer is every other local e2e test's (test_local_executor.py and the
# rest run on the default simulated cloud, aws); its shape is checked above. GCP and Azure only here.
@pytest.mark.parametrize("cloud", [c for c in CLOUDS if c != "aws"])
def test_a_preempted_run_on_each_cloud_loses_no_step_on_its_timeline(cloud, reference):
    from tests.executors.local.test_local_executor import OVERRIDES, check_preempted_run
    from tests.executors.local.test_local_executor import launch as launch_tiny

    name = f"timeline-{cloud}"
    # A 20 s window: GCP's 30 s and Azure's, two thirds of the time, AWS's 120 s a sixth; enough for an
    # emergency checkpoint on a loaded 2-core machine, which is what the shape is tested with.
    result = launch_tiny(
        "-n",
        name,
        "--simulate",
        cloud,
        "--preempt-at-steps",
        "6",
        "--notice",
        "20",
        "--provision-delay",
        "0.5",
        *OVERRIDES,
    )
    assert result.exit_code == 0, result.output
    check_preempted_run(name, reference, [6])  # emergency checkpoint at the notice's step, exact resume
    run_dir = Path(Ledger().get(name).run_dir)
    first = [e for e in read_events_dir(run_dir / "events").events if e.get("attempt") == 1]
    sent = next(e for e in first if e["type"] == "preempt_notice_sent")
    notice = next(e for e in first if e["type"] == "preemption_notice" and e.get("rank") == 0)
    exit_event = next(e for e in first if e["type"] == "exit" and e.get("rank") == 0)
    assert sent["cloud"] == cloud and notice["source"] == cloud
    assert exit_event["code"] == 75 and exit_event["ts"] < sent["kill_at"]  # saved and gone before the hard off
    signals = {e["type"] for e in first} & {"preempt_sigterm", "preempt_sigkill"}
    assert "preempt_sigkill" not in signals
    if cloud == "gcp":
        assert signals == {"preempt_sigterm"}  # SIGTERM came with the notice
    if cloud == "azure":
        assert signals == set()  # Azure sends no signal; the notice alone saved the work
