"""Fault injection for tests: named points where a test can kill or pause this process.

Inert unless SKYSPOT_FAULT is set (comma-separated specs, `point[@step][/rank][:action]`):

    SKYSPOT_FAULT=before_marker@16:kill       SIGKILL this process when step 16's marker is next
    SKYSPOT_FAULT=step_end@6/1:pause=3        global rank 1 sleeps 3 s at the end of step 6
    SKYSPOT_FAULT=step_end@5/0:hold=60        global rank 0 waits at the end of step 5 until the test
                                              creates `<firing file>.release` (at most 60 s)
    SKYSPOT_FAULT_DIR=/tmp/x                  each firing creates `<point>@<step>.rank<R>` there,
                                              holding the pid, so a test knows when to act

Points: `step_end` (the loop, before the ranks vote), `eval_batch` (evaluate.py, before each eval
micro-batch; the step is the one evaluated), and in the checkpoint writer `write_begin`
(nothing written yet), `mid_file` (part of the first file on disk), `before_manifest`,
`before_marker` (files and manifest on disk, no marker) and `after_marker`.
The default action is `kill` (SIGKILL: no handler, no flush, like a VM taken away). `hold` needs
SKYSPOT_FAULT_DIR.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ENV = "SKYSPOT_FAULT"
DIR_ENV = "SKYSPOT_FAULT_DIR"


@dataclass(frozen=True)
class Fault:
    point: str
    step: Optional[int]
    rank: Optional[int]
    action: str  # "kill", "pause" or "hold"
    seconds: float = 0.0


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, _, action = item.partition(":")
        where, _, rank = where.partition("/")
        point, _, step = where.partition("@")
        name, _, arg = (action or "kill").partition("=")
        if name not in ("kill", "pause", "hold", "enospc"):
            raise ValueError(f"{ENV}: unknown action {name!r} in {item!r}")
        faults.append(
            Fault(point, int(step) if step else None, int(rank) if rank else None, name, float(arg) if arg else 0.0)
        )
    return faults


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def fault_point(point: str, step: Optional[int] = None) -> None:
    """Kill or pause here if SKYSPOT_FAULT names this point (and step and rank)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    for fault in parse(spec):
        if fault.point != point or (fault.step is not None and fault.step != step):
            continue
        if fault.rank is not None and fault.rank != _rank():
            continue
        directory = os.environ.get(DIR_ENV)
        fired = None
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            fired = Path(directory) / f"{point}@{step}.rank{_rank()}"
            fired.write_text(str(os.getpid()))
        if fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        elif fault.action == "hold" and fired is not None:
            release = fired.with_name(fired.name + ".release")
            deadline = time.monotonic() + fault.seconds
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        else:
            time.sleep(fault.seconds)
