"""Fencing (skyspot.trainer.fence) against each store's own server: a directory, moto's S3 server,
fake-gcs-server and Azurite. Two attempts of one run alive at once: the newer one's epoch refuses
every commit of the older one, whose marker may lie in the store but never counts."""

from __future__ import annotations

import json
import threading

import pytest

from skyspot.errors import StoreError
from skyspot.events import read_events_dir, read_events_store
from skyspot.storage import open_store
from skyspot.trainer import fence
from skyspot.trainer.durable import Probe, StoreTier
from skyspot.trainer.fence import Fence, Stale
from skyspot.trainer.remote import is_durable_listing, listing, plan_part, remote_checkpoints
from skyspot.trainer.uploader import Uploader
from tests.trainer.test_uploader import FAST, RUN, Warnings, Wrapped, make_checkpoint, node_checkpoint


def legacy(store):
    return lambda: {s: k for s, k in listing(store, RUN, fenced=False).items() if is_durable_listing(k)}


def test_epochs_only_grow_and_a_store_written_before_fencing_keeps_its_checkpoints(store_uri, tmp_path):
    store = open_store(store_uri)
    old = Uploader(store, RUN, keep=None, **FAST)  # as before fencing: no epoch taken at a start
    for step in (2, 4):
        old.submit(step, make_checkpoint(tmp_path / "old", step))
        assert old.wait(timeout=30)
    old.close()
    store.delete([f"{RUN}/{fence.FENCE}"])  # a store written by a version without fencing
    assert remote_checkpoints(store, RUN) == [2, 4]  # no fence: the markers alone count, as before

    epochs = [Fence(store, RUN).take(legacy(store)) for _ in range(3)]
    assert epochs == [1, 2, 3]
    doc = fence.read(store, RUN)
    assert doc["epoch"] == 3 and doc["commits"] == {"2": {"0/1": 0}, "4": {"0/1": 0}}
    assert remote_checkpoints(store, RUN) == [2, 4]  # migrated: still durable


def test_the_older_attempts_commits_are_refused_once_a_newer_one_started(store_uri, tmp_path, events):
    store = open_store(store_uri)
    a = Fence(store, RUN)
    assert a.take(legacy(store)) == 1
    warnings = Warnings()
    older = Uploader(store, RUN, events, keep=None, warn=warnings, fence=a, **FAST)
    older.submit(2, make_checkpoint(tmp_path / "a", 2))
    assert older.wait(timeout=30) and remote_checkpoints(store, RUN) == [2]

    b = Fence(store, RUN)
    assert b.take(legacy(store)) == 2  # the newer attempt starts: from now on only it commits
    older.submit(4, make_checkpoint(tmp_path / "a", 4))
    assert older.wait(timeout=30) and not older.is_uploaded(4)
    assert older.stale is not None and (older.stale.epoch, older.stale.newer) == (1, 2)
    assert remote_checkpoints(store, RUN) == [2]  # step 4's marker may be there: it does not count
    with pytest.raises(Exception, match="not durable"):
        plan_part(store, RUN, 4)
    older.close()
    assert [w for w in warnings if "stale" in w] == [
        "the upload of step 4 refused: attempt epoch 1 is stale, the run's store is held by epoch 2; "
        "this attempt stops (a newer one carries the run on)"
    ]
    record = json.loads(store.get_bytes(fence.stale_record_key(RUN, 1, 0)))
    assert (record["type"], record["epoch"], record["newer"], record["node"]) == ("stale_attempt", 1, 2, 0)
    from_store = [e for e in read_events_store(store, RUN).events if e["type"] == "stale_attempt"]
    assert [(e["attempt"], e["epoch"], e["newer"]) for e in from_store] == [(1, 1, 2)]  # what status reads
    stale = [e for e in read_events_dir(tmp_path / "run" / "events").events if e["type"] == "stale_attempt"]
    assert [(e["epoch"], e["newer"]) for e in stale] == [(1, 2)]

    newer = Uploader(store, RUN, keep=None, fence=b, **FAST)
    newer.submit(4, make_checkpoint(tmp_path / "b", 4))  # the same step, this time by the holder
    assert newer.wait(timeout=30) and remote_checkpoints(store, RUN) == [2, 4]
    newer.submit(6, make_checkpoint(tmp_path / "b", 6))
    assert newer.wait(timeout=30) and remote_checkpoints(store, RUN) == [2, 4, 6]
    newer.close()


