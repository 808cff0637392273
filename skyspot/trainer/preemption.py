"""Preemption: SIGTERM, SIGUSR1 and cloud notices become a flag the ranks agree on at each step boundary.

With ZeRO-3 every rank holds a shard, so a checkpoint needs every rank, yet a signal may reach
one process only (one node's SIGTERM, a notice seen on one node). So nothing is done in the
handler but recording it; at each step boundary the loop folds the local flags into the one tiny
collective it runs anyway (vote.py `cast`: one all-gather of a few numbers per rank, which
also carries the loss), and if any rank saw a signal, all ranks write an emergency checkpoint
together and exit PREEMPTED (75).

Entry points for other threads (the notice watcher, notice.py, when the trainer runs it itself):
    request_emergency(deadline, source)   a notice: same as a signal, with the cloud's deadline
    request_checkpoint(source, action)    a warning (rebalance, planned maintenance): an early normal checkpoint

Under the node's supervisor (supervise.py) the watcher runs there, in its own process, and what it
sees reaches the node leader through a small file in the run directory (`NoticeFile`, named by
SKYSPOT_NOTICE_FILE): the supervisor rewrites it atomically, and the node leader's take() stats it
once per step boundary and turns new entries into the same two calls. The step-boundary vote then
carries them to every rank, as it carries a notice from the in-process watcher.

A notice is not a signal: it comes with a deadline, and the window before it is paid compute.
With `checkpoint.train_through_notice` the ranks keep training while

    now + (next step + predicted save) x 1.25 + margin < upload deadline

where the predicted save (`SavePredictor`) is the slowest this run has measured from the start of
a checkpoint to its commit, or to its durable copy in the store when there is one. Every node
leader adds its figure to the step-boundary vote and the ranks decide on the maximum
(`train_through`), so they agree. With nothing measured yet, the loop checkpoints at the notice
(which measures a save) and trains on for at most half the window left (notice_window.py). A signal
(SIGTERM, SIGUSR1) always saves at the next step boundary.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from skyspot.events import EventType as T

HANDLED = (signal.SIGTERM, signal.SIGUSR1)


@dataclass
class Pending:
    """What this process saw since the last take()."""

    emergency: bool = False
    checkpoint: bool = False
    first_seen: Optional[float] = None
    """Unix time of the earliest signal or notice (for signal_to_commit_seconds)."""
    deadline: Optional[float] = None
    """The earliest cloud deadline (unix time) among notices, if any."""
    signals: list[tuple[int, str, float]] = field(default_factory=list)
    notices: list[dict[str, Any]] = field(default_factory=list)
    signaled: bool = False
    """A signal (not only a notice) was seen: no training through the window. Stays set."""


class PreemptionWatch:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._emergency = False
        self._checkpoint = False
        self._first_seen: Optional[float] = None
        self._deadline: Optional[float] = None
        self._signals: list[tuple[int, str, float]] = []
        self._notices: list[dict[str, Any]] = []
        self._previous: dict[int, Any] = {}
        self._signaled = False
        self._followed: Optional[NoticeFile] = None

    def install(self) -> None:
        """Handle SIGTERM and SIGUSR1 from now on (main thread only)."""
        for signum in HANDLED:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        # Runs in the main thread between bytecodes; no lock (the main thread may hold it). Only
        # appends and assignments, so a take() it interrupts sees the signal now or next step.
        now = time.time()
        self._signals.append((signum, signal.Signals(signum).name, now))
        if self._first_seen is None:
            self._first_seen = now
        self._signaled = True
        self._emergency = True

    def request_emergency(
        self, deadline: Optional[float], source: str, action: str = "preempt", received: Optional[float] = None
    ) -> None:
        """A preemption notice (from any thread): checkpoint with all ranks at the next step boundary, then exit 75.
        `received`: when the watcher saw it, if that was elsewhere (the supervisor); else now."""
        now = time.time() if received is None else received
        with self._lock:
            self._notices.append({"source": source, "deadline": deadline, "action": action, "received": now})
            if self._first_seen is None:
                self._first_seen = now
            if deadline is not None and (self._deadline is None or deadline < self._deadline):
                self._deadline = deadline
            self._emergency = True

    def request_checkpoint(
        self,
        source: str = "rebalance",
        action: str = "rebalance",
        deadline: Optional[float] = None,
        received: Optional[float] = None,
    ) -> None:
        """A warning without an exit yet (from any thread): a rebalance recommendation, planned
        maintenance ahead of its deadline. A normal checkpoint at the next step boundary, no exit."""
        with self._lock:
            self._notices.append(
                {
                    "source": source,
                    "deadline": deadline,
                    "action": action,
                    "received": time.time() if received is None else received,
                    "warning": True,
                }
            )
            self._checkpoint = True

    @property
    def emergency(self) -> bool:
        return self._emergency

    def follow(self, notices: NoticeFile) -> None:
        """Take the supervisor's notices from this file at every take() (the node leader, main thread)."""
        self._followed = notices

    def poll(self) -> bool:
        """Fold in the supervisor's new notices, taking nothing; whether an emergency is pending. For a
        check inside work between two step boundaries (an evaluation, evaluate.py)."""
        if self._followed is not None:
            for entry in self._followed.poll():
                if entry["kind"] == "emergency":
                    self.request_emergency(entry["deadline"], entry["source"], entry["action"], entry["received"])
                else:
                    self.request_checkpoint(entry["source"], entry["action"], entry["deadline"], entry["received"])
        return self._emergency

    def take(self) -> Pending:
        """This process's flags and what it saw since the last take(). The emergency flag stays set."""
        self.poll()
        with self._lock:
            pending = Pending(
                self._emergency,
                self._checkpoint,
                self._first_seen,
                self._deadline,
                list(self._signals),
                list(self._notices),
                self._signaled,
            )
            del self._signals[: len(pending.signals)]
            self._notices.clear()
            self._checkpoint = False
        return pending


