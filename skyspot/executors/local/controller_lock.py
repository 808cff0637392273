"""Which process is a local run's controller, if any: a lock the controller holds, not a bare PID.

A PID alone names whatever process has that number now. A controller that died without updating
the ledger (OOM killer, reboot, SIGKILL) leaves a PID that the system gives to the next process, and
`cancel` would SIGTERM a stranger and wait for a run that will never answer. So the controller holds
an exclusive flock on `RUN_DIR/controller.lock` for as long as it lives: the kernel drops it when the
process ends, however it ends, and no other process can hold it by having the same number. The file
also names the holder (its PID and start time), so the PID `cancel` signals is checked twice: the lock
is held, and the process with that PID started when the holder did (a check that closes the window
between "the lock is held" and the signal, should the controller die in between).

The start time compared is the kernel's own: on Linux, the boot's id and the process's start in clock
ticks since boot (`/proc/PID/stat`, field 22), which never change while the process lives. psutil's
`create_time` is that tick count plus the boot time in wall-clock seconds, and the boot time moves
whenever the wall clock is stepped or slewed (NTP, a VM resumed): a CI machine moved it by more than a
second during one long test, and `cancel` then refused the live controller as a stranger. Elsewhere
the wall-clock start is compared within a tolerance.

The launcher takes the lock before it starts the controller and hands the descriptor over
(`pass_fds`), so there is no moment when a starting controller does not hold it yet.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Optional

from skyspot.errors import UsageError

LOCK_NAME = "controller.lock"
FD_ENV = "SKYSPOT_CONTROLLER_LOCK_FD"
"""The controller's environment: the lock's descriptor, inherited from the launcher."""
# Start times are compared to this tolerance: psutil's create_time is boot time + ticks since boot, and
# the boot time the kernel reports can move by a second between readers.
_START_TOLERANCE_S = 1.5


def lock_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / LOCK_NAME


def start_id(pid: int) -> Optional[str]:
    """Process `pid`'s start as the kernel counts it ("BOOT_ID:TICKS"), exact and immune to clock steps;
    None off Linux or when there is no such process. Read by hand: psutil exposes only the wall-clock
    figure derived from it."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except (OSError, ValueError):
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # the name (field 2) may hold spaces and parentheses
    return f"{boot}:{fields[19]}" if len(fields) > 19 else None  # field 22, starttime


def started(pid: int) -> Optional[float]:
    """When process `pid` started (Unix time), or None when there is no such process."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError, OverflowError):
        return None


def acquire(run_dir: str | os.PathLike, *, wait_s: float = 2.0) -> int:
    """Take the controller's lock for a controller about to start; the descriptor to hand it.
    A lock another controller holds: UsageError (that run is still going)."""
    path = lock_path(run_dir)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as error:
        raise UsageError(f"cannot open the controller's lock {path}: {error.strerror or error}") from None
    give_up = time.monotonic() + wait_s  # a `cancel` or `status` may hold it shared for an instant
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= give_up:
                os.close(fd)
                raise UsageError(f"a controller still holds {path}: the run is still going") from None
            time.sleep(0.05)


def record(fd: int, pid: int) -> None:
    """Name the lock's holder: `pid` and its start time."""
    data = json.dumps({"pid": pid, "started": started(pid), "start_id": start_id(pid)}).encode()
    os.pwrite(fd, data, 0)  # a reader in between sees no valid name, and `state` says "held, unnamed"
    os.ftruncate(fd, len(data))


def adopt() -> Optional[int]:
    """In the controller: the lock descriptor the launcher handed over, kept out of its own children."""
    value = os.environ.pop(FD_ENV, None)
    if value is None or not value.isdigit():
        return None
    fd = int(value)
    try:
        os.set_inheritable(fd, False)  # a trainer that outlived the controller must not keep the run "alive"
    except OSError:
        return None
    return fd


def state(run_dir: Optional[str | os.PathLike]) -> tuple[bool, Optional[int]]:
    """(held, pid): whether any process holds the run's controller lock, and the holder's PID when the
    file names a process that started when the holder did. Held without a PID: a controller being
    started this instant (its name not written yet), or a holder that is not who the file names."""
    if not run_dir:
        return False, None
    try:
        fd = os.open(lock_path(run_dir), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False, None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False, None  # we got it, so no controller holds it (closing the file drops ours)
        except BlockingIOError:
            pass
        data = os.pread(fd, 4096, 0)
    except OSError:
        return False, None
    finally:
        os.close(fd)
    try:
        named = json.loads(data)
        pid, when = int(named["pid"]), float(named["started"])
    except (ValueError, TypeError, KeyError):
        return True, None
    if pid > 0 and _same_start(pid, when, named.get("start_id")) and _holds(pid, lock_path(run_dir)):
        return True, pid
    return True, None


def _holds(pid: int, path: Path) -> bool:
    """Whether process `pid` has `path` open: the holder a lock file names must be one that holds it, or
    any holder could name any process for `cancel` to signal (issue 31, item 13). Where /proc cannot
    say (another user's process, no /proc), the named process is not trusted."""
    target = os.path.realpath(path)
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.path.realpath(os.readlink(f"/proc/{pid}/fd/{fd}")) == target:
                    return True
            except OSError:
                continue
    except OSError:
        return False
    return False


def _same_start(pid: int, when: float, recorded_id: object) -> bool:
    """Whether process `pid` is the one that started as recorded: the kernel's exact start where both
    sides have it, the wall-clock start within a tolerance otherwise."""
    now_id = start_id(pid)
    if isinstance(recorded_id, str) and now_id is not None:
        return now_id == recorded_id
    now = started(pid)
    return now is not None and abs(now - when) <= _START_TOLERANCE_S


def is_held(run_dir: Optional[str | os.PathLike]) -> bool:
    """Whether a process holds the run's controller lock (the run is still going, or starting)."""
    return state(run_dir)[0]
