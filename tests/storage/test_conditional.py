"""Conditional writes (get_versioned / put_if) on a directory, moto S3, fake-gcs-server and Azurite:
the compare-and-swap the fencing protocol is built on (skyspot.storage.store.PreconditionFailed)."""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from skyspot.storage import LocalStore, PreconditionFailed, S3Store
from skyspot.storage.local import LOCK_NAME


def test_a_missing_key_has_no_bytes_and_no_version(store):
    assert store.get_versioned("lease/missing") == (None, None)


def test_create_only_succeeds_once(store):
    first = store.put_if("lease/holder", b"node-a", None)
    assert store.get_versioned("lease/holder") == (b"node-a", first)
    with pytest.raises(PreconditionFailed, match="lease/holder"):
        store.put_if("lease/holder", b"node-b", None)
    assert store.get_versioned("lease/holder") == (b"node-a", first)


def test_the_current_version_writes_and_returns_a_new_one(store):
    v1 = store.put_if("lease/holder", b"node-a", None)
    v2 = store.put_if("lease/holder", b"node-b", v1)
    assert v2 != v1
    assert store.get_versioned("lease/holder") == (b"node-b", v2)
    v3 = store.put_if("lease/holder", b"node-b", v2)
    assert store.get_versioned("lease/holder") == (b"node-b", v3)


def test_the_same_bytes_again_are_a_new_version_except_on_s3(store):
    v1 = store.put_if("lease/holder", b"node-a", None)
    v2 = store.put_if("lease/holder", b"node-a", v1)
    if isinstance(store, S3Store):
        # S3's ETag of a single-part object is the MD5 of its bytes (real S3 as moto), so rewriting the
        # same bytes keeps the token: a protocol that must tell rewrites apart counts in the bytes.
        assert v2 == v1
    else:
        assert v2 != v1
        with pytest.raises(PreconditionFailed):
            store.put_if("lease/holder", b"node-a", v1)


def test_a_stale_version_fails_and_leaves_the_object_unchanged(store):
    v1 = store.put_if("lease/holder", b"node-a", None)
    v2 = store.put_if("lease/holder", b"node-b", v1)
    with pytest.raises(PreconditionFailed, match="lease/holder"):
        store.put_if("lease/holder", b"node-c", v1)
    assert store.get_versioned("lease/holder") == (b"node-b", v2)


def test_a_version_of_a_deleted_object_fails_and_creates_nothing(store):
    v1 = store.put_if("lease/holder", b"node-a", None)
    store.delete(["lease/holder"])
    with pytest.raises(PreconditionFailed, match="lease/holder"):
        store.put_if("lease/holder", b"node-b", v1)
    assert store.get_versioned("lease/holder") == (None, None)


def _race(put, count: int = 2) -> list[object]:
    """Run `put(i)` for i in range(count) in threads released together; each result or error, in order."""
    barrier = threading.Barrier(count)
    results: list[object] = [None] * count

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = put(i)
        except Exception as error:
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def _one_winner(results: list[object]) -> int:
    winners = [i for i, r in enumerate(results) if isinstance(r, str)]
    losers = [r for r in results if isinstance(r, PreconditionFailed)]
    assert len(winners) == 1 and len(losers) == len(results) - 1, results
    return winners[0]


@pytest.mark.parametrize("round", range(3))
def test_two_writers_at_the_same_version_exactly_one_wins(store, round):
    base = store.put_if("lease/holder", b"start", None)
    results = _race(lambda i: store.put_if("lease/holder", f"node-{i}".encode(), base))
    winner = _one_winner(results)
    assert store.get_versioned("lease/holder") == (f"node-{winner}".encode(), results[winner])


@pytest.mark.parametrize("round", range(3))
def test_two_creators_exactly_one_wins(store, round):
    results = _race(lambda i: store.put_if(f"lease/new-{round}", f"node-{i}".encode(), None))
    winner = _one_winner(results)
    assert store.get_versioned(f"lease/new-{round}") == (f"node-{winner}".encode(), results[winner])


def _put_from_process(root: str, version: str | None, name: str, start, results) -> None:
    start.wait()
    try:
        results.put((name, LocalStore(root).put_if("lease/holder", name.encode(), version)))
    except PreconditionFailed:
        results.put((name, None))


@pytest.mark.parametrize("create", [True, False], ids=["create", "update"])
def test_local_writers_in_two_processes_exactly_one_wins(tmp_path, create):
    store = LocalStore(tmp_path / "store")
    version = None if create else store.put_if("lease/holder", b"start", None)
    context = multiprocessing.get_context("spawn")
    start, results = context.Event(), context.Queue()
    processes = [
        context.Process(target=_put_from_process, args=(str(store.root), version, name, start, results))
        for name in ("proc-a", "proc-b")
    ]
    for process in processes:
        process.start()
    start.set()
    outcome = dict(results.get(timeout=60) for _ in processes)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    winners = [name for name, token in outcome.items() if token is not None]
    assert len(winners) == 1, outcome
    assert store.get_versioned("lease/holder") == (winners[0].encode(), outcome[winners[0]])


def test_local_lock_file_is_neither_listed_nor_a_key(tmp_path):
    store = LocalStore(tmp_path)
    store.put_if("a", b"1", None)
    assert (tmp_path / LOCK_NAME).exists()
    assert store.list() == ["a"]
    with pytest.raises(ValueError, match="lock file"):
        store.put_bytes(LOCK_NAME, b"x")


@pytest.mark.parametrize(
    ("code", "status", "version", "failed"),
    [
        ("PreconditionFailed", 412, "etag", True),
        ("ConditionalRequestConflict", 409, "etag", True),
        ("ConditionalRequestConflict", 409, None, True),
        ("NoSuchKey", 404, "etag", True),
        ("NoSuchKey", 404, None, False),
        ("SlowDown", 503, "etag", False),
    ],
)
def test_s3_answers_that_mean_another_writer_won(code, status, version, failed):
    """moto answers a lost race with 412 only; real S3 may answer 409 ConditionalRequestConflict, which
    no emulator here produces, so the classification is checked on botocore's own error type."""
    from botocore.exceptions import ClientError

    from skyspot.storage.s3 import _s3_precondition_failed

    error = ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
    assert _s3_precondition_failed(error, version) is failed
