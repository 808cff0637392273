"""Events read from a bucket keep the local files' cap (issue 31, item 9): each object is fetched by a ranged
read of at most the cap + 1 bytes, one past the cap is skipped and named, never downloaded whole. On every
backend, against its real protocol server (moto, fake-gcs-server, Azurite)."""

from __future__ import annotations

import json

import pytest

from skyspot import events
from skyspot.events import oversized_note, read_events_store

CAP = 4096


def test_a_ranged_read_returns_at_most_the_limit_and_one_byte(store):
    store.put_bytes("r/blob", b"x" * 10_000)
    store.put_bytes("r/empty", b"")
    store.put_bytes("r/small", b"abc")
    assert len(store.get_bytes("r/blob", limit=100)) == 101
    assert store.get_bytes("r/small", limit=100) == b"abc"
    assert store.get_bytes("r/empty", limit=100) == b""
    assert store.get_bytes("r/missing", limit=100) is None
    assert len(store.get_bytes("r/blob")) == 10_000


def test_an_events_object_past_the_cap_is_skipped_named_and_the_rest_read(store, monkeypatch):
    monkeypatch.setattr(events, "MAX_EVENTS_FILE_BYTES", CAP)
    line = (
        json.dumps(
            {"ts": 1.0, "run_id": "r", "attempt": 0, "node_rank": 0, "rank": None, "type": "attempt_start"}
        ).encode()
        + b"\n"
    )
    store.put_bytes("r/events/attempt-0.executor.jsonl", line)
    store.put_bytes("r/events/attempt-0.node-0.rank-0.jsonl", line * (CAP // len(line) + 5))  # past the cap
    store.put_bytes("r/events/attempt-1.executor.jsonl", b"")
    log = read_events_store(store, "r")
    assert [e["type"] for e in log.events] == ["attempt_start"]
    assert log.oversized == ["r/events/attempt-0.node-0.rank-0.jsonl"] and log.malformed == 1
    note = oversized_note(log.oversized)
    assert note is not None and "\n" not in note
    assert note.startswith("skipped 1 events file(s) over") and note.endswith("attempt-0.node-0.rank-0.jsonl")


@pytest.mark.parametrize("size", [CAP, CAP + 1])
def test_the_cap_is_exact(store, monkeypatch, size):
    """An object of exactly the cap is read; one byte more is skipped (the ranged read's one byte past it)."""
    monkeypatch.setattr(events, "MAX_EVENTS_FILE_BYTES", CAP)
    store.put_bytes("r/events/attempt-0.executor.jsonl", b"\n" * size)
    log = read_events_store(store, "r")
    assert log.oversized == ([] if size == CAP else ["r/events/attempt-0.executor.jsonl"])