def test_a_newer_attempt_that_starts_while_the_marker_is_written_still_wins(store_uri, tmp_path):
    """The race the check before an upload cannot close: the takeover lands after the check, before the
    marker. The marker is then in the store, but the fence's swap refuses it, so it never counts."""
    store = open_store(store_uri)
    a = Fence(store, RUN)
    a.take(legacy(store))

    def takeover(key: str) -> None:
        if key.endswith("COMMITTED.node-0-of-1") and "step_4" in key:
            Fence(store, RUN).take(legacy(store))

    older = Uploader(Wrapped(store, takeover), RUN, keep=None, fence=a, warn=Warnings(), **FAST)
    for step in (2, 4):
        older.submit(step, make_checkpoint(tmp_path / "a", step))
        assert older.wait(timeout=30)
    older.close()
    assert f"{RUN}/checkpoints/step_4/COMMITTED.node-0-of-1" in store.list(f"{RUN}/checkpoints/step_4/")
    assert older.stale is not None and older.stale.what == "the commit of step 4"
    assert remote_checkpoints(store, RUN) == [2]
    assert fence.read(store, RUN)["commits"] == {"2": {"0/1": 1}}


def test_a_stale_attempt_neither_deletes_nor_syncs_events_nor_uploads_final(tmp_path):
    store = open_store(tmp_path / "bucket")
    a = Fence(store, RUN)
    a.take(legacy(store))
    events_dir = tmp_path / "run" / "events"
    events_dir.mkdir(parents=True)
    (events_dir / "attempt-1.node-0.rank-0.jsonl").write_text('{"type": "start"}\n')
    older = Uploader(store, RUN, keep=1, fence=a, warn=Warnings(), **FAST)
    older.submit(2, make_checkpoint(tmp_path / "a", 2))
    assert older.wait(timeout=30)
    Fence(store, RUN).take(legacy(store))
    (events_dir / "attempt-1.node-0.rank-0.jsonl").write_text('{"type": "start"}\n{"type": "step"}\n')
    assert older.sync_events(events_dir) == 0
    assert store.get_bytes(f"{RUN}/events/attempt-1.node-0.rank-0.jsonl") is None
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "model.safetensors").write_bytes(b"x" * 10)
    assert not older.put_tree(tmp_path / "final", "final")
    assert store.list(f"{RUN}/final/") == []
    older.submit(4, make_checkpoint(tmp_path / "a", 4))  # would delete step 2 (keep=1) were it the holder
    assert older.wait(timeout=30) and not older.is_uploaded(4)
    older.close()
    assert remote_checkpoints(store, RUN) == [2]


def test_nodes_of_one_attempt_commit_at_once_and_no_commit_is_lost(store_uri, tmp_path):
    store = open_store(store_uri)
    epoch = Fence(store, RUN).take(legacy(store))
    nodes = 4
    uploaders = [
        Uploader(store, RUN, keep=None, node_rank=k, num_nodes=nodes, fence=Fence(store, RUN, epoch), **FAST)
        for k in range(nodes)
    ]
    for step in (1, 2):
        threads = [
            threading.Thread(target=u.submit, args=(step, node_checkpoint(tmp_path / f"n{k}", step, k)))
            for k, u in enumerate(uploaders)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(u.wait(timeout=60) for u in uploaders)
    for u in uploaders:
        u.close()
    doc = fence.read(store, RUN)
    assert doc["commits"] == {str(s): {f"{k}/{nodes}": epoch for k in range(nodes)} for s in (1, 2)}
    assert remote_checkpoints(store, RUN) == [1, 2]


def test_the_probe_takes_the_epoch_before_it_lists_what_to_resume_from(tmp_path):
    store = open_store(tmp_path / "bucket")

    class Placement:
        node_rank, num_nodes, local_world_size = 0, 1, 1

    first = StoreTier(str(tmp_path / "bucket"), RUN, Placement(), store=store).probe()
    second = StoreTier(str(tmp_path / "bucket"), RUN, Placement(), store=store).probe()
    in_place = StoreTier(str(tmp_path / "bucket"), RUN, Placement(), store=store).probe(count=False)
    assert isinstance(first, Probe) and (first.epoch, second.epoch, in_place.epoch) == (1, 2, None)
    assert fence.read(store, RUN)["epoch"] == 2  # a restart in place takes none: it keeps its attempt's


def test_a_fence_that_is_not_one_is_a_one_line_store_error(tmp_path):
    store = open_store(tmp_path / "bucket")
    store.put_bytes(f"{RUN}/{fence.FENCE}", b"[1, 2]")
    with pytest.raises(StoreError, match=r"fence\.json is not a fence record"):
        remote_checkpoints(store, RUN)

    class Placement:
        node_rank, num_nodes, local_world_size = 0, 1, 1

    probe = StoreTier(str(tmp_path / "bucket"), RUN, Placement(), store=store).probe()
    assert probe.usage_error and "is not a fence record" in probe.usage_error and "\n" not in probe.usage_error
    assert store.get_bytes(f"{RUN}/{fence.FENCE}") == b"[1, 2]"  # nothing overwritten


def test_stale_is_raised_again_once_learnt():
    class Never:
        uri = "mem://"

    f = Fence(Never(), RUN, epoch=1)  # type: ignore[arg-type]
    f.stale = Stale(1, 3, "x")
    with pytest.raises(Stale):
        f.check("anything")
