"""Run events: append-only JSON lines, the source of truth for status, cost and recovery figures.

Layout (inside a run root, local or in the store):

    events/attempt-<A>.node-<N>.rank-<R>.jsonl   written by one trainer process
    events/attempt-<A>.executor.jsonl            written by the executor (local executor only)
    events/attempt-<A>.node-<N>.supervisor.jsonl written by node N's supervisor (its watchdog's `hang`)

One writer per file, so no locking is needed and a killed writer can damage at most
its own last line; readers skip malformed lines and count them.

Every event carries `ts` (unix seconds, float), `run_id`, `attempt`, `node_rank`,
`rank` (None for executor events) and `type`. Types and their fields are listed in
EVENT_TYPES and documented in docs/events.md.
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

from skyspot.str_enum import StrEnum

if TYPE_CHECKING:
    from skyspot.storage import Store


class EventType(StrEnum):
    """An event's `type`: every kind of event a writer may emit (a member equals its string in the JSON)."""

    # trainer
    START = "start"
    RESUME = "resume"
    STEP = "step"
    CHECKPOINT_BEGIN = "checkpoint_begin"
    CHECKPOINT_END = "checkpoint_end"
    CHECKPOINT_FAILED = "checkpoint_failed"
    UPLOAD_END = "upload_end"
    PREEMPTION_NOTICE = "preemption_notice"
    SHUTDOWN_WARNING = "shutdown_warning"
    SIGNAL = "signal"
    EMERGENCY_CHECKPOINT = "emergency_checkpoint"
    NOTICE_WINDOW = "notice_window"
    LOCAL_DISK = "local_disk"
    NODE = "node"
    FABRIC = "fabric"
    INTERVAL_PLAN = "interval_plan"
    BASE_MODEL = "base_model"
    BASE_COPY = "base_copy"
    EXIT = "exit"
    EVAL = "eval"
    RESTART_IN_PLACE = "restart_in_place"
    STALE_ATTEMPT = "stale_attempt"
    # node supervisor (trainer/supervise.py): the watchdog
    HANG = "hang"
    # executor (local executor; SkyPilot's controller keeps its own record)
    ATTEMPT_START = "attempt_start"
    PREEMPT_NOTICE_SENT = "preempt_notice_sent"
    PREEMPT_SIGTERM = "preempt_sigterm"
    PREEMPT_SIGKILL = "preempt_sigkill"
    RANK_CRASH_INJECTED = "rank_crash_injected"
    RANK_HANG_INJECTED = "rank_hang_injected"
    LINK_CUT_INJECTED = "link_cut_injected"
    ATTEMPT_END = "attempt_end"
    HANDOVER = "handover"
    # the deadline's policy (skyspot/planning/deadline.py), in the local executor or its controller on SkyPilot
    DEADLINE_DECISION = "deadline_decision"
    # a supervised run's controller on SkyPilot (executors/sky/deadline.py, relaunch.py): a stage launched, or
    # relaunched away from the region a spot stage was preempted in
    PLACEMENT_DECISION = "placement_decision"