# --------------------------------------------------------------------------- from the node's supervisor

NOTICE_FILE_ENV = "SKYSPOT_NOTICE_FILE"
"""Set by the supervisor for the command it runs: the file it delivers notices through. A trainer that
finds it set leaves watching to the supervisor; one started without it runs its own watcher."""
NOTICE_FILE_NAME = "notices.json"


class NoticeFile:
    """The supervisor's notices for the ranks of its node: one small JSON file, rewritten whole.

    {"token": <this start's supervisor token>, "notices": [{"seq": 1, "kind": "emergency" | "checkpoint",
     "source": "aws", "action": "terminate", "deadline": <unix time or null>, "received": <unix time>}, ...]}

    The writer replaces the file atomically (a temporary file, then os.replace), so a reader sees the
    old list or the new one, never half of one. The reader (poll) stats it and reads only when the
    stat changed: one stat per step boundary while nothing happens. Entries are handed out once, by
    seq; a file from another start (another token) is ignored.
    """

    def __init__(self, path: Path, token: str):
        self.path = Path(path)
        self.token = token
        self._entries: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._seen = 0
        self._stat: Optional[tuple[int, int, int]] = None

    # -- the supervisor's side (watcher threads)

    def clear(self) -> None:
        """A new start: nothing delivered yet (an earlier start's file goes)."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def request_emergency(self, deadline: Optional[float], source: str, action: str = "preempt") -> None:
        """As PreemptionWatch.request_emergency, for the node's ranks (from the watcher's thread)."""
        self._publish("emergency", source, action, deadline)

    def request_checkpoint(
        self, source: str = "rebalance", action: str = "rebalance", deadline: Optional[float] = None
    ) -> None:
        """As PreemptionWatch.request_checkpoint, for the node's ranks (from the watcher's thread)."""
        self._publish("checkpoint", source, action, deadline)

    def _publish(self, kind: str, source: str, action: str, deadline: Optional[float]) -> None:
        with self._lock:
            self._entries.append(
                {
                    "seq": len(self._entries) + 1,
                    "kind": kind,
                    "source": source,
                    "action": action,
                    "deadline": deadline,
                    "received": time.time(),
                }
            )
            body = json.dumps({"token": self.token, "notices": self._entries})
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(body)
            os.replace(tmp, self.path)

    # -- the node leader's side (main thread, at each step boundary)

    def poll(self) -> list[dict[str, Any]]:
        """Entries not handed out before; [] without a stat change (the common case)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return []
        stat = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stat == self._stat:
            return []
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return []  # unreadable now (it is replaced whole, so this is rare): next step
        self._stat = stat
        if not isinstance(doc, dict) or doc.get("token") != self.token:
            return []
        fresh = [
            e
            for e in doc.get("notices") or []
            if isinstance(e, dict) and e.get("seq", 0) > self._seen and e.get("kind") in ("emergency", "checkpoint")
        ]
        if fresh:
            self._seen = max(e["seq"] for e in fresh)
        return fresh


