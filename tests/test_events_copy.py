"""The copy of a cloud run's store events kept on this machine (skyspot/events_copy.py): replaced whole,
never half-written, never outside its folder, never an error of the command that read the events. That
`status` keeps it and the next placement reads it: tests/executors/sky/test_sky_seam.py."""

from __future__ import annotations

import json
from pathlib import Path
import stat
import time

import pytest

from skyspot import events_copy
from skyspot.events import EVENTS_DIR, STALE_DIR, read_events_store
from skyspot.cli.cache import _history_signature as signature
from skyspot.storage import open_store


def test_the_folders_are_the_events_modules():
    assert events_copy._DIRS == (EVENTS_DIR, STALE_DIR)


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
    where = events_copy.copy_dir(name)
    return sorted(p.relative_to(where).as_posix() for p in where.rglob("*") if p.is_file())


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
    home = events_copy.root()
    assert (
        stat.S_IMODE(home.stat().st_mode) == 0o700 and stat.S_IMODE(events_copy.copy_dir("r").stat().st_mode) == 0o700
    )
    assert [p.name for p in home.iterdir() if p.name.startswith(".") and p.name != events_copy.STAMP] == []


def test_a_new_copy_replaces_the_old_whole_and_moves_the_stamp(tmp_path):
    store = store_with(tmp_path, {"r/events/a.jsonl": event(1), "r/events/b.jsonl": event(2)})
    copy_of(store)
    first = signature()
    store.delete(["r/events/b.jsonl"])
    copy_of(store)
    assert kept() == ["events/a.jsonl"] and signature() != first


def test_a_read_that_fails_or_finds_nothing_leaves_the_copy_as_it_was(tmp_path):
    store = store_with(tmp_path, {"r/events/a.jsonl": event(1)})
    copy_of(store)
    stamp = signature()
    store.delete(["r/events/a.jsonl"])
    copy_of(store)  # nothing listed (a store emptied by hand): the history keeps what it learnt
    assert kept() == ["events/a.jsonl"]
    store.put_bytes("r/events/b.jsonl", event(2))
    with pytest.raises(RuntimeError):
        with events_copy.Copy("r") as copy:
            copy.add("r/events/b.jsonl", event(2))
            raise RuntimeError("the store went away mid-read")
    assert kept() == ["events/a.jsonl"] and signature() == stamp
    assert sorted(p.name for p in events_copy.root().iterdir()) == sorted(["r", events_copy.STAMP])  # no leftovers


def test_a_copy_that_cannot_be_written_is_no_error(tmp_path):
    store = store_with(tmp_path, {"r/events/a.jsonl": event(1)})
    events_copy.root().parent.mkdir(parents=True, exist_ok=True)
    events_copy.root().write_text("not a folder")  # what mkdir would trip on
    assert [e["step"] for e in copy_of(store).events] == [1]
    assert events_copy.root().read_text() == "not a folder"
    assert events_copy.read("r").events == [] and "store-events/.stamp:-" in signature()


def test_a_name_that_is_not_a_run_name_is_not_kept():
    with events_copy.Copy("../x") as copy:
        copy.add("../x/events/a.jsonl", event(1))
    assert copy.files == 0 and not events_copy.root().exists()


def test_a_copy_half_made_by_a_killed_reader_goes_once_it_is_an_hour_old(tmp_path):
    import os

    store = store_with(tmp_path, {"r/events/a.jsonl": event(1)})
    events_copy.root().mkdir(parents=True)
    stale, fresh = events_copy.root() / ".new-r-killed", events_copy.root() / ".new-r-running"
    for folder in (stale, fresh):
        (folder / "events").mkdir(parents=True)
    hour_ago = time.time() - events_copy.LEFTOVER_S - 60
    os.utime(stale, (hour_ago, hour_ago))
    copy_of(store)
    assert not stale.exists() and fresh.exists() and kept() == ["events/a.jsonl"]


def test_a_copy_that_cannot_take_its_place_leaves_the_previous_one(tmp_path, monkeypatch):
    store = store_with(tmp_path, {"r/events/a.jsonl": event(1)})
    copy_of(store)
    store.put_bytes("r/events/b.jsonl", event(2))
    real_rename = Path.rename

    def refuse_the_new_copy(self, target):
        if self.name.startswith(".new-"):
            raise PermissionError(13, "Permission denied")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", refuse_the_new_copy)
    assert [e["step"] for e in copy_of(store).events] == [1, 2]  # the read itself is whole
    assert kept() == ["events/a.jsonl"]
    assert sorted(p.name for p in events_copy.root().iterdir()) == sorted(["r", events_copy.STAMP])