# type -> fields it carries beyond the common ones (documentation and a light check).
EVENT_TYPES: dict[EventType, tuple[str, ...]] = {
    # trainer
    EventType.START: ("where", "world_size", "total_steps", "recipe", "pid"),
    EventType.RESUME: ("step", "checkpoint", "source", "load_seconds", "bytes"),
    EventType.STEP: ("step", "loss", "lr", "step_seconds", "samples", "tokens"),
    EventType.CHECKPOINT_BEGIN: ("step", "kind"),
    EventType.CHECKPOINT_END: ("step", "kind", "blocked_seconds", "write_seconds", "bytes", "path"),
    EventType.CHECKPOINT_FAILED: ("step", "kind", "error"),
    EventType.UPLOAD_END: ("step", "bytes", "seconds", "throughput_bps", "durable", "error"),
    EventType.PREEMPTION_NOTICE: ("source", "deadline", "action"),
    EventType.SHUTDOWN_WARNING: ("source", "deadline", "action"),
    EventType.SIGNAL: ("signum", "name"),
    EventType.EMERGENCY_CHECKPOINT: ("step", "signal_to_commit_seconds", "durable_before_deadline"),
    EventType.NOTICE_WINDOW: ("step", "deadline", "upload_deadline", "predicted_seconds", "margin_seconds"),
    EventType.LOCAL_DISK: ("write_gbps", "mountpoint", "devices"),
    EventType.NODE: (
        "kind",
        "image",
        "instance_type",
        "python",
        "driver",
        "torch",
        "nccl",
        "gpus",
        "fabric",
        "nvme",
        "setup",
    ),
    EventType.FABRIC: ("backend", "transport", "network", "gdr", "source", "num_nodes"),
    EventType.INTERVAL_PLAN: ("every_seconds", "inputs"),
    EventType.BASE_MODEL: ("repo", "source", "weights", "seconds"),
    EventType.BASE_COPY: ("files", "bytes", "seconds", "error"),
    EventType.EXIT: ("code", "reason", "step"),
    EventType.EVAL: ("step", "loss", "perplexity", "tokens", "batches", "seconds"),
    EventType.RESTART_IN_PLACE: ("cause", "failed_at", "seconds_to_next_step", "steps_redone", "restart", "step"),
    # a newer attempt holds the run's store (trainer/fence.py); also read from the store's stale/ records
    EventType.STALE_ATTEMPT: ("epoch", "newer", "node"),
    # node supervisor (trainer/supervise.py): the watchdog
    EventType.HANG: ("step", "seconds_without_step", "bound_seconds", "ranks", "stacks"),
    # executor (local executor; SkyPilot's controller keeps its own record)
    EventType.ATTEMPT_START: ("where",),
    EventType.PREEMPT_NOTICE_SENT: ("deadline",),
    EventType.PREEMPT_SIGTERM: (),
    EventType.PREEMPT_SIGKILL: (),
    EventType.RANK_CRASH_INJECTED: ("step", "at_step", "node", "local_rank", "pid", "signal"),
    EventType.RANK_HANG_INJECTED: ("step", "at_step", "node", "local_rank", "pid", "signal"),
    EventType.LINK_CUT_INJECTED: ("step", "at_step", "node", "address"),
    EventType.ATTEMPT_END: ("code", "reason"),
    # make-before-break (executors/local/handover.py): the next attempt's node made ready while this one
    # trains; decision is provisioning, ready, declined (the way back to spot does not pay) or withdrawn (spot
    # went again first); to is spot or on-demand; reason spot_back (return_to_spot.py) or deadline
    EventType.HANDOVER: ("decision", "to", "reason", "step", "gain_usd", "cost_usd", "ready_at"),
    # the deadline's policy (skyspot/planning/deadline.py), in the local executor or its controller on SkyPilot
    EventType.DEADLINE_DECISION: ("mode", "reason", "progress", "expected", "projected_finish", "deadline", "policy"),
    EventType.PLACEMENT_DECISION: ("mode", "reason", "why", "stage", "left"),
}


class CheckpointKind(StrEnum):
    """Why a checkpoint was taken: the `kind` of checkpoint_begin, checkpoint_end and checkpoint_failed."""

    INTERVAL = "interval"
    """Due by the interval plan (steps or seconds)."""
    REQUESTED = "requested"
    """Asked for ahead of the interval: an early warning (a rebalance, a maintenance notice) or a rank's vote."""
    EMERGENCY = "emergency"
    """The collective save inside a preemption notice's window."""
    FINAL = "final"
    """At the last step."""