# --------------------------------------------------------------------------- the notice window

# The prediction is padded by this factor, and the decision leaves `margin` seconds on top.
PREDICTION_PAD = 1.25


def train_through(*, now: float, need_s: float, margin_s: float, upload_deadline: Optional[float]) -> bool:
    """Keep training one more step after a notice? Pure, and the same on every rank (all inputs come
    from the vote). `need_s` is the slowest rank's next step plus its predicted save to durable; 0 or
    less means nothing was measured, which never holds."""
    if upload_deadline is None or not (need_s > 0) or not math.isfinite(need_s):
        return False
    return now + need_s * PREDICTION_PAD + margin_s < upload_deadline


class SavePredictor:
    """Seconds from the start of an emergency save to a safe checkpoint, from this run's measurements.

    Safe means committed locally without a store, durable in the store with one (this node's part).
    Observations are per checkpoint: the save's blocking part plus its background write
    (`observe_commit`), and from the save's start to this node's marker in the store
    (`observe_durable`). The prediction is the slowest of the last few, scaled to the bytes of the
    newest checkpoint; None until one is measured (the caller then saves at once). Thread-safe: the
    uploader reports from its own thread.
    """

    KEEP = 4

    def __init__(self, store: bool):
        self.store = store
        self._lock = threading.Lock()
        self._commit: deque[float] = deque(maxlen=self.KEEP)
        self._durable: deque[float] = deque(maxlen=self.KEEP)
        self._started: dict[int, float] = {}
        self.source = "none"

    def started(self, step: int, ts: float) -> None:
        """A checkpoint of `step` began at wall time `ts` (the save's first call)."""
        with self._lock:
            self._started[step] = ts
            for old in sorted(self._started)[:-8]:
                del self._started[old]

    def observe_commit(self, blocked_s: float, write_s: float) -> None:
        with self._lock:
            self._commit.append(max(0.0, blocked_s) + max(0.0, write_s))
            if self.source == "none":
                self.source = "measured"

    def observe_durable(self, step: int, uploaded_at: float) -> None:
        """This node's part of `step` (marker included) reached the store at wall time `uploaded_at`."""
        with self._lock:
            began = self._started.get(step)
            if began is not None and uploaded_at >= began:
                self._durable.append(uploaded_at - began)
                self.source = "measured"

    def seed(self, events: Iterable[Mapping[str, Any]]) -> None:
        """Earlier attempts' figures (their event files), until this attempt measures its own."""
        events = sorted((e for e in events if _number(e.get("ts"))), key=lambda e: e["ts"])
        begun = {(e.get("attempt"), e.get("step")): e["ts"] for e in events if e.get("type") == T.CHECKPOINT_BEGIN}
        commit, durable = [], []
        for e in events:
            kind = e.get("type")
            if kind == T.CHECKPOINT_END:
                blocked, write = e.get("blocked_seconds"), e.get("write_seconds")
                if _number(blocked) and _number(write):
                    commit.append(blocked + write)
            elif kind == T.UPLOAD_END and e.get("error") is None and (e.get("bytes") or 0) > 0:
                began = begun.get((e.get("attempt"), e.get("step")))
                if began is not None and e["ts"] >= began:
                    durable.append(e["ts"] - began)  # upload_end is written the moment the marker is up
        with self._lock:
            if not self._commit and commit:
                self._commit.extend(commit[-self.KEEP :])
                self.source = "earlier attempts"
            if not self._durable and durable:
                self._durable.extend(durable[-self.KEEP :])
                self.source = "earlier attempts"

    def predict(self) -> Optional[float]:
        with self._lock:
            figures = list(self._durable if self.store else self._commit)
        return max(figures) if figures else None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
