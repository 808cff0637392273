"""End to end with a store: torchrun runs against moto's S3 server, fake-gcs-server and Azurite on loopback.

Every resumed run is compared bitwise with the session's uninterrupted 16-step reference
(conftest.py). Each start runs in a fresh run directory, as on a new machine, so everything it
resumes from comes from the bucket alone.

S3 (one bucket, run "s3run"):

    A  16 steps; a GCP preemption notice (loopback metadata server) arrives at step 6: the ranks
       commit step 6, upload it before the deadline, exit 75 through the supervisor
    B  resumes at 6 from the bucket; a checkpoint every 2 steps, keep 1; the server is stopped once
       step 8 is durable and restarted after the final checkpoint is committed: training goes on,
       local checkpoints not yet durable are kept, the final upload catches up; equals the reference

GCS (one bucket, run "gcsrun"), two nodes of one rank each, each node with its own run directory:

    C  8 steps (inside the 10 warm-up steps, so its learning rates equal the reference's):
       finishes; checkpoints 4 and 8 durable (both nodes' markers); events, run.json and final/
       in the bucket
    D  a byte of node 1's shard of step 8 is flipped in the bucket; train.steps=16 in fresh run
       directories: node 1 warns and drops step 8, both nodes fall back to step 4, each
       downloading only its own files, and the result still equals the (one-node) reference

Azure Blob (one container on Azurite, run "azrun"), an Azure node (SKYPILOT_CLUSTER_INFO):

    E  16 steps; an Azure Scheduled Event (Preempt, loopback metadata server) arrives at step 6:
       step 6 is committed and uploaded to the container before its NotBefore, exit 75
    F  a fresh run directory resumes at 6 from the container alone and equals the reference

Six trainings (plus the shared reference): the scenarios share starts, since each start costs
far more than its few steps on two CPU cores.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from skyspot.executors.local.metadata_server import MetadataServer
from skyspot.storage import open_store
from skyspot.trainer import manifest as mf
from skyspot.trainer.exit_codes import PREEMPTED
from tests.trainer.launch import events, finish, log_text, start, start_nodes, wait_for_file

pytestmark = pytest.mark.slow

SHORT = ["train.steps=8", "checkpoint.every_steps=4", "train.log_every=4", "checkpoint.keep=3"]
LONG = ["train.steps=16", "checkpoint.every_steps=4", "train.log_every=4", "checkpoint.keep=3"]
FAST_STORE = {"SKYSPOT_STORE_RETRY_MAX_SECONDS": "1", "SKYSPOT_EVENTS_SYNC_SECONDS": "1"}
GCP_NODE = json.dumps({"cluster_name": "c1", "cloud": "GCP", "region": "us-central1", "zone": "us-central1-a"})
AZURE_NODE = json.dumps({"cluster_name": "c1", "cloud": "Azure", "region": "eastus", "zone": None})


def store_args(uri: str, name: str) -> list[str]:
    return [f"storage.store={uri}", "--run-name", name]


def bucket_events(store, run: str, type: str | None = None) -> list[dict]:
    out = []
    for key in store.list(f"{run}/events/"):
        for line in (store.get_bytes(key) or b"").decode().splitlines():
            if line.strip():
                event = json.loads(line)
                if type is None or event["type"] == type:
                    out.append(event)
    return sorted(out, key=lambda e: e["ts"])


def durable_steps(store, run: str) -> list[int]:
    from skyspot.trainer.remote import remote_checkpoints

    return remote_checkpoints(store, run)


def wait_until(predicate, what: str, proc=None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (code {proc.returncode}) before {what}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def preempt_by_notice(run_dir: Path, overrides: list[str], cloud: str, node: str, faults: Path) -> int:
    """Start a node, hold it at step 6, announce a preemption due in 30 s, let it go: its exit code.
    It saves at once (no training through the window, which tests/executors/local/test_notice_window.py covers)."""
    with MetadataServer() as metadata:
        proc = start(
            run_dir,
            overrides + ["checkpoint.train_through_notice=false"],
            SKYPILOT_CLUSTER_INFO=node,
            SKYSPOT_NOTICE_POLL_SECONDS="0.2",
            SKYSPOT_FAULT="step_end@6/0:hold=120",
            SKYSPOT_FAULT_DIR=str(faults),
            **metadata.env_for(cloud),
            **FAST_STORE,
        )
        wait_for_file(faults / "step_end@6.rank0", proc)
        endpoint = {"gcp": "gcp.preempted", "azure": "azure.scheduled_events"}[cloud]
        served = metadata.count(endpoint)
        metadata.announce_preemption(time.time() + 30)
        wait_until(lambda: metadata.count(endpoint) > served, "the notice reached the watcher", proc)
        time.sleep(0.5)  # the watcher's callback sets the flag
        release(faults, "step_end@6.rank0")
        return finish(proc)


def release(faults: Path, fired: str) -> None:
    (faults / f"{fired}.release").write_text("go")


def assert_equals_reference(run_dir: Path, reference: Path) -> None:
    ours, theirs = (
        load_file(run_dir / "final" / "model.safetensors"),
        load_file(reference / "final" / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    expected = {e["step"]: (e["loss"], e["lr"]) for e in events(reference, "step")}
    got = {e["step"]: (e["loss"], e["lr"]) for e in events(run_dir, "step")}
    assert got and got == {step: expected[step] for step in got}


# --------------------------------------------------------------------------- S3


@pytest.fixture(scope="module")
def s3(s3_server, tmp_path_factory):
    """Starts A (a notice) and B (an outage) against one S3 bucket, each in a fresh run directory."""
    root = tmp_path_factory.mktemp("s3")
    uri = s3_server.bucket()
    store = open_store(uri)
    args = store_args(uri, "s3run")
    runs = {"root": root, "store": store}
    faults = root / "faults"

    runs["A"] = preempt_by_notice(root / "A", LONG + args, "gcp", GCP_NODE, faults)
    runs["durable_after_A"] = durable_steps(store, "s3run")

    b = root / "B"
    proc = start(
        b,
        ["train.steps=16", "checkpoint.every_steps=2", "checkpoint.keep=1", "train.log_every=4"] + args,
        SKYSPOT_FAULT="step_end@9/0:hold=120",
        SKYSPOT_FAULT_DIR=str(faults),
        **FAST_STORE,
    )
    try:
        wait_for_file(faults / "step_end@9.rank0", proc)
        wait_until(lambda: 8 in durable_steps(store, "s3run"), "step 8 durable", proc)
        s3_server.stop()
        runs["outage_began"] = time.time()
        release(faults, "step_end@9.rank0")
        committed = lambda: any(e["step"] == 16 for e in events(b, "checkpoint_end"))  # noqa: E731
        wait_until(committed, "the final checkpoint committed locally", proc)
        runs["local_during_outage"] = [v.step for v in mf.scan(b / "checkpoints") if v.state == "valid"]
        runs["durable_during_outage"] = sorted({e["step"] for e in events(b, "upload_end") if e["durable"]})
        runs["progress_during_outage"] = [e["step"] for e in events(b, "step") if e["ts"] > runs["outage_began"]]
    finally:
        s3_server.start()
    runs["B"] = finish(proc)
    return runs


def test_preemption_notice_commits_uploads_before_the_deadline_and_exits_75(s3):
    store, a = s3["store"], s3["root"] / "A"
    assert s3["A"] == PREEMPTED, log_text(a)
    [notice] = events(a, "preemption_notice")
    assert notice["source"] == "gcp"
    [emergency] = events(a, "emergency_checkpoint")
    assert emergency["step"] == 6 and emergency["durable_before_deadline"] is True
    assert emergency["newest_durable_step"] == 6 and emergency["upload_deadline"] < notice["deadline"]
    assert s3["durable_after_A"] == [4, 6]
    assert [(e["code"], e["step"]) for e in bucket_events(store, "s3run", "exit") if e["attempt"] == 1] == [
        (PREEMPTED, 6)
    ]


def test_next_start_on_a_new_machine_resumes_at_the_emergency_step_from_the_bucket_alone(s3):
    b = s3["root"] / "B"
    [resume] = events(b, "resume")
    assert (resume["step"], resume["source"], resume["attempt"]) == (6, "store", 2)
    assert min(e["step"] for e in events(b, "step")) == 7
    assert json.loads((b / "run.json").read_text())["run_id"] == "s3run"  # the run's own, from the bucket


def test_store_outage_training_continues_nothing_durable_is_lost_and_uploads_catch_up(s3):
    store, b = s3["store"], s3["root"] / "B"
    assert s3["B"] == 0, log_text(b)
    assert s3["progress_during_outage"][-1] == 16  # training never waited for the store
    assert s3["durable_during_outage"] == [8]
    # keep=1, yet 10, 12 and 14 stayed: none was durable, nor anything newer (8 was, and went)
    assert s3["local_during_outage"] == [16, 14, 12, 10]
    assert durable_steps(store, "s3run") == [16]  # caught up; keep=1 in the store too
    assert log_text(b).count("cannot reach the store") == 1  # one warning per outage, not per try
    ends = {e["step"]: e["durable"] for e in events(b, "upload_end")}
    assert ends[8] is True and ends[16] is True and not any(ends.get(s) for s in (10, 12, 14))
    assert all(e["blocked_seconds"] < 1.0 for e in events(b, "checkpoint_end"))  # uploads never block the loop


def test_s3_run_resumed_from_the_bucket_alone_matches_the_reference_and_the_bucket_tells_its_story(s3, reference):
    store, b = s3["store"], s3["root"] / "B"
    assert_equals_reference(b, reference)
    got = {e["step"]: (e["loss"], e["lr"]) for e in bucket_events(store, "s3run", "step")}
    expected = {e["step"]: (e["loss"], e["lr"]) for e in events(reference, "step")}
    assert got == expected  # steps 1-16 across both starts, read from the bucket
    assert json.loads(store.get_bytes("s3run/attempts.json"))["attempt"] == 2
    assert json.loads(store.get_bytes("s3run/run.json"))["run_id"] == "s3run"


# --------------------------------------------------------------------------- GCS


@pytest.fixture(scope="module")
def gcs(gcs_server, tmp_path_factory):
    """C on two nodes, then D on two fresh nodes after node 1's shard of C's newest checkpoint is corrupted."""
    root = tmp_path_factory.mktemp("gcs")
    uri = gcs_server.bucket()
    store = open_store(uri)
    args = store_args(uri, "gcsrun")
    runs = {"root": root, "store": store}

    runs["C"] = [finish(p) for p in start_nodes([root / "C0", root / "C1"], SHORT + args, **FAST_STORE)]
    runs["durable_after_C"] = durable_steps(store, "gcsrun")
    runs["events_after_C"] = bucket_events(store, "gcsrun")
    runs["keys_after_C"] = store.list("gcsrun/")

    key = "gcsrun/checkpoints/step_8/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(store.get_bytes(key))
    data[len(data) // 2] ^= 0x01
    store.put_bytes(key, bytes(data))
    runs["D"] = [finish(p) for p in start_nodes([root / "D0", root / "D1"], LONG + args, **FAST_STORE)]
    return runs


def test_two_node_gcs_run_leaves_durable_checkpoints_with_every_nodes_marker_and_its_events(gcs):
    store, c0 = gcs["store"], gcs["root"] / "C0"
    assert gcs["C"] == [0, 0], log_text(c0) + log_text(gcs["root"] / "C1")
    assert gcs["durable_after_C"] == [4, 8]
    step_8 = sorted(k.rsplit("/", 1)[-1] for k in gcs["keys_after_C"] if "/step_8/" in k)
    assert step_8 == [
        "COMMITTED.node-0-of-2",
        "COMMITTED.node-1-of-2",
        "manifest.node-0.json",
        "manifest.node-1.json",
        "trainer_state_rank_0.pt",
        "trainer_state_rank_1.pt",
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    names = {k.rsplit("/", 1)[-1] for k in gcs["keys_after_C"] if "/events/" in k}
    assert names == {"attempt-1.node-0.rank-0.jsonl", "attempt-1.node-1.rank-1.jsonl"}
    types = [e["type"] for e in gcs["events_after_C"]]
    # Global rank 0 records the run's start before anything else of its own (across nodes the order by
    # time is the nodes' own: node 1's leader may record its fabric first).
    assert [e["type"] for e in gcs["events_after_C"] if e["rank"] == 0][0] == "start"
    assert types.count("exit") == 1 and types.count("step") == 8
    ends = gcs["events_after_C"]
    for step in (4, 8):
        mine = [e for e in ends if e["type"] == "upload_end" and e["step"] == step]
        assert sorted(e["node"] for e in mine) == [0, 1] and any(e["durable"] for e in mine)
    assert json.loads(store.get_bytes("gcsrun/run.json"))["recipe"]["train"]["steps"] == 8
    assert "gcsrun/final/model.safetensors" in gcs["keys_after_C"]
    assert all(e["blocked_seconds"] < 1.0 for e in events(c0, "checkpoint_end"))


def test_corrupted_remote_shard_falls_back_to_the_previous_durable_checkpoint_and_still_matches(gcs, reference):
    d0, d1 = gcs["root"] / "D0", gcs["root"] / "D1"
    assert gcs["D"] == [0, 0], log_text(d0) + log_text(d1)
    [resume] = events(d0, "resume")
    assert (resume["step"], resume["source"], resume["attempt"]) == (4, "store", 2)
    [line] = [s for s in resume["skipped"] if "falling back" in s]
    assert (
        line.startswith("node 1: checkpoint step_8") and "zero_pp_rank_1_mp_rank_00_optim_states.pt' is corrupt" in line
    )
    assert log_text(d0).count("falling back to an earlier checkpoint") == 1
    assert_equals_reference(d0, reference)  # train.steps extended from 8 to 16


# --------------------------------------------------------------------------- Azure Blob


@pytest.fixture(scope="module")
def azure(azure_server, tmp_path_factory):
    """E (an Azure preemption notice) and F (a new machine) against one Azurite container."""
    root = tmp_path_factory.mktemp("azure")
    uri = azure_server.container()
    store = open_store(uri)
    args = store_args(uri, "azrun")
    runs = {"root": root, "store": store}
    runs["E"] = preempt_by_notice(root / "E", LONG + args, "azure", AZURE_NODE, root / "faults")
    runs["durable_after_E"] = durable_steps(store, "azrun")
    runs["F"] = finish(start(root / "F", LONG + args, **FAST_STORE))
    return runs


def test_azure_preemption_notice_makes_the_emergency_checkpoint_durable_in_blob_storage(azure):
    e = azure["root"] / "E"
    assert azure["E"] == PREEMPTED, log_text(e)
    [notice] = events(e, "preemption_notice")
    assert notice["source"] == "azure"
    [emergency] = events(e, "emergency_checkpoint")
    assert (emergency["step"], emergency["durable_before_deadline"], emergency["newest_durable_step"]) == (6, True, 6)
    assert azure["durable_after_E"] == [4, 6]


def test_azure_run_resumed_from_blob_storage_alone_matches_the_reference(azure, reference):
    store, f = azure["store"], azure["root"] / "F"
    assert azure["F"] == 0, log_text(f)
    [resume] = events(f, "resume")
    assert (resume["step"], resume["source"], resume["attempt"]) == (6, "store", 2)
    assert_equals_reference(f, reference)
    got = {e["step"]: (e["loss"], e["lr"]) for e in bucket_events(store, "azrun", "step")}
    assert got == {
        e["step"]: (e["loss"], e["lr"]) for e in events(reference, "step")
    }  # both starts, from the container
    assert "azrun/final/model.safetensors" in store.list("azrun/final/")