EVENTS_DIR = "events"
STALE_DIR = "stale"
"""`<store>/<run>/stale/`: one `stale_attempt` line per node of an attempt that found a newer one holding the
store (trainer/fence.py), written create-only when its own event files may no longer be synced."""
MAX_EVENTS_FILE_BYTES = 128 << 20
"""One process's events file is far below this (a rank's 100,000 steps are about 30 MB); a bigger one is
skipped and counted as malformed, so a 1 GB file makes `status` and `cost-report` say so, not die."""


def event_file_name(attempt: int, node_rank: int, rank: int | None, *, supervisor: bool = False) -> str:
    if supervisor:  # rank None too, but one writer per file: not the executor's
        return f"attempt-{attempt}.node-{node_rank}.supervisor.jsonl"
    if rank is None:
        return f"attempt-{attempt}.executor.jsonl"
    return f"attempt-{attempt}.node-{node_rank}.rank-{rank}.jsonl"


def attempt_numbers(names: Iterable[str]) -> set[int]:
    """The attempts that events file names (event_file_name's) belong to: a count without reading them."""
    found = set()
    for name in names:
        head = name.rsplit("/", 1)[-1].split(".", 1)[0]
        if head.startswith("attempt-") and head[8:].isascii() and head[8:].isdigit():
            found.add(int(head[8:]))
    return found


