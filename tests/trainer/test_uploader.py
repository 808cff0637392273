"""skyspot.trainer.uploader against a directory, moto's S3 server and fake-gcs-server."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest

from skyspot.errors import CheckpointError, StoreError
from skyspot.events import read_events_dir
from skyspot.storage import GCSStore, S3Store, open_store, parse_store_uri
from skyspot.trainer.rundir import next_attempt_in_store
from skyspot.trainer.remote import download_checkpoint, remote_checkpoints
from skyspot.trainer.uploader import Uploader

RUN = "run-1"
FAST = dict(retry_base_delay=0.05, retry_max_delay=0.2)


def make_checkpoint(run_dir: Path, step: int, files: dict[str, bytes] | None = None) -> Path:
    """A committed local checkpoint as the checkpoint module writes it: files, manifest, marker last."""
    if files is None:
        files = {"model_states.pt": os.urandom(3000), "zero/optim_rank0.pt": os.urandom(5000)}
    directory = run_dir / "checkpoints" / f"step_{step}"
    for rel, data in files.items():
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_bytes(data)
    manifest = {
        "step": step,
        "files": {rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for rel, data in files.items()},
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))
    (directory / "COMMITTED").write_text(json.dumps({"step": step}))
    return directory


def step_keys(store, step: int) -> list[str]:
    return store.list(f"{RUN}/checkpoints/step_{step}/")


class Warnings(list):
    def __call__(self, message: str) -> None:
        self.append(message)


class Wrapped:
    """Our Store protocol with a hook before each put_file; everything else goes to the real store."""

    def __init__(self, store, before_put):
        self._store = store
        self._before_put = before_put

    def __getattr__(self, name):
        return getattr(self._store, name)

    def put_file(self, local_path, key):
        self._before_put(key)
        self._store.put_file(local_path, key)


def upload_ends(tmp_path) -> list[dict]:
    return [
        {k: e[k] for k in ("step", "bytes", "durable", "error")}
        for e in read_events_dir(tmp_path / "run" / "events").of_type("upload_end")
    ]


def test_checkpoint_roundtrip_is_verified_file_by_file(store_uri, tmp_path, events):
    store = open_store(store_uri)
    files = {"big.pt": os.urandom(20 * 1024 * 1024), "small/a.pt": b"a" * 100, "empty": b""}
    local = make_checkpoint(tmp_path / "run", 10, files)
    uploader = Uploader(store, RUN, events, keep=2, **FAST)
    uploader.submit(10, local)
    assert uploader.wait(timeout=30)
    assert uploader.is_durable(10) and uploader.durable_steps() == [10]
    assert remote_checkpoints(store, RUN) == [10]
    assert uploader.close()

    target = download_checkpoint(store, RUN, 10, tmp_path / "resume" / "step_10", max_workers=4)
    for rel, data in files.items():
        assert (target / rel).read_bytes() == data
    assert (target / "COMMITTED").exists()
    assert (target / "manifest.json").read_bytes() == (local / "manifest.json").read_bytes()
    assert [p.name for p in target.parent.iterdir()] == ["step_10"]  # no temp dir left behind
    [end] = upload_ends(tmp_path)
    assert end == {"step": 10, "bytes": sum(map(len, files.values())), "durable": True, "error": None}


def test_marker_is_uploaded_last_after_every_file_is_remote(store_uri, tmp_path):
    store = open_store(store_uri)
    local = make_checkpoint(tmp_path / "run", 5, {f"shard_{i}.pt": os.urandom(100) for i in range(6)})
    order, remote_at_marker = [], []

    def before_put(key):
        order.append(key.rsplit("/", 1)[-1])
        if key.endswith("/COMMITTED.node-0-of-1"):
            remote_at_marker.extend(store.list(f"{RUN}/checkpoints/step_5/"))

    uploader = Uploader(Wrapped(store, before_put), RUN, keep=2, **FAST)
    uploader.submit(5, local)
    assert uploader.close(timeout=30)
    assert order[-2:] == ["manifest.node-0.json", "COMMITTED.node-0-of-1"]
    assert sorted(order[:-2]) == [f"shard_{i}.pt" for i in range(6)]
    assert sorted(k.rsplit("/", 1)[-1] for k in remote_at_marker) == sorted(order[:-1])


def test_a_failed_file_upload_leaves_no_marker(store_uri, tmp_path, events):
    store = open_store(store_uri)
    local = make_checkpoint(tmp_path / "run", 7)

    def before_put(key):
        if key.endswith("optim_rank0.pt"):
            raise StoreError("cannot upload: access denied (AccessDenied)")

    warnings = Warnings()
    uploader = Uploader(Wrapped(store, before_put), RUN, events, keep=2, warn=warnings, **FAST)
    uploader.submit(7, local)
    assert not uploader.close(timeout=30)
    assert not uploader.is_durable(7)
    assert remote_checkpoints(store, RUN) == []
    assert not store.exists(f"{RUN}/checkpoints/step_7/COMMITTED.node-0-of-1")
    assert warnings == ["checkpoint step 7 was not uploaded: cannot upload: access denied (AccessDenied)"]
    assert upload_ends(tmp_path)[0]["durable"] is False
    assert sorted(p.name for p in local.iterdir()) == ["COMMITTED", "manifest.json", "model_states.pt", "zero"]


def test_newer_checkpoint_abandons_the_older_upload_at_a_file_boundary(store_uri, tmp_path, events):
    store = open_store(store_uri)
    old = make_checkpoint(tmp_path / "run", 1, {f"f{i}.pt": os.urandom(1000) for i in range(4)})
    new = make_checkpoint(tmp_path / "run", 2)
    started, release = threading.Event(), threading.Event()

    def before_put(key):
        if "/step_1/" in key:
            started.set()
            assert release.wait(10)

    uploader = Uploader(Wrapped(store, before_put), RUN, events, keep=3, max_workers=1, **FAST)
    uploader.submit(1, old)
    assert started.wait(10)  # step 1 is mid-upload, holding its first file
    uploader.submit(2, new)
    release.set()
    assert uploader.close(timeout=30)

    assert uploader.durable_steps() == [2]
    assert remote_checkpoints(store, RUN) == [2]
    assert step_keys(store, 1) == []  # never got a marker; retention removed its partial file
    assert upload_ends(tmp_path) == [
        {"step": 1, "bytes": 1000, "durable": False, "error": "superseded by step 2"},
        {"step": 2, "bytes": 8000, "durable": True, "error": None},
    ]


def test_retention_keeps_the_newest_durable_checkpoints(store_uri, tmp_path):
    store = open_store(store_uri)
    uploader = Uploader(store, RUN, keep=2, **FAST)
    for step in (100, 200, 300, 400):
        uploader.submit(step, make_checkpoint(tmp_path / "run", step))
        assert uploader.wait(timeout=30)
    uploader.close()
    assert remote_checkpoints(store, RUN) == [300, 400]
    assert uploader.durable_steps() == [300, 400]
    assert step_keys(store, 100) == step_keys(store, 200) == []
    assert len(step_keys(store, 400)) == 4
    # Retention is remote only: every local checkpoint is still there.
    assert all((tmp_path / "run" / "checkpoints" / f"step_{s}" / "COMMITTED").exists() for s in (100, 200))


def test_partial_leftovers_older_than_the_newest_durable_checkpoint_are_removed(store_uri, tmp_path):
    store = open_store(store_uri)
    store.put_bytes(f"{RUN}/checkpoints/step_50/model_states.pt", b"half")  # a preempted upload
    uploader = Uploader(store, RUN, keep=2, **FAST)
    uploader.submit(60, make_checkpoint(tmp_path / "run", 60))
    uploader.close(timeout=30)
    assert step_keys(store, 50) == []
    assert remote_checkpoints(store, RUN) == [60]


def test_corrupt_or_missing_remote_file_is_named_and_nothing_is_left_locally(store_uri, tmp_path):
    store = open_store(store_uri)
    files = {"model_states.pt": os.urandom(4096), "zero/optim_rank0.pt": os.urandom(4096)}
    uploader = Uploader(store, RUN, **FAST)
    uploader.submit(3, make_checkpoint(tmp_path / "run", 3, files))
    assert uploader.close(timeout=30)

    key = f"{RUN}/checkpoints/step_3/zero/optim_rank0.pt"
    store.put_bytes(key, os.urandom(4096))  # same size, different bytes: bit rot
    target = tmp_path / "resume" / "step_3"
    with pytest.raises(CheckpointError) as caught:
        download_checkpoint(store, RUN, 3, target)
    assert str(caught.value) == (
        f"checkpoint step_3 in {store.uri}: file 'zero/optim_rank0.pt' is corrupt (sha256 does not match the manifest)"
    )
    assert not target.parent.exists() or list(target.parent.iterdir()) == []

    store.delete([key])
    with pytest.raises(CheckpointError, match=r"file 'zero/optim_rank0.pt' is missing from the store"):
        download_checkpoint(store, RUN, 3, target)
    assert not target.parent.exists() or list(target.parent.iterdir()) == []

    with pytest.raises(CheckpointError, match=r"step_4 .* is not durable: it lacks a COMMITTED marker of every node"):
        download_checkpoint(store, RUN, 4, target)


def test_resubmitting_a_checkpoint_that_is_already_durable_uploads_nothing(store_uri, tmp_path, events):
    store = open_store(store_uri)
    local = make_checkpoint(tmp_path / "run", 9)
    first = Uploader(store, RUN, **FAST)
    first.submit(9, local)
    assert first.close(timeout=30)
    second = Uploader(Wrapped(store, lambda key: pytest.fail(f"uploaded {key} again")), RUN, events, **FAST)
    second.submit(9, local)  # e.g. resumed from it and saved it again under the same step
    assert second.close(timeout=30)
    assert upload_ends(tmp_path) == [{"step": 9, "bytes": 0, "durable": True, "error": None}]


def test_uncommitted_local_checkpoint_is_not_uploaded(tmp_path):
    store = open_store(tmp_path / "bucket")
    local = make_checkpoint(tmp_path / "run", 4)
    (local / "COMMITTED").unlink()
    warnings = Warnings()
    uploader = Uploader(store, RUN, warn=warnings, **FAST)
    uploader.submit(4, local)
    assert not uploader.close(timeout=30)
    assert step_keys(store, 4) == []
    assert warnings == [
        f"checkpoint step 4 was not uploaded: local checkpoint not uploadable: {local} has no COMMITTED marker"
    ]


def test_flush_until_reports_whether_the_newest_checkpoint_became_durable(tmp_path):
    store = open_store(tmp_path / "bucket")
    release = threading.Event()
    uploader = Uploader(Wrapped(store, lambda key: release.wait(10)), RUN, **FAST)
    assert uploader.flush_until(time.time() + 1)  # nothing submitted, nothing to lose
    uploader.submit(1, make_checkpoint(tmp_path / "run", 1))
    assert not uploader.flush_until(time.time() + 0.2)  # held up past the deadline
    release.set()
    assert uploader.flush_until(time.time() + 10)
    uploader.close()


def test_final_is_uploaded_within_its_deadline_or_left_on_disk_with_one_line(tmp_path):
    """The trainer uploads final/ after the ranks' last barrier, within a deadline: a store that does not
    answer costs that long and no more, and says where the model still is."""
    release = threading.Event()

    class Slow(Wrapped):
        def upload_dir(self, *args, **kwargs):
            release.wait(10)
            return self._store.upload_dir(*args, **kwargs)

    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"w" * 64)
    said: list[str] = []
    uploader = Uploader(Slow(open_store(tmp_path / "bucket"), lambda key: None), RUN, warn=said.append, **FAST)
    start = time.monotonic()
    assert not uploader.put_tree(final, "final", timeout=0.3)
    assert time.monotonic() - start < 2 and said == [f"final/ is not in the store after 0.3 s; it is in {final}"]
    release.set()
    assert uploader.put_tree(final, "final", timeout=10)
    assert (tmp_path / "bucket" / RUN / "final" / "model.safetensors").read_bytes() == b"w" * 64
    uploader.close()


def test_training_never_waits_on_submit(tmp_path):
    release = threading.Event()
    store = Wrapped(open_store(tmp_path / "bucket"), lambda key: release.wait(10))
    uploader = Uploader(store, RUN, **FAST)
    start = time.monotonic()
    for step in range(1, 6):
        uploader.submit(step, make_checkpoint(tmp_path / "run", step))
    assert time.monotonic() - start < 0.5
    release.set()
    assert uploader.close(timeout=30)
    assert uploader.durable_steps()[-1] == 5


@pytest.mark.parametrize("backend", ["s3", "gs"])
def test_outage_is_retried_and_caught_up_with_one_warning(backend, tmp_path, events, request):
    server = request.getfixturevalue({"s3": "s3_server", "gs": "gcs_server"}[backend])
    uri = parse_store_uri(server.bucket())
    # Short SDK retries so the test sees our backoff, not the SDK's.
    store = S3Store(uri.bucket, sdk_attempts=1) if backend == "s3" else GCSStore(uri.bucket, sdk_retry_seconds=0)
    local = make_checkpoint(tmp_path / "run", 20)
    before = {p: p.read_bytes() for p in local.rglob("*") if p.is_file()}
    warnings = Warnings()
    uploader = Uploader(store, RUN, events, keep=2, warn=warnings, **FAST)
    server.stop()
    try:
        uploader.submit(20, local)
        deadline = time.monotonic() + 15
        while not warnings and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # several more failed tries while the store is down
        assert not uploader.is_durable(20)
    finally:
        server.start()
    assert uploader.wait(timeout=30)
    assert uploader.is_durable(20) and remote_checkpoints(store, RUN) == [20]
    assert len(warnings) == 1 and "cannot reach the store" in warnings[0] and "training continues" in warnings[0]
    assert {p: p.read_bytes() for p in local.rglob("*") if p.is_file()} == before
    uploader.submit(21, make_checkpoint(tmp_path / "run", 21))
    assert uploader.close(timeout=30)
    assert len(warnings) == 1
    assert [e["durable"] for e in upload_ends(tmp_path)] == [True, True]


def test_a_dashboards_folder_is_synced_with_the_events_links_left_out(store_uri, tmp_path, events):
    store = open_store(store_uri)
    uploader = Uploader(store, RUN, **FAST)
    board = tmp_path / "run" / "wandb"
    (board / "offline-run-1").mkdir(parents=True)
    (board / "offline-run-1" / "run-x.wandb").write_bytes(b"records")
    (board / "latest-run").symlink_to(board / "offline-run-1")  # as wandb leaves it
    uploader.sync_also(board, "wandb")
    events_dir = tmp_path / "run" / "events"
    events.emit("step", step=1, loss=2.5, lr=1e-4, step_seconds=0.1, samples=8, tokens=1024)
    assert uploader.sync_events(events_dir) == 2
    assert store.list(f"{RUN}/wandb/") == [f"{RUN}/wandb/offline-run-1/run-x.wandb"]
    assert uploader.sync_events(events_dir) == 0  # unchanged: nothing sent again
    (board / "offline-run-1" / "run-x.wandb").write_bytes(b"records and more")
    assert uploader.sync_events(events_dir) == 1
    assert store.get_bytes(f"{RUN}/wandb/offline-run-1/run-x.wandb") == b"records and more"
    uploader.close(timeout=10)


def test_event_files_are_synced_when_they_change(store_uri, tmp_path, events):
    store = open_store(store_uri)
    uploader = Uploader(store, RUN, **FAST)
    events.emit("step", step=1, loss=2.5, lr=1e-4, step_seconds=0.1, samples=8, tokens=1024)
    events_dir = tmp_path / "run" / "events"
    assert uploader.sync_events(events_dir) == 1
    assert uploader.sync_events(events_dir) == 0
    events.emit("step", step=2, loss=2.4, lr=1e-4, step_seconds=0.1, samples=8, tokens=1024)
    assert uploader.sync_events(events_dir) == 1
    assert store.get_bytes(f"{RUN}/events/{events.path.name}") == events.path.read_bytes()

    (tmp_path / "run.json").write_text("{}")
    assert uploader.sync_small(tmp_path / "run.json", "run.json")
    assert store.get_bytes(f"{RUN}/run.json") == b"{}"
    uploader.close()


def test_attempt_counter_increments_per_start(store_uri):
    store = open_store(store_uri)
    assert [next_attempt_in_store(store, RUN) for _ in range(3)] == [1, 2, 3]
    assert next_attempt_in_store(store, "other-run") == 1


def test_event_files_are_synced_in_the_background_and_at_close(tmp_path, events):
    store = open_store(tmp_path / "bucket")
    uploader = Uploader(store, RUN, events_dir=tmp_path / "run" / "events", events_every=0.05, **FAST)
    events.emit("signal", signum=15, name="SIGTERM")
    remote = f"{RUN}/events/{events.path.name}"
    deadline = time.monotonic() + 10
    while store.get_bytes(remote) != events.path.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.get_bytes(remote) == events.path.read_bytes()
    events.emit("exit", code=0, reason="done", step=1)
    uploader.close()
    assert store.get_bytes(remote) == events.path.read_bytes()


# ---------------------------------------------------------------------- several nodes


def node_checkpoint(run_dir: Path, step: int, node: int) -> Path:
    """Node `node`'s part of a checkpoint: its ranks' files only (names unique per rank, as DeepSpeed's are)."""
    return make_checkpoint(
        run_dir,
        step,
        {
            f"zero_pp_rank_{node}_model_states.pt": os.urandom(2000 + node),
            f"trainer_state_rank_{node}.pt": os.urandom(300),
        },
    )


def test_durability_needs_every_nodes_marker_and_the_marker_says_how_many_nodes():
    from skyspot.trainer.remote import is_durable_listing

    assert is_durable_listing(["s/COMMITTED.node-0-of-1"])
    assert not is_durable_listing(["s/COMMITTED.node-0-of-2", "s/manifest.node-1.json"])
    assert is_durable_listing(["s/COMMITTED.node-1-of-2", "s/COMMITTED.node-0-of-2"])
    assert not is_durable_listing(["s/COMMITTED.node-0-of-2", "s/COMMITTED.node-1-of-3"])
    assert not is_durable_listing(["s/COMMITTED", "s/manifest.json"])  # no node markers: not ours


def test_a_checkpoint_written_by_two_nodes_is_durable_only_once_both_uploaded(store_uri, tmp_path):
    store = open_store(store_uri)
    nodes = [Uploader(store, RUN, keep=2, node_rank=k, num_nodes=2, **FAST) for k in (0, 1)]
    parts = [node_checkpoint(tmp_path / f"node{k}", 6, k) for k in (0, 1)]

    nodes[0].submit(6, parts[0])
    assert nodes[0].wait(timeout=30)
    assert nodes[0].is_uploaded(6) and not nodes[0].is_durable(6)
    assert remote_checkpoints(store, RUN) == []
    with pytest.raises(CheckpointError, match=r"not durable: .* \(has node 0 of 2\)"):
        download_checkpoint(store, RUN, 6, tmp_path / "early" / "step_6", node_rank=0)

    nodes[1].submit(6, parts[1])
    assert nodes[1].wait(timeout=30)
    assert nodes[1].is_durable(6)  # the last node to finish sees every marker
    assert remote_checkpoints(store, RUN) == [6]
    assert nodes[0].refresh_durable() == [6] and nodes[0].is_durable(6)
    names = sorted(k.rsplit("/", 1)[-1] for k in step_keys(store, 6))
    assert names == [
        "COMMITTED.node-0-of-2",
        "COMMITTED.node-1-of-2",
        "manifest.node-0.json",
        "manifest.node-1.json",
        "trainer_state_rank_0.pt",
        "trainer_state_rank_1.pt",
        "zero_pp_rank_0_model_states.pt",
        "zero_pp_rank_1_model_states.pt",
    ]

    # Each node gets back exactly what it wrote, under the local names.
    for k in (0, 1):
        target = download_checkpoint(store, RUN, 6, tmp_path / f"fresh{k}" / "step_6", node_rank=k)
        assert sorted(p.name for p in target.iterdir()) == sorted(p.name for p in parts[k].iterdir())
        for path in parts[k].iterdir():
            assert (target / path.name).read_bytes() == path.read_bytes()
    for uploader in nodes:
        uploader.close()


def test_re_uploading_one_nodes_part_withdraws_its_marker_first(tmp_path):
    store = open_store(tmp_path / "bucket")
    for k in (0, 1):
        uploader = Uploader(store, RUN, node_rank=k, num_nodes=2, **FAST)
        uploader.submit(3, node_checkpoint(tmp_path / f"node{k}", 3, k))
        assert uploader.close(timeout=30)
    assert remote_checkpoints(store, RUN) == [3]

    # Node 1 saves step 3 again with other bytes (e.g. resumed from an older step): while its files
    # are replaced, the checkpoint must not count.
    seen = []
    again = node_checkpoint(tmp_path / "again", 3, 1)
    wrapped = Wrapped(store, lambda key: seen.append(remote_checkpoints(store, RUN)))
    uploader = Uploader(wrapped, RUN, node_rank=1, num_nodes=2, **FAST)
    uploader.submit(3, again)
    assert uploader.close(timeout=30)
    assert seen[0] == [] and seen[-1] == []  # not durable from the first file to the marker
    assert remote_checkpoints(store, RUN) == [3]
    target = download_checkpoint(store, RUN, 3, tmp_path / "check" / "step_3", node_rank=1)
    assert (target / "trainer_state_rank_1.pt").read_bytes() == (again / "trainer_state_rank_1.pt").read_bytes()


def test_only_node_0_deletes_and_a_partly_uploaded_step_is_a_leftover(tmp_path):
    store = open_store(tmp_path / "bucket")
    n0 = Uploader(store, RUN, keep=1, node_rank=0, num_nodes=2, **FAST)
    n1 = Uploader(store, RUN, keep=1, node_rank=1, num_nodes=2, **FAST)
    for step in (1, 2):
        n1.submit(step, node_checkpoint(tmp_path / "node1", step, 1))
        assert n1.wait(timeout=30)
        n0.submit(step, node_checkpoint(tmp_path / "node0", step, 0))
        assert n0.wait(timeout=30)
    n0.submit(3, node_checkpoint(tmp_path / "node0", 3, 0))  # node 1 never finishes step 3
    assert n0.wait(timeout=30)
    n1.close(), n0.close()
    assert remote_checkpoints(store, RUN) == [2]
    assert step_keys(store, 1) == []  # node 0 applied keep=1 after step 2 was durable
    assert len(step_keys(store, 3)) == 4  # newer than the newest durable one: never touched


def test_local_copy_may_go_once_it_or_a_newer_checkpoint_is_durable(tmp_path):
    store = open_store(tmp_path / "bucket")
    uploader = Uploader(store, RUN, **FAST)
    uploader.note_durable([5])
    assert [uploader.can_delete_local(s) for s in (3, 5, 7)] == [True, True, False]
    uploader.close()


@pytest.mark.parametrize(
    "left, new, rate, seconds, keep",
    [
        (100, 1000, 100.0, 5.0, True),  # the older one finishes in 1 s, the new one needs 10 s: keep it
        (100, 300, 100.0, 5.0, True),  # both fit, one after the other: keep, then the new one
        (100, 450, 100.0, 5.0, False),  # only the new one fits, and only if the older one goes
        (1000, 1000, 100.0, 5.0, False),  # neither fits: newest wins (the estimate may be pessimistic)
        (100, 1000, None, 5.0, False),  # nothing measured yet: newest wins
    ],
)
def test_an_emergency_upload_abandons_the_one_in_flight_only_when_that_helps(left, new, rate, seconds, keep):
    from skyspot.trainer.uploader import keep_in_flight

    assert keep_in_flight(left, new, rate, seconds) is keep


def test_an_emergency_checkpoint_that_cannot_make_it_waits_behind_an_upload_that_can(tmp_path, events):
    store = open_store(tmp_path / "bucket")
    small = {f"f{i}.pt": os.urandom(1000) for i in range(4)}
    interval_started = threading.Event()

    def before_put(key):
        time.sleep(0.25)  # a slow link: about 3 kB/s for these small files
        if "/step_10/" in key:
            interval_started.set()

    warnings = Warnings()
    uploader = Uploader(Wrapped(store, before_put), RUN, events, warn=warnings, max_workers=1, **FAST)
    uploader.submit(9, make_checkpoint(tmp_path / "run", 9, small))  # measures the throughput
    assert uploader.wait(timeout=30)
    uploader.submit(10, make_checkpoint(tmp_path / "run", 10, small))
    assert interval_started.wait(10)  # 10 is in flight: 4 kB left, seconds away
    uploader.set_deadline(time.time() + 60)
    uploader.submit(12, make_checkpoint(tmp_path / "run", 12, {"big.pt": os.urandom(400_000)}))  # minutes away
    assert not uploader.flush_until(time.time() + 60)  # answered early, once 12 runs: it cannot make it
    assert uploader.is_durable(10)  # and 10 was not thrown away for it
    assert any("queued behind step 10" in w for w in warnings)
    uploader.close(timeout=0)
