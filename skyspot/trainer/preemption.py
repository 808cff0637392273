"""Preemption: SIGTERM, SIGUSR1 and cloud notices become a flag the ranks agree on at each step boundary.

With ZeRO-3 every rank holds a shard, so a checkpoint needs every rank, yet a signal may reach
one process only (one node's SIGTERM, a notice seen on one node). So nothing is done in the
handler but recording it; at each step boundary the loop folds the local flags into the one tiny
collective it runs anyway (loop.py `_vote`: one all-gather of a few numbers per rank, which
also carries the loss), and if any rank saw a signal, all ranks write an emergency checkpoint
together and exit PREEMPTED (75).

Entry points for other threads (the notice watcher, notice.py):
    request_emergency(deadline, source)   a notice: same as a signal, with the cloud's deadline
    request_checkpoint(source, action)    a warning (rebalance, planned maintenance): an early normal checkpoint
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

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
        self._emergency = True

    def request_emergency(self, deadline: Optional[float], source: str, action: str = "preempt") -> None:
        """A preemption notice (from any thread): checkpoint with all ranks at the next step boundary, then exit 75."""
        now = time.time()
        with self._lock:
            self._notices.append({"source": source, "deadline": deadline, "action": action, "received": now})
            if self._first_seen is None:
                self._first_seen = now
            if deadline is not None and (self._deadline is None or deadline < self._deadline):
                self._deadline = deadline
            self._emergency = True

    def request_checkpoint(self, source: str = "rebalance", action: str = "rebalance",
                           deadline: Optional[float] = None) -> None:
        """A warning without an exit yet (from any thread): a rebalance recommendation, planned
        maintenance ahead of its deadline. A normal checkpoint at the next step boundary, no exit."""
        with self._lock:
            self._notices.append({"source": source, "deadline": deadline, "action": action,
                                  "received": time.time(), "warning": True})
            self._checkpoint = True

    @property
    def emergency(self) -> bool:
        return self._emergency

    def take(self) -> Pending:
        """This process's flags and what it saw since the last take(). The emergency flag stays set."""
        with self._lock:
            pending = Pending(self._emergency, self._checkpoint, self._first_seen, self._deadline,
                              list(self._signals), list(self._notices))
            del self._signals[:len(pending.signals)]
            self._notices.clear()
            self._checkpoint = False
        return pending
