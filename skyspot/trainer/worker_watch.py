"""The supervisor's watch of its torchrun's workers: each one's end, however it ends, is noted.

Every end goes to DIR/worker_exits.json (restart.note_worker_exit), from which the restarted generation
learns when the failure was. A worker's end is seen within POLL_S (restart.TOLERANCE_S allows for it).

Cheap by design, because it runs for the whole job beside the ranks: the known workers' liveness is read
every POLL_S from their own /proc/PID/stat (a few files), and the whole process table is scanned for new
workers only while a generation is expected (no worker alive, or within SETTLE_S of a change: a start,
an end, a new worker) and otherwise every SCAN_S, as a safety net. torchrun starts a generation only
after one ended (or at its own start), so no worker can come and go unseen between the slow scans.
The scan is read here rather than by psutil's `Process.children()`, which builds a Process object per
entry of /proc each call: 2.1 ms against 1.0 ms on this 120-process machine, and a GPU node lists
several hundred (kernel threads included); the supervisor's watch took 3.3 % of a core at psutil's
10 scans a second (docs/benchmarks.md, section 15). /proc/PID/task/TID/children would list them
directly but needs CONFIG_PROC_CHILDREN, which not every kernel has (this machine's does not).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Optional

POLL_S = 0.1  # ours: how soon a worker's end is seen (restart.TOLERANCE_S allows for it)
SETTLE_S = 10.0  # ours: scans stay fast this long after a change (torchrun's workers appear together)
SCAN_S = 1.0  # ours: the slow scan's period once the workers are settled


def _stat(pid: int) -> Optional[tuple[str, int]]:
    """(state, parent pid) of a live process, from /proc/PID/stat; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'.
    fields = data[data.rfind(b")") + 2 :].split(b" ", 2)
    try:
        return fields[0].decode(), int(fields[1])
    except (IndexError, ValueError):
        return None


def alive_child(pid: int, parent: int) -> bool:
    """`pid` still runs as `parent`'s child (not a zombie, not a reused pid)."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X") and stat[1] == parent


def children(parent: int) -> list[int]:
    """The live children of `parent`, from one pass over /proc."""
    found = []
    with os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit():
                pid = int(entry.name)
                if alive_child(pid, parent):
                    found.append(pid)
    return found


def _local_rank(pid: int) -> Optional[tuple[int, Optional[str]]]:
    """(LOCAL_RANK, RANK) from a worker's environment; None for a process without one (not yet exec'd)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        rank = env.get(b"RANK")
        return int(env[b"LOCAL_RANK"]), rank.decode() if rank is not None else None
    except (OSError, KeyError, ValueError):
        return None


def watch_workers(launcher: int, run_dir: Path, token: str, settle_s: float = SETTLE_S) -> threading.Event:
    """Note every end of the launcher's workers (its children with a LOCAL_RANK) until the event is set."""
    from skyspot.trainer.restart import note_worker_exit

    stop = threading.Event()

    def loop() -> None:
        known: dict[int, dict] = {}
        changed = last_scan = time.monotonic()
        while True:
            stopping = stop.wait(POLL_S)
            now, clock = time.time(), time.monotonic()
            launcher_stat = _stat(launcher)
            if launcher_stat is None or launcher_stat[0] in ("Z", "X"):
                stopping = True  # torchrun is gone, and its workers with it
            ended = [pid for pid in known if not alive_child(pid, launcher)]
            for pid in ended:
                note_worker_exit(run_dir, token, {"pid": pid, "ts": now, **known.pop(pid)})
                changed = clock
            if stopping:
                return
            if not known or clock - changed < settle_s or clock - last_scan >= SCAN_S:
                last_scan = clock
                for pid in children(launcher):
                    if pid not in known and (ranks := _local_rank(pid)) is not None:
                        known[pid] = {"local_rank": ranks[0], "launcher_rank": ranks[1]}
                        changed = clock

    threading.Thread(target=loop, name="skyspot-workers", daemon=True).start()
    return stop
