"""Run events: append-only JSON lines, the source of truth for status, cost and recovery figures.

Layout (inside a run root, local or in the store):

    events/attempt-<A>.node-<N>.rank-<R>.jsonl   written by one trainer process
    events/attempt-<A>.executor.jsonl            written by the executor (local executor only)

One writer per file, so no locking is needed and a killed writer can damage at most
its own last line; readers skip malformed lines and count them.

Every event carries `ts` (unix seconds, float), `run_id`, `attempt`, `node_rank`,
`rank` (None for executor events) and `type`. Types and their fields are listed in
EVENT_TYPES and documented in docs/events.md.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

# type -> fields it carries beyond the common ones (documentation and a light check).
EVENT_TYPES: dict[str, tuple[str, ...]] = {
    # trainer
    "start": ("where", "world_size", "total_steps", "recipe", "pid"),
    "resume": ("step", "checkpoint", "source", "load_seconds", "bytes"),
    "step": ("step", "loss", "lr", "step_seconds", "samples", "tokens"),
    "checkpoint_begin": ("step", "kind"),
    "checkpoint_end": ("step", "kind", "blocked_seconds", "write_seconds", "bytes", "path"),
    "checkpoint_failed": ("step", "kind", "error"),
    "upload_end": ("step", "bytes", "seconds", "throughput_bps", "durable", "error"),
    "preemption_notice": ("source", "deadline", "action"),
    "signal": ("signum", "name"),
    "emergency_checkpoint": ("step", "signal_to_commit_seconds", "durable_before_deadline"),
    "interval_plan": ("every_seconds", "inputs"),
    "exit": ("code", "reason", "step"),
    # executor (local executor; SkyPilot's controller keeps its own record)
    "attempt_start": ("where",),
    "preempt_notice_sent": ("deadline",),
    "preempt_sigterm": (),
    "preempt_sigkill": (),
    "attempt_end": ("code", "reason"),
}

EVENTS_DIR = "events"


def event_file_name(attempt: int, node_rank: int, rank: int | None) -> str:
    if rank is None:
        return f"attempt-{attempt}.executor.jsonl"
    return f"attempt-{attempt}.node-{node_rank}.rank-{rank}.jsonl"


class EventWriter:
    """Appends events for one process. Each line is flushed at once so a kill loses at most that line."""

    def __init__(self, run_root: str | os.PathLike, run_id: str, attempt: int,
                 node_rank: int, rank: int | None):
        self.run_id = run_id
        self.attempt = attempt
        self.node_rank = node_rank
        self.rank = rank
        directory = Path(run_root) / EVENTS_DIR
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = directory / event_file_name(attempt, node_rank, rank)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._lock = threading.Lock()  # the uploader and watcher threads emit too

    def emit(self, type: str, **fields: Any) -> dict[str, Any]:
        if type not in EVENT_TYPES:
            raise ValueError(f"unknown event type {type!r}")
        event = {"ts": time.time(), "run_id": self.run_id, "attempt": self.attempt,
                 "node_rank": self.node_rank, "rank": self.rank, "type": type, **fields}
        # One write() per line: O_APPEND keeps lines whole even if two handles share a file.
        line = json.dumps(event, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
                self._file.flush()
        return event

    def close(self) -> None:
        with self._lock:
            try:
                self._file.close()
            except OSError:
                pass


@dataclass
class EventLog:
    """Events read back from a run, oldest first, with a count of lines that could not be read."""

    events: list[dict[str, Any]] = field(default_factory=list)
    malformed: int = 0
    malformed_where: list[str] = field(default_factory=list)

    def of_type(self, *types: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") in types]


def parse_lines(lines: Iterable[str], source: str, log: EventLog) -> None:
    """Parse JSON lines into `log`, skipping (and counting) anything that is not a valid event."""
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if (not isinstance(event, dict) or not isinstance(event.get("type"), str)
                or not isinstance(event.get("ts"), (int, float))
                or not isinstance(event.get("attempt", 0), int)):
            log.malformed += 1
            log.malformed_where.append(f"{source}:{number}")
            continue
        log.events.append(event)


def read_events_dir(directory: str | os.PathLike) -> EventLog:
    """Read every events file in a local `events/` directory."""
    log = EventLog()
    directory = Path(directory)
    if not directory.is_dir():
        return log
    for path in sorted(directory.glob("*.jsonl")):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            log.malformed += 1
            log.malformed_where.append(str(path))
            continue
        parse_lines(text.splitlines(), str(path), log)
    log.events.sort(key=lambda e: e["ts"])
    return log


def iter_attempts(log: EventLog) -> Iterator[int]:
    yield from sorted({e.get("attempt", 0) for e in log.events})


class EventTail:
    """Follow an `events/` directory: each `poll()` returns the whole lines appended since the last one."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[dict[str, Any]]:
        log = EventLog()
        if not self.directory.is_dir():
            return []
        for path in sorted(self.directory.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as handle:
                    handle.seek(offset)
                    data = handle.read()
            except OSError:
                continue
            end = data.rfind(b"\n")
            if end < 0:
                continue
            self._offsets[path] = offset + end + 1
            parse_lines(data[:end].decode("utf-8", errors="replace").splitlines(), str(path), log)
        log.events.sort(key=lambda e: e["ts"])
        return log.events