class EventWriter:
    """Appends events for one process. Each line is flushed at once so a kill loses at most that line."""

    def __init__(
        self,
        run_root: str | os.PathLike[str],
        run_id: str,
        attempt: int,
        node_rank: int,
        rank: int | None,
        *,
        supervisor: bool = False,
    ):
        self.run_id = run_id
        self.attempt = attempt
        self.node_rank = node_rank
        self.rank = rank
        directory = Path(run_root) / EVENTS_DIR
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = directory / event_file_name(attempt, node_rank, rank, supervisor=supervisor)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.dropped = 0
        self._lock = threading.Lock()  # the uploader and watcher threads emit too

    def emit(self, type: str, **fields: Any) -> dict[str, Any]:
        kind = EventType.parse(type)
        if kind is None:
            raise ValueError(f"unknown event type {type!r}")
        event = {
            "ts": time.time(),
            "run_id": self.run_id,
            "attempt": self.attempt,
            "node_rank": self.node_rank,
            "rank": self.rank,
            "type": kind,
            **fields,
        }
        # One write() per line: O_APPEND keeps lines whole even if two handles share a file.
        line = json.dumps(event, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            if self._fd is not None:
                try:
                    os.write(self._fd, line.encode("utf-8"))
                except OSError:
                    self.dropped += 1  # a full disk loses this line, never the run
        return event

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


class Event(Dict[str, Any]):  # typing.Dict: the node may run Python 3.8, where dict[...] is not subscriptable
    """One event as read back: the decoded JSON object itself (so every reader's `e["step"]` and `e.get(...)`
    still work and it writes back unchanged), with its `type` an EventType and the common fields typed.
    Only `parse_event` makes one, after `valid_event` checked the fields below."""

    @property
    def type(self) -> EventType:
        return self["type"]  # type: ignore[no-any-return]

    @property
    def ts(self) -> float:
        return float(self["ts"])

    @property
    def attempt(self) -> int:
        return int(self.get("attempt", 0))

    @property
    def node_rank(self) -> Optional[int]:
        return self.get("node_rank")

    @property
    def rank(self) -> Optional[int]:
        """None for the executor's and the supervisor's events."""
        return self.get("rank")

    @property
    def step(self) -> Optional[int]:
        return self.get("step")


@dataclass
class EventLog:
    """Events read back from a run, oldest first, with a count of lines that could not be read and of
    events whose type this version does not know (a newer writer's), which are left out of `events`."""

    events: list[Event] = field(default_factory=list)
    malformed: int = 0
    malformed_where: list[str] = field(default_factory=list)
    unknown_types: dict[str, int] = field(default_factory=dict)
    """Events of a type EventType lacks, by type: counted, not read."""
    oversized: list[str] = field(default_factory=list)
    """Events files over MAX_EVENTS_FILE_BYTES, by name: skipped unread (and counted in `malformed`)."""

    def of_type(self, *types: str) -> list[Event]:
        return [e for e in self.events if e["type"] in types]

    @property
    def unknown(self) -> int:
        return sum(self.unknown_types.values())

    def merge(self, other: EventLog) -> None:
        """Add another log's events and counts (the caller sorts)."""
        self.events.extend(other.events)
        self.malformed += other.malformed
        self.malformed_where.extend(other.malformed_where)
        self.oversized.extend(other.oversized)
        for name, count in other.unknown_types.items():
            self.unknown_types[name] = self.unknown_types.get(name, 0) + count


# Fields readers compute with, and what they must hold when present. A line that disagrees
# (a torn write, a foreign file, a hand edit) is skipped and counted, so one bad line can
# never crash `status` or `cost-report` or skew a figure. Other fields are not checked.
_INT = "int"  # an int (not a bool) or null
_SECONDS = "seconds"  # a finite number or null
_LABEL = "label"  # a string or null (used as a key)
_FIELD_KINDS: dict[str, str] = {
    "node_rank": _INT,
    "rank": _INT,
    "step": _INT,
    "run_id": _LABEL,
    "kind": _LABEL,
    "step_seconds": _SECONDS,
    "blocked_seconds": _SECONDS,
    "load_seconds": _SECONDS,
}
_INT_FIELDS = tuple(key for key, kind in _FIELD_KINDS.items() if kind == _INT)
_SECONDS_FIELDS = tuple(key for key, kind in _FIELD_KINDS.items() if kind == _SECONDS)
_LABEL_FIELDS = tuple(key for key, kind in _FIELD_KINDS.items() if kind == _LABEL)
_WHERE_KINDS: dict[str, str] = {
    "cloud": _LABEL,
    "region": _LABEL,
    "zone": _LABEL,
    "instance_type": _LABEL,
    "num_nodes": _INT,
}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fits(value: Any, kind: str) -> bool:
    if value is None:
        return True
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == _SECONDS:
        return _is_number(value)
    return isinstance(value, str)


def _valid_where(where: Any) -> bool:
    if where is None:
        return True
    if not isinstance(where, dict):
        return False
    if not all(_fits(where.get(key), kind) for key, kind in _WHERE_KINDS.items()):
        return False
    if isinstance(where.get("num_nodes"), int) and where["num_nodes"] < 1:
        return False
    if not isinstance(where.get("spot"), (bool, str, type(None))):
        return False
    accelerators = where.get("accelerators")
    if isinstance(accelerators, dict):
        return all(isinstance(k, str) and _is_number(v) and v >= 0 for k, v in accelerators.items())
    if isinstance(accelerators, str) and accelerators:
        count = accelerators.partition(":")[2]
        return not count or count.isascii() and count.isdigit()
    return accelerators is None or accelerators == ""


def valid_event(event: Any) -> bool:
    """Whether a decoded line is an event readers can use (see _FIELD_KINDS)."""
    if not isinstance(event, dict) or not isinstance(event.get("type"), str) or not _is_number(event.get("ts")):
        return False
    attempt = event.get("attempt", 0)
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        return False
    # The fields by kind, checked inline: this runs for every line read (280,000 for 20,000 attempts).
    for key in _INT_FIELDS:
        value = event.get(key)
        if value is not None and (value is True or value is False or not isinstance(value, int)):
            return False
    for key in _SECONDS_FIELDS:
        value = event.get(key)
        if value is not None and not _is_number(value):
            return False
    for key in _LABEL_FIELDS:
        value = event.get(key)
        if value is not None and not isinstance(value, str):
            return False
    if event["type"] == EventType.STEP and not isinstance(event.get("step"), int):
        return False
    return _valid_where(event.get("where"))


def parse_event(raw: Any) -> Optional[Event]:
    """The one reading of a decoded line into an event: an Event, or None when it is not one readers
    can use (valid_event). Its `type` is an EventType after this, unless this version does not know it
    (then it stays the string, and `parse_lines` counts it)."""
    if not valid_event(raw):
        return None
    # Keys (and the run's name) interned: json.loads makes new strings for every line, which were more than a
    # third of what 280,000 events held in memory (issue 31, item 9). zip and map, not a comprehension: the
    # copy runs in C, a third of the time for 280,000 events.
    event = Event(zip(map(_intern, raw), raw.values()))
    event["type"] = _TYPES.get(raw["type"]) or raw["type"]
    run_id = event.get("run_id")
    if type(run_id) is str:  # noqa: E721 - exact str: a decoded line's, as isinstance would say for it
        event["run_id"] = _intern(run_id)
    return event


_intern = sys.intern
_TYPES: dict[str, EventType] = dict(EventType._value2member_map_)
# json.loads without its wrappers (the decoder's decode and raw_decode): the same C scanner, called on a line
# already stripped, so neither leading nor trailing JSON whitespace is left for them to skip (issue 31).
_scan_json = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def parse_lines(lines: Iterable[str | bytes], source: str, log: EventLog) -> None:
    """Parse JSON lines into `log`, skipping (and counting) anything that is not a valid event, and
    counting by type the events of a type this version does not know. Byte lines are decoded one at a
    time (bad UTF-8 replaced), so a file's text never exists whole beside its bytes."""
    for number, line in enumerate(lines, 1):
        text = (line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line).strip()
        if not text:
            continue
        try:
            raw, end = _scan_json(text, 0)
            if end != len(text):  # extra data after the value: what json.loads refuses
                raw = None
        except (StopIteration, ValueError, RecursionError):
            raw = None
        event = parse_event(raw)
        if event is None:
            log.malformed += 1
            log.malformed_where.append(f"{source}:{number}")
        elif not isinstance(event["type"], EventType):
            log.unknown_types[event["type"]] = log.unknown_types.get(event["type"], 0) + 1
        else:
            log.events.append(event)


def read_events_store(
    store: Store, run_prefix: str, *, keep: Optional[Callable[[str, bytes], None]] = None
) -> EventLog:
    """Every events file under `<run_prefix>/events/` (and `stale/`) in a store (storage.Store), oldest event
    first. Each object is read with the local files' cap (a ranged read of at most MAX_EVENTS_FILE_BYTES + 1
    bytes): a bigger one is skipped and named in `oversized`, never downloaded whole. `keep(key, bytes)` is
    given each file read (events_copy.Copy.add keeps them for readers without the network)."""
    from skyspot.storage import join_key

    log = EventLog()
    keys = store.list(join_key(run_prefix, EVENTS_DIR) + "/") + store.list(join_key(run_prefix, STALE_DIR) + "/")
    for key in sorted(keys):
        if key.endswith(".jsonl"):
            data = store.get_bytes(key, limit=MAX_EVENTS_FILE_BYTES) or b""
            if len(data) > MAX_EVENTS_FILE_BYTES:
                _skip_oversized(log, key, f"{store.uri}/{key}")
                continue
            if keep is not None:
                keep(key, data)
            parse_lines(data.split(b"\n"), key, log)
            del data
    log.events.sort(key=lambda e: e["ts"])
    return log


def _skip_oversized(log: EventLog, name: str, where: str) -> None:
    log.malformed += 1
    log.malformed_where.append(where)
    log.oversized.append(name)


def oversized_note(oversized: list[str]) -> Optional[str]:
    """The one line a reader prints for the events files it skipped as too big (EventLog.oversized), or None."""
    if not oversized:
        return None
    names = ", ".join(oversized[:3]) + (f" and {len(oversized) - 3} more" if len(oversized) > 3 else "")
    return (
        f"skipped {len(oversized)} events file(s) over {MAX_EVENTS_FILE_BYTES >> 20} MiB unread "
        f"(one process's events are far smaller): {names}"
    )


def read_events_dir(directory: str | os.PathLike[str]) -> EventLog:
    """Read every events file in a local `events/` directory."""
    log = EventLog()
    directory = Path(directory)
    if not directory.is_dir():
        return log
    try:  # scandir and names, not glob and Paths: 40,000 files for 20,000 attempts
        names = sorted(entry.name for entry in os.scandir(directory) if entry.name.endswith(".jsonl"))
    except OSError:
        names = []
    for name in names:
        path = directory / name
        try:
            found = os.stat(path)
            # Not one process's events (a planted or runaway file): skipped, counted, named, not even opened.
            too_big = stat.S_ISREG(found.st_mode) and found.st_size > MAX_EVENTS_FILE_BYTES
        except OSError:
            too_big = False
        # Bytes, not text mode: universal newlines would split a line at a stray "\r".
        data = None if too_big else read_regular(path, limit=MAX_EVENTS_FILE_BYTES)
        if too_big or data is not None and len(data) > MAX_EVENTS_FILE_BYTES:  # (or it grew since the stat)
            _skip_oversized(log, path.name, str(path))
            continue
        if data is None:  # unreadable, or not a file at all (a FIFO, a socket, a device, a directory)
            log.malformed += 1
            log.malformed_where.append(str(path))
            continue
        parse_lines(data.split(b"\n"), str(path), log)
    log.events.sort(key=lambda e: e["ts"])
    return log


def read_regular(path: str | os.PathLike[str], offset: int = 0, limit: Optional[int] = None) -> Optional[bytes]:
    """The bytes of `path` from `offset` (at most `limit` + 1 of them: a caller with a cap sees it passed),
    or None when it cannot be read or is not a regular file.

    Anything can end up in a run's `events/`: a FIFO would block a plain open() until a writer comes,
    forever, and a device reads without end. So what is not a regular file is never opened, and the
    open itself is non-blocking (a FIFO swapped in after the stat returns at once) and checked again on
    the descriptor that is read."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as handle:
            handle.seek(offset)
            if limit is None or opened.st_size - offset <= limit:
                # To its end, sized from the file: read(limit + 1) would allocate the whole cap for every small
                # file first. Grown past the cap since the fstat: the caller sees it passed, as below.
                return handle.read()
            return handle.read(limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector held off while a run's events are read and reckoned: 280,000 events are
    millions of new objects, none in a cycle, and each collection walked them all again, a quarter of
    `cost-report`'s time on 20,000 attempts (issue 31). Reference counting still frees everything; a
    collection that was due runs after, and the collector's prior state is restored."""
    import gc

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def iter_attempts(log: EventLog) -> Iterator[int]:
    yield from sorted({e.get("attempt", 0) for e in log.events})


class FileTail:
    """What was appended to one file since the last read: the one incremental reader, from a byte
    offset, of an append-only file (an events file, a run's log). A missing file reads as nothing yet."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.offset = 0

    def read(self, *, whole_lines: bool = True) -> bytes:
        """The new bytes; `whole_lines`: only up to the last newline (a line still being written waits)."""
        data = read_regular(self.path, self.offset) or b""
        if whole_lines:
            data = data[: data.rfind(b"\n") + 1]
        self.offset += len(data)
        return data


class EventTail:
    """Follow an `events/` directory: each `poll()` returns the whole lines appended since the last one."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = Path(directory)
        self._tails: dict[Path, FileTail] = {}

    def poll(self) -> list[Event]:
        log = EventLog()
        if not self.directory.is_dir():
            return []
        for path in sorted(self.directory.glob("*.jsonl")):
            data = self._tails.setdefault(path, FileTail(path)).read()
            if data:
                parse_lines(data[:-1].decode("utf-8", errors="replace").split("\n"), str(path), log)
        log.events.sort(key=lambda e: e["ts"])
        return log.events
