"""A cloud run's events as last read from its store, kept on this machine for readers without the network.

A cloud run (SkyPilot) writes its events only to its store, `<store>/<run>/events/` and `<run>/stale/`;
`status` and `cost-report` read them there (app/status.run_events). The preemption history every placement
reads (planning/spot_risk.py) must not touch the network, so before this copy it never saw a cloud run at
all: on a machine that only launches to clouds the history was empty, and every placement ran on the priors
alone. Now each time `status` or `cost-report` reads a cloud run's events from its store, the files it read
are kept here, and the history reads them as `status` did:

    $SKYSPOT_HOME/store-events/<run>/events/<file>.jsonl
    $SKYSPOT_HOME/store-events/<run>/stale/<file>.jsonl
    $SKYSPOT_HOME/store-events/.stamp        # rewritten with each copy: in render's cache key (cli/cache.py,
                                             # which spells the path as it spells the ledger's files)

A copy replaces the run's previous one whole (a new directory renamed into place), so it is the store's
events as of one read, never a mix of two. A read that found no events file leaves the previous copy as
it was (a store emptied by hand, or one briefly unlisted, does not erase the history). Only the store's
own layout is copied: a key that is not `<run>/events/<name>.jsonl` or `<run>/stale/<name>.jsonl` with a
plain name (a bucket writer's `../` or a nested key) is not written here. Like cli/cache.py, a copy that
cannot be written is skipped, never an error of the command that read the events; the folders are 0700,
since events name where and when a run ran (they never hold a secret: docs/events.md).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from skyspot.events import EventLog

FOLDER = "store-events"
STAMP = ".stamp"
_DIRS = ("events", "stale")
"""skyspot.events' EVENTS_DIR and STALE_DIR, spelled here so that importing this module imports no other
(tests/test_events_copy.py holds them equal)."""
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.jsonl")


def root() -> Path:
    from skyspot.ledger import skyspot_home

    return skyspot_home() / FOLDER


def copy_dir(run_name: str) -> Path:
    return root() / run_name


def relative(run_prefix: str, key: str) -> Optional[str]:
    """`events/<name>.jsonl` or `stale/<name>.jsonl` for a key of the run's layout, else None."""
    for folder in _DIRS:
        head = f"{run_prefix}/{folder}/"
        if key.startswith(head) and _PLAIN.fullmatch(key[len(head) :]):
            return f"{folder}/{key[len(head) :]}"
    return None


class Copy:
    """One copy being made: `add` each events file as it is read from the store (written at once, so a run
    of thousands of files is never held in memory), then the copy replaces the run's previous one when the
    `with` block ends without an error and at least one file was added; otherwise nothing changes.

        with Copy(run.name) as copy:
            log = read_events_store(store, run.name, keep=copy.add)
    """

    def __init__(self, run_name: str) -> None:
        self.run_name = run_name
        self.files = 0
        self._fresh: Optional[Path] = None
        self._named = bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", run_name))  # a ledger name, else not kept

    def __enter__(self) -> "Copy":
        if self._named:
            try:
                root().mkdir(mode=0o700, exist_ok=True)
                # 0700, a name no other reader (process or thread) of the same run can take
                self._fresh = Path(tempfile.mkdtemp(prefix=f".new-{self.run_name}-", dir=root()))
                for folder in _DIRS:
                    (self._fresh / folder).mkdir(mode=0o700)
            except OSError:
                self._drop()
        return self

    def add(self, key: str, data: bytes) -> None:
        name = relative(self.run_name, key)
        if self._fresh is None or name is None:
            return
        try:
            (self._fresh / name).write_bytes(data)
            self.files += 1
        except OSError:
            self._drop()

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        if self._fresh is None:
            return
        if kind is None and self.files:
            self._commit(self._fresh)
        self._drop()

    def _commit(self, fresh: Path) -> None:
        final, old = copy_dir(self.run_name), fresh.with_name(fresh.name.replace(".new-", ".old-", 1))
        try:
            try:
                final.rename(old)
            except FileNotFoundError:
                pass
            try:
                fresh.rename(final)  # another reader's copy renamed in between: ours is dropped, theirs stands
            except OSError:
                if not final.exists():
                    old.rename(final)  # nothing took its place: the previous copy stays
                raise
            (root() / STAMP).write_text(f"{self.run_name}\n")
        except OSError:
            pass
        finally:
            shutil.rmtree(old, ignore_errors=True)
        _sweep()

    def _drop(self) -> None:
        if self._fresh is not None:
            shutil.rmtree(self._fresh, ignore_errors=True)
        self._fresh = None


def read(run_name: str) -> "EventLog":
    """The run's kept events (both folders, oldest first), as `status` read them from the store; empty when
    no copy was kept."""
    from skyspot.events import read_events_dir

    where = copy_dir(run_name)
    log = read_events_dir(where / _DIRS[0])
    log.merge(read_events_dir(where / _DIRS[1]))
    log.events.sort(key=lambda e: e["ts"])
    return log


LEFTOVER_S = 3600.0


def _sweep() -> None:
    """Remove copies half-made by a reader that was killed (`.new-*`, `.old-*`) and are an hour old."""
    import time

    try:
        for entry in os.scandir(root()):
            if entry.name.startswith((".new-", ".old-")) and entry.stat().st_mtime < time.time() - LEFTOVER_S:
                shutil.rmtree(entry.path, ignore_errors=True)
    except OSError:
        pass
