"""The copy of a cloud run's store events kept on this machine (skyspot/events_copy.py): swapped in whole,
never half-written, never outside its folder, unchanged when the store is, never an error of the command
that read the events. That `status` keeps it and the next placement reads it:
tests/executors/sky/test_sky_seam.py."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from skyspot import events_copy
from skyspot.cli.cache import _history_signature as signature
from skyspot.events import read_events_store
from skyspot.storage import open_store


@pytest.mark.parametrize(
    "key, kept",
    [
        ("run/events/attempt-1.node-0.rank-0.jsonl", "events/attempt-1.node-0.rank-0.jsonl"),
        ("run/stale/epoch-3.node-1.jsonl", "stale/epoch-3.node-1.jsonl"),
        ("run/events/../../../.bashrc.jsonl", None),
        ("run/events/sub/x.jsonl", None),
        ("run/events/x.txt", None),
        ("run/events/.hidden.jsonl", None),
        ("other/events/x.jsonl", None),
        ("run/checkpoints/x.jsonl", None),
    ],
)
def test_only_the_runs_own_layout_is_copied(key, kept):
    assert events_copy.relative("run", key) == kept


def event(n: int) -> bytes:
    return (json.dumps({"ts": 1000.0 + n, "type": "step", "attempt": 1, "step": n, "run_id": "r"}) + "\n").encode()


def store_with(tmp_path, files: dict[str, bytes]):
    store = open_store(str(tmp_path / "store"))
    for key, data in files.items():
        store.put_bytes(key, data)
    return store


def copy_of(store, name="r"):
    with events_copy.Copy(name) as copy:
        return read_events_store(store, name, keep=copy.add)


def kept(name="r") -> list[str]:
    where = events_copy.copy_dir(name).resolve()
    return sorted(p.relative_to(where).as_posix() for p in where.rglob("*") if p.is_file())


def entries() -> list[str]:
    """What the folder holds besides the stamp: each run's link and its one version."""
    return sorted(
        "version" if p.name.startswith(events_copy.VERSION) else p.name
        for p in events_copy.root().iterdir()
        if p.name != events_copy.STAMP
    )


def test_a_copy_holds_what_was_read_and_reads_back_the_same(tmp_path):
    store = store_with(
        tmp_path,
        {
            "r/events/attempt-1.node-0.rank-0.jsonl": event(1) + event(2),
            "r/stale/epoch-1.node-0.jsonl": event(3),
            "r/events/nested/x.jsonl": event(9),  # read by status as ever, never written here
        },
    )
    log = copy_of(store)
    assert kept() == ["events/attempt-1.node-0.rank-0.jsonl", "stale/epoch-1.node-0.jsonl"]
    assert [e["step"] for e in events_copy.read("r").events] == [1, 2, 3]
    assert [e["step"] for e in log.events] == [1, 2, 3, 9]
    assert stat.S_IMODE(events_copy.root().stat().st_mode) == 0o700
    assert stat.S_IMODE(events_copy.copy_dir("r").resolve().stat().st_mode) == 0o700
    assert entries() == ["r", "version"] and events_copy.copy_dir("r").is_symlink()


def test_a_new_copy_replaces_the_old_whole_and_moves_the_stamp_only_when_the_store_changed(tmp_path):
    store = store_with(tmp_path, {"r/events/a.jsonl": event(1), "r/events/b.jsonl": event(2)})
    copy_of(store)
    first, version = signature(), events_copy.copy_dir("r").resolve()
    copy_of(store)  # status again, nothing new in the store: render's cache key stays
    assert signature() == first and events_copy.copy_dir("r").resolve() == version
    store.delete(["r/events/b.jsonl"])
    copy_of(store)
    assert kept() == ["events/a.jsonl"] and signature() != first
    assert not version.exists() and entries() == ["r", "version"]


