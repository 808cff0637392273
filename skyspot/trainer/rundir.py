"""The run root's layout and its run-level files, in the run directory (DIR, the node's fast tier)
and, with the same names, under `<store>/<run_id>/` in the store.

    DIR/
      run.json            recipe, fingerprint, who started the run and when (first start)
      attempts.json       {"attempt": N, "updated": ts}: one more per start (rank 0 of node 0)
      exit.json           the last start's exit code, for the supervisor (exit_codes.py)
      notices.json        what the supervisor's notice watcher saw this start, for the ranks (preemption.NoticeFile)
      checkpoints/        step_<N>/ (manifest.py), `latest` (advisory), DeepSpeed's zero_to_fp32.py
      events/             JSON lines per process (skyspot.events)
      final/              the trained model (export.py)
      superseded/         what --fresh moved aside, by time
      .lock               held by the node leader while a trainer runs: one trainer per directory

The attempt counter is one concept with two backends: `next_attempt(DIR)` counts starts in the run
directory; `next_attempt_in_store(store, run_id)` counts them in the store's attempts.json (same
format), across machines, and replaces the local count when the run has a store (its value is
mirrored into DIR with `record_attempt`).
"""

from __future__ import annotations

import fcntl
import getpass
import json
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Any, Optional

from skyspot.events import EVENTS_DIR
from skyspot.storage import Store, join_key, with_retries
from skyspot.trainer.files import atomic_write_json, fsync_dir, read_json

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
RUN_JSON = "run.json"
ATTEMPTS = "attempts.json"
FINAL = "final"
SUPERSEDED = "superseded"
LOCK = ".lock"
# Trainer event files only (skyspot.events): an executor's `attempt-N.executor.jsonl` numbers the
# executor's attempts, and counting it would make a first start attempt 2.
_TRAINER_EVENTS = re.compile(r"^attempt-(\d+)\.node-\d+\.rank-\d+\.jsonl$")


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def next_attempt(run_dir: Path) -> int:
    """Count one more start in DIR/attempts.json and return it (1 for the first start).

    The local backend of the counter (`next_attempt_in_store` replaces it when the run has a
    store). An unreadable counter restarts at one more than the highest attempt in the trainer's
    event files, so they are never reused.
    """
    record = read_json(Path(run_dir) / ATTEMPTS)
    previous = record.get("attempt") if isinstance(record, dict) else None
    if not isinstance(previous, int):
        previous = 0
        events = Path(run_dir) / EVENTS_DIR
        for path in events.iterdir() if events.is_dir() else []:
            match = _TRAINER_EVENTS.match(path.name)
            if match:
                previous = max(previous, int(match.group(1)))
    attempt = previous + 1
    record_attempt(run_dir, attempt)
    return attempt


def record_attempt(run_dir: Path, attempt: int) -> None:
    """Write DIR/attempts.json (the store's count mirrored locally, or the local count)."""
    atomic_write_json(Path(run_dir) / ATTEMPTS, _attempt_record(attempt))


def _attempt_record(attempt: int) -> dict[str, Any]:
    return {"attempt": attempt, "updated": time.time()}


def next_attempt_in_store(
    store: Store, run_prefix: str, *, attempts: int = 4, base_delay: float = 0.5, max_delay: float = 5.0
) -> int:
    """Count one more start of the run in `<run_prefix>/attempts.json` in the store and return it (1 for the first).

    The store's backend of the counter: it counts starts across machines. Best effort, not
    atomic: two racers could read the same count. That is fine because only rank 0 of node 0
    calls it, once per start. An unreadable counter restarts at 1 rather than stopping training.
    Transient errors are retried `attempts` times; then the `StoreError` propagates.
    """
    key = join_key(run_prefix, ATTEMPTS)
    retry = dict(attempts=attempts, base_delay=base_delay, max_delay=max_delay)
    raw = with_retries(lambda: store.get_bytes(key), **retry)
    previous = 0
    if raw is not None:
        try:
            previous = int(json.loads(raw)["attempt"])
        except (ValueError, KeyError, TypeError):
            log.warning("%s/%s is unreadable; counting attempts from 1 again", store.uri, key)
    attempt = previous + 1
    body = json.dumps(_attempt_record(attempt)).encode()
    with_retries(lambda: store.put_bytes(key, body), **retry)
    return attempt


def write_run_json(
    run_dir: Path,
    *,
    run_id: str,
    recipe,
    store: Optional[str],
    world_size: int,
    where: dict[str, Any],
    fresh: bool = False,
) -> tuple[dict[str, Any], Optional[str]]:
    """Write DIR/run.json on the first start (or after --fresh). Returns (run.json, warning or None)."""
    path = Path(run_dir) / RUN_JSON
    existing = read_json(path)
    if isinstance(existing, dict) and not fresh:
        warning = None
        if existing.get("fingerprint") != recipe.fingerprint():
            warning = (
                f"the recipe changed since this run started (fingerprint {existing.get('fingerprint')} -> "
                f"{recipe.fingerprint()}); run.json keeps the original"
            )
        return existing, warning
    record = {
        "run_id": run_id,
        "recipe_name": recipe.name,
        "recipe": recipe.model_dump(mode="json"),
        "fingerprint": recipe.fingerprint(),
        "store": store,
        "world_size": world_size,
        "where": where,
        "created_at": time.time(),
        "created_by": {"user": _user(), "host": socket.gethostname(), "pid": os.getpid()},
    }
    atomic_write_json(path, record)
    return record, None


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return "unknown"


class RunLock:
    """An exclusive flock on DIR/.lock, released when the process ends (even by SIGKILL)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self._fd: Optional[int] = None

    def acquire(self) -> Optional[str]:
        """None when acquired, else who holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            return holder
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        self._fd = fd
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def move_aside(run_dir: Path) -> Optional[Path]:
    """--fresh: move checkpoints/, final/ and run.json to DIR/superseded/<time>/ (never delete)."""
    run_dir = Path(run_dir)
    names = [n for n in (CHECKPOINTS, FINAL, RUN_JSON) if (run_dir / n).exists()]
    if not names:
        return None
    target = run_dir / SUPERSEDED / time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    suffix = 0
    while target.exists():
        suffix += 1
        target = target.with_name(f"{target.name.split('.')[0]}.{suffix}")
    target.mkdir(parents=True)
    for name in names:
        os.replace(run_dir / name, target / name)
    fsync_dir(run_dir)
    return target
