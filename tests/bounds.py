"""A time and memory bound on one in-process CLI call: `with bounded(): invoke(...)`.

Why these measures, on a loaded 2-core machine (five sessions share it):
- time is the CPU time the call used (this process and any child it waited for, getrusage), not wall
  time: under load the same `cost-report --plot` took 0.6 s of CPU and 2.8 s of wall, so a 2 s wall
  bound would fail at random while a 2 s CPU bound fails only for work that grows. A SIGPROF timer
  (ITIMER_PROF, CPU time) stops a runaway at the bound instead of letting it run for minutes.
- a call that blocks uses no CPU (a FIFO opened for reading, a lock that never comes), so a wall-clock
  timer (ITIMER_REAL, WALL_S) stops that too, generously, since blocking is the bug it catches.
- memory is the resident set, sampled every 10 ms from /proc/self/statm by a watcher thread, against
  the size when the call began: the process's own high-water mark (ru_maxrss) cannot say what one
  call used once an earlier test has raised it. Over the bound, the watcher interrupts the call
  (`_thread.interrupt_main`) so a runaway is stopped near 500 MB, not at 22 GB.
Running each case in a fresh subprocess with RLIMIT_AS would be exact about memory but costs about
a second of start-up per case, which is most of the budget of the property tests.
"""

from __future__ import annotations

import _thread
import os
import resource
import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator

CPU_S = 2.0
MEMORY_MB = 500
WALL_S = 20.0
_PAGE = os.sysconf("SC_PAGE_SIZE")


class OverBudget(BaseException):
    """A call past its bound. A BaseException, so neither the CLI nor Click's test runner swallows it."""


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _rss() -> int:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * _PAGE
    except OSError:  # not Linux: the high-water mark, in KiB there on Linux and bytes on macOS
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


@contextmanager
def bounded(what: object, *, cpu_s: float = CPU_S, memory_mb: int = MEMORY_MB, wall_s: float = WALL_S) -> Iterator[dict]:
    """Run the body within the bounds; OverBudget (naming `what`) when it goes past one. Yields a dict
    that holds the figures afterwards: cpu_s, wall_s, peak_mb (growth of the resident set)."""
    figures: dict = {}
    start_rss, start_cpu, start_wall = _rss(), _cpu(), time.monotonic()
    peak = [start_rss]
    stop = threading.Event()
    over_memory = threading.Event()

    def watch() -> None:
        while not stop.wait(0.01):
            peak[0] = max(peak[0], _rss())
            if peak[0] - start_rss > memory_mb * 2**20 and not over_memory.is_set():
                over_memory.set()
                _thread.interrupt_main()

    def over(signum, frame):
        kind = "CPU" if signum == signal.SIGPROF else "wall-clock"
        raise OverBudget(f"{what}: more than {cpu_s if signum == signal.SIGPROF else wall_s} s of {kind} time")

    old_prof, old_alarm = signal.signal(signal.SIGPROF, over), signal.signal(signal.SIGALRM, over)
    signal.setitimer(signal.ITIMER_PROF, cpu_s)
    signal.setitimer(signal.ITIMER_REAL, wall_s)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        try:
            yield figures
        except KeyboardInterrupt:
            if over_memory.is_set():
                raise OverBudget(f"{what}: more than {memory_mb} MB of memory") from None
            raise
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGPROF, old_prof)
        signal.signal(signal.SIGALRM, old_alarm)
        stop.set()
        watcher.join()
    peak[0] = max(peak[0], _rss())
    figures.update(cpu_s=_cpu() - start_cpu, wall_s=time.monotonic() - start_wall,
                   peak_mb=(peak[0] - start_rss) / 2**20)
    if over_memory.is_set() or figures["peak_mb"] > memory_mb:
        raise OverBudget(f"{what}: {figures['peak_mb']:.1f} MB of memory, more than {memory_mb} MB")
    if figures["cpu_s"] > cpu_s:
        raise OverBudget(f"{what}: {figures['cpu_s']:.2f} s of CPU time, more than {cpu_s} s")
