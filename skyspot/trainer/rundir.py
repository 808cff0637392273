"""The run directory (DIR, the node's fast tier): layout and the run-level files.

    DIR/
      run.json            recipe, fingerprint, who started the run and when (first start)
      attempts.json       {"attempt": N, "updated": ts}: one more per start (rank 0 of node 0)
      exit.json           the last start's exit code, for the supervisor (exit_codes.py)
      checkpoints/        step_<N>/ (manifest.py), `latest` (advisory), DeepSpeed's zero_to_fp32.py
      events/             JSON lines per process (skyspot.events)
      final/              the trained model (export.py)
      superseded/         what --fresh moved aside, by time
      .lock               held by the node leader while a trainer runs: one trainer per directory
"""

from __future__ import annotations

import fcntl
import getpass
import os
import re
import socket
import time
from pathlib import Path
from typing import Any, Optional

from skyspot.trainer.files import atomic_write_json, fsync_dir, read_json

CHECKPOINTS = "checkpoints"
RUN_JSON = "run.json"
ATTEMPTS = "attempts.json"
SUPERSEDED = "superseded"
LOCK = ".lock"
# Trainer event files only (skyspot.events): an executor's `attempt-N.executor.jsonl` numbers the
# executor's attempts, and counting it would make a first start attempt 2.
_TRAINER_EVENTS = re.compile(r"^attempt-(\d+)\.node-\d+\.rank-\d+\.jsonl$")


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def next_attempt(run_dir: Path) -> int:
    """Count one more start in DIR/attempts.json and return it (1 for the first start).

    Same format as the store's counter (uploader.next_attempt), which replaces this one when
    the run has a store (record_attempt mirrors it here). An unreadable counter restarts at one
    more than the highest attempt in the trainer's event files, so they are never reused.
    """
    record = read_json(Path(run_dir) / ATTEMPTS)
    previous = record.get("attempt") if isinstance(record, dict) else None
    if not isinstance(previous, int):
        previous = 0
        events = Path(run_dir) / "events"
        for path in events.iterdir() if events.is_dir() else []:
            match = _TRAINER_EVENTS.match(path.name)
            if match:
                previous = max(previous, int(match.group(1)))
    attempt = previous + 1
    record_attempt(run_dir, attempt)
    return attempt


def record_attempt(run_dir: Path, attempt: int) -> None:
    """Write DIR/attempts.json (the store's count mirrored locally, or the local count)."""
    atomic_write_json(Path(run_dir) / ATTEMPTS, {"attempt": attempt, "updated": time.time()})


def write_run_json(run_dir: Path, *, run_id: str, recipe, store: Optional[str], world_size: int,
                   where: dict[str, Any], fresh: bool = False) -> tuple[dict[str, Any], Optional[str]]:
    """Write DIR/run.json on the first start (or after --fresh). Returns (run.json, warning or None)."""
    path = Path(run_dir) / RUN_JSON
    existing = read_json(path)
    if isinstance(existing, dict) and not fresh:
        warning = None
        if existing.get("fingerprint") != recipe.fingerprint():
            warning = (f"the recipe changed since this run started (fingerprint {existing.get('fingerprint')} -> "
                       f"{recipe.fingerprint()}); run.json keeps the original")
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
    names = [n for n in (CHECKPOINTS, "final", RUN_JSON) if (run_dir / n).exists()]
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
