"""A cloud run's events as last read from its store, kept on this machine for readers without the network.

A cloud run (SkyPilot) writes its events only to its store, `<store>/<run>/events/` and `<run>/stale/`;
`status`, `cost-report` and `logs` read them there (app/status.run_events). The preemption history every
placement reads (planning/spot_risk.py) must not touch the network, so before this copy it never saw a
cloud run at all: on a machine that only launches to clouds the history was empty, and every placement ran
on the priors alone. Now each time a run's events are read from its store, the files read are kept here,
and the history reads them as `status` did:

    $SKYSPOT_HOME/store-events/<run>            -> .v-<run>-<random>   (a symlink to the current version)
    $SKYSPOT_HOME/store-events/.v-<run>-<random>/events/<file>.jsonl
    $SKYSPOT_HOME/store-events/.v-<run>-<random>/stale/<file>.jsonl
    $SKYSPOT_HOME/store-events/.stamp           # a new token with each copy that changed: render's cache key
                                                # (cli/cache.py reads it as it stats the ledger's files)

A new version is written beside the current one and the link is swapped to it with one rename
(`os.replace`), so a reader sees the store's events as of one read, whole, never a mix of two, and never no
copy while one is replaced; the previous version is then removed. A read whose files equal the current
version's changes nothing (`status` every few seconds leaves render's cache alone). A read that found no
events file leaves the copy as it was (a store emptied by hand, or one briefly unlisted, does not erase the
history). Only the store's own layout is copied: a key that is not `<run>/events/<name>.jsonl` or
`<run>/stale/<name>.jsonl` with a plain name (a bucket writer's `../` or a nested key) is not written here,
and only a ledger run name (ledger.RUN_NAME) has a copy at all. Like cli/cache.py, a copy that cannot be
written is skipped, never an error of the command that read the events; the folders are 0700, since events
name where and when a run ran (they never hold a secret: docs/events.md). The history trusts a run's store
as `status` does: whoever can write a run's events can already change what `status` and `cost-report` say.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from skyspot.events import EventLog

FOLDER = "store-events"
STAMP = ".stamp"
VERSION = ".v-"
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.jsonl")
"""An events file's plain name (no folder, no leading dot): the only names a copy writes."""
LEFTOVER_S = 3600.0
"""A version no link names, this old, was left by a reader that was killed: the next copy removes it."""


def root() -> Path:
    from skyspot.ledger import skyspot_home

    return skyspot_home() / FOLDER


def copy_dir(run_name: str) -> Optional[Path]:
    """Where the run's copy is read (the link), or None for a name that is not a run name."""
    from skyspot.ledger import RUN_NAME

    return root() / run_name if RUN_NAME.fullmatch(run_name) else None


def relative(run_prefix: str, key: str) -> Optional[str]:
    """`events/<name>.jsonl` or `stale/<name>.jsonl` for a key of the run's layout, else None."""
    from skyspot.events import EVENTS_DIR, STALE_DIR
    from skyspot.storage import join_key

    for folder in (EVENTS_DIR, STALE_DIR):
        head = join_key(run_prefix, folder) + "/"
        name = key[len(head) :]
        if key.startswith(head) and _PLAIN.fullmatch(name):
            return f"{folder}/{name}"
    return None


