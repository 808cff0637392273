"""Let the node's supervisor read this rank's Python stacks when its watchdog declares a hang.

The watchdog (watchdog.py) dumps every rank with py-spy, which reads the rank's memory through ptrace.
Two things can stand in its way, and a worker calls `allow_stack_dumps(run_dir)` once at start for both:

- Yama's ptrace_scope 1 (Ubuntu's default, so SkyPilot's images): a process may trace only its own
  descendants, and py-spy is the supervisor's child, not the rank's ancestor. The rank names the
  supervisor (torchrun's parent) as its tracer with PR_SET_PTRACER, which admits the supervisor and
  its descendants (py-spy among them) and no one else.
- ptrace refused outright (ptrace_scope 2 or 3, a container without CAP_SYS_PTRACE, py-spy missing):
  faulthandler writes every thread's stack to DIR/hangs/faulthandler/pid-<PID>.txt on SIGUSR2. That file
  existing tells the watchdog the handler is there (an unhandled SIGUSR2 would kill the rank). It is
  the weaker fallback: a rank that cannot run its signal handler (SIGSTOPped, or blocked with the signal
  masked) writes nothing, where py-spy, reading memory, still can.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
from pathlib import Path
from typing import IO, Optional

HANGS_DIR = "hangs"
FAULTHANDLER_DIR = "faulthandler"
DUMP_SIGNAL = signal.SIGUSR2
PR_SET_PTRACER = 0x59616D61  # linux/prctl.h: "Yama"

_handle: Optional[IO[str]] = None  # kept open: faulthandler writes to its descriptor


def faulthandler_file(run_dir: Path, pid: int) -> Path:
    return Path(run_dir) / HANGS_DIR / FAULTHANDLER_DIR / f"pid-{pid}.txt"


def allow_stack_dumps(run_dir: Path) -> None:
    """Under torchrun: admit the supervisor as tracer, and dump stacks on SIGUSR2. Never fatal."""
    global _handle
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    supervisor = _parent_of(os.getppid())
    if supervisor:
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PTRACER, supervisor, 0, 0, 0)  # EINVAL without Yama
        except OSError:
            pass
    try:
        path = faulthandler_file(run_dir, os.getpid())
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _remove_stale(path.parent)
        _handle = open(path, "a", encoding="utf-8")
        faulthandler.register(DUMP_SIGNAL, file=_handle, all_threads=True)
    except (OSError, RuntimeError, ValueError):
        pass


def _remove_stale(directory: Path) -> None:
    """Files of earlier workers (every start leaves one; a hang's dump was copied into its hang's
    directory already): those whose process is gone."""
    for path in directory.glob("pid-*.txt"):
        try:
            os.kill(int(path.stem.split("-", 1)[1]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, OSError):
            continue


def _parent_of(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