def test_a_read_that_fails_or_finds_nothing_leaves_the_copy_as_it_was(tmp_path):
    store = store_with(tmp_path, {"r/events/a.jsonl": event(1)})
    copy_of(store)
    stamp = signature()
    store.delete(["r/events/a.jsonl"])
    copy_of(store)  # nothing listed (a store emptied by hand): the history keeps what it learnt
    assert kept() == ["events/a.jsonl"]
    with pytest.raises(RuntimeError):
        with events_copy.Copy("r") as copy:
            copy.add("r/events/b.jsonl", event(2))
            raise RuntimeError("the store went away mid-read")
    assert kept() == ["events/a.jsonl"] and signature() == stamp and entries() == ["r", "version"]


def test_a_reader_during_the_swaps_always_finds_one_whole_version(tmp_path):
    """The link is swapped with one rename: a reader never finds no copy, nor one version's events with
    another's stale files."""
    store = store_with(tmp_path, {"r/events/a.jsonl": event(1), "r/stale/s.jsonl": event(2)})
    copy_of(store)
    seen, done = [], threading.Event()

    def read_all_the_time():
        while not done.is_set():
            seen.append(tuple(e["step"] for e in events_copy.read("r").events))

    reader = threading.Thread(target=read_all_the_time)
    reader.start()
    try:
        for n in range(3, 23):  # each read of the store finds one more events file and a new stale one
            store.put_bytes(f"r/events/e{n}.jsonl", event(n))
            store.put_bytes("r/stale/s.jsonl", event(100 + n))
            copy_of(store)
    finally:
        done.set()
        reader.join()
    assert seen and all(len(steps) >= 2 for steps in seen), "a read found no copy or half of one"
    for steps in seen:  # the stale file of the same version as its events files
        newest = max(s for s in steps if s < 100)
        assert max(steps) in (2, 100 + newest), steps


def test_a_copy_that_cannot_be_written_is_no_error(tmp_path):
    store = store_with(tmp_path, {"r/events/a.jsonl": event(1)})
    events_copy.root().parent.mkdir(parents=True, exist_ok=True)
    events_copy.root().write_text("not a folder")  # what mkdir would trip on
    assert [e["step"] for e in copy_of(store).events] == [1]
    assert events_copy.root().read_text() == "not a folder"
    assert events_copy.read("r").events == [] and "store-events:-" in signature()


def test_a_copy_that_cannot_take_its_place_leaves_the_previous_one(tmp_path, monkeypatch):
    store = store_with(tmp_path, {"r/events/a.jsonl": event(1)})
    copy_of(store)
    store.put_bytes("r/events/b.jsonl", event(2))
    real_replace = os.replace

    def refuse_the_swap(source, target):
        if Path(source).name.startswith(".l-"):
            raise PermissionError(13, "Permission denied")
        return real_replace(source, target)

    monkeypatch.setattr(os, "replace", refuse_the_swap)
    assert [e["step"] for e in copy_of(store).events] == [1, 2]  # the read itself is whole
    assert kept() == ["events/a.jsonl"] and entries() == ["r", "version"]


@pytest.mark.parametrize("name", ["../x", "..", "R", ".stamp", "a/b", ""])
def test_a_name_that_is_not_a_run_name_has_no_copy(name):
    with events_copy.Copy(name) as copy:
        copy.add(f"{name}/events/a.jsonl", event(1))
    assert copy.files == 0 and not events_copy.root().exists()
    assert events_copy.copy_dir(name) is None and events_copy.read(name).events == []


def test_a_version_half_made_by_a_killed_reader_goes_once_it_is_an_hour_old(tmp_path):
    store = store_with(tmp_path, {"r/events/a.jsonl": event(1)})
    events_copy.root().mkdir(parents=True)
    killed, running = (events_copy.root() / f"{events_copy.VERSION}r-{x}" for x in ("killed", "running"))
    for folder in (killed, running):
        (folder / "events").mkdir(parents=True)
    hour_ago = time.time() - events_copy.LEFTOVER_S - 60
    os.utime(killed, (hour_ago, hour_ago))
    copy_of(store)
    assert not killed.exists() and running.exists() and kept() == ["events/a.jsonl"]


def test_a_fifo_in_place_of_the_stamp_is_never_opened():
    events_copy.root().mkdir(parents=True)
    os.mkfifo(events_copy.root() / events_copy.STAMP)
    assert "store-events:-" in signature()  # would block forever if it were opened