class Copy:
    """One copy being made: `add` each events file as it is read from the store (written at once, so a run
    of thousands of files is never held in memory); when the `with` block ends without an error, at least
    one file was added and the files differ from the current version's, the new version replaces it.
    Otherwise nothing changes.

        with Copy(run.name) as copy:
            log = read_events_store(store, run.name, keep=copy.add)
    """

    def __init__(self, run_name: str) -> None:
        self.run_name = run_name
        self.files = 0
        self._link = copy_dir(run_name)
        self._fresh: Optional[Path] = None

    def __enter__(self) -> "Copy":
        if self._link is None:
            return self
        from skyspot.events import EVENTS_DIR, STALE_DIR

        try:
            root().mkdir(mode=0o700, exist_ok=True)
            # 0700, a name no other reader (process or thread) of the same run can take
            self._fresh = Path(tempfile.mkdtemp(prefix=f"{VERSION}{self.run_name}-", dir=root()))
            for folder in (EVENTS_DIR, STALE_DIR):
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
            os.utime(self._fresh)  # alive: not a killed reader's leftover (sweep)
            self.files += 1
        except OSError:
            self._drop()

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        if self._fresh is not None and self._link is not None and kind is None and self.files:
            self._commit(self._fresh, self._link)
        self._drop()
        _sweep()

    def _commit(self, fresh: Path, link: Path) -> None:
        try:
            current = Path(os.readlink(link)) if link.is_symlink() else None
        except OSError:
            current = None
        if current is not None and _same_files(root() / current, fresh):
            return  # nothing new: the link, the version and the stamp stay as they are
        swap = root() / f".l-{fresh.name}"
        try:
            swap.unlink(missing_ok=True)
            swap.symlink_to(fresh.name)  # relative: the home may be moved or mounted elsewhere
            os.replace(swap, link)  # one rename: a reader finds the old version or the new, never none
            (root() / STAMP).write_text(f"{self.run_name} {os.urandom(8).hex()}\n")
        except OSError:
            swap.unlink(missing_ok=True)
            return
        self._fresh = None  # the current version now: not dropped
        if current is not None and current.name.startswith(VERSION) and current.name != fresh.name:
            shutil.rmtree(root() / current.name, ignore_errors=True)

    def _drop(self) -> None:
        if self._fresh is not None:
            shutil.rmtree(self._fresh, ignore_errors=True)
        self._fresh = None


def _same_files(a: Path, b: Path) -> bool:
    """The same relative names with the same bytes (each file at most the events cap: compared whole)."""
    try:
        names_a = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
        names_b = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
        return names_a == names_b and all((a / n).read_bytes() == (b / n).read_bytes() for n in names_a)
    except OSError:
        return False


def read(run_name: str) -> "EventLog":
    """The run's kept events (both folders, oldest first), as `status` read them from the store; empty when
    no copy was kept. Versions never change once linked, but the one a reader resolved may be removed by a
    newer copy's swap while it reads: the reader then finds the link moved and reads the new version (as a
    seqlock's reader retries)."""
    from skyspot.events import EVENTS_DIR, STALE_DIR, EventLog, read_events_dir

    link = copy_dir(run_name)
    log = EventLog()
    for _ in range(READ_TRIES):
        where = _resolve(link)
        if where is None:
            return EventLog()
        log = read_events_dir(where / EVENTS_DIR)
        log.merge(read_events_dir(where / STALE_DIR))
        if _resolve(link) == where:
            break
    log.events.sort(key=lambda e: e["ts"])
    return log


READ_TRIES = 5


def _resolve(link: Optional[Path]) -> Optional[Path]:
    try:
        return link.resolve(strict=True) if link is not None else None
    except OSError:
        return None


def exists(run_name: str) -> bool:
    link = copy_dir(run_name)
    return link is not None and link.is_dir()


def _sweep() -> None:
    """Remove versions no link names that are LEFTOVER_S old (a reader killed mid-copy), and swap links left
    behind; each entry on its own, so one that another process removed first stops nothing."""
    try:
        entries = list(os.scandir(root()))
    except OSError:
        return
    linked = set()
    for entry in entries:
        if entry.is_symlink() and not entry.name.startswith("."):
            try:
                linked.add(os.path.basename(os.readlink(entry.path)))
            except OSError:
                continue
    old = time.time() - LEFTOVER_S
    for entry in entries:
        try:
            if entry.name.startswith(VERSION) and entry.name not in linked and entry.stat().st_mtime < old:
                shutil.rmtree(entry.path, ignore_errors=True)
            elif entry.name.startswith(".l-") and entry.stat(follow_symlinks=False).st_mtime < old:
                os.unlink(entry.path)
        except OSError:
            continue
