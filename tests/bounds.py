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
import json
import os
import resource
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
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
def bounded(
    what: object, *, cpu_s: float = CPU_S, memory_mb: int = MEMORY_MB, wall_s: float = WALL_S
) -> Iterator[dict]:
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
    figures.update(
        cpu_s=_cpu() - start_cpu, wall_s=time.monotonic() - start_wall, peak_mb=(peak[0] - start_rss) / 2**20
    )
    if over_memory.is_set() or figures["peak_mb"] > memory_mb:
        raise OverBudget(f"{what}: {figures['peak_mb']:.1f} MB of memory, more than {memory_mb} MB")
    if figures["cpu_s"] > cpu_s:
        raise OverBudget(f"{what}: {figures['cpu_s']:.2f} s of CPU time, more than {cpu_s} s")


# --------------------------------------------------------------------------- a big run, as the local executor leaves it

BIG_T0 = 1_700_000_000.0
BIG_WHERE = {
    "cloud": "aws",
    "region": "us-east-1",
    "zone": "us-east-1a",
    "instance_type": "g5.48xlarge",
    "spot": True,
    "accelerators": None,
    "num_nodes": 1,
    "simulated": True,
}
STEPS_PER_ATTEMPT = 5
"""Each attempt of the big run trains this many new steps, checkpoints the last, and is preempted."""


def big_run_events(attempts: int, run_id: str) -> dict[str, bytes]:
    """The events files of a local run of `attempts` attempts, by file name, as the local controller and the
    trainer write them (skyspot/executors/local/controller.py, skyspot/trainer/loop.py): per attempt the
    executor's attempt_start, notice, SIGTERM and attempt_end, and rank 0's start, resume, steps, the
    emergency checkpoint and exit 75; the last attempt completes. Attempt k trains steps 5k+1..5k+5 after
    resuming at 5k, so the run ends at step 5 x attempts with no step lost (a checkpoint before each notice)."""
    from skyspot.events import event_file_name

    def line(ts: float, type: str, attempt: int, rank: int | None, **fields: object) -> str:
        event = {"ts": ts, "run_id": run_id, "attempt": attempt, "node_rank": 0, "rank": rank, "type": type, **fields}
        return json.dumps(event, separators=(",", ":")) + "\n"

    files: dict[str, bytes] = {}
    for k in range(attempts):
        t = BIG_T0 + 100.0 * k
        last = k == attempts - 1
        first, final = STEPS_PER_ATTEMPT * k, STEPS_PER_ATTEMPT * (k + 1)
        executor = [line(t, "attempt_start", k, None, where=BIG_WHERE)]
        trainer = [
            line(
                t + 5,
                "start",
                k,
                0,
                where=BIG_WHERE,
                world_size=1,
                total_steps=STEPS_PER_ATTEMPT * attempts,
                recipe="tiny",
                pid=1000 + k,
            )
        ]
        if k:
            trainer.append(
                line(t + 6, "resume", k, 0, step=first, checkpoint=f"step_{first}", source="local", load_seconds=1.0)
            )
        for step in range(first + 1, final + 1):
            trainer.append(
                line(
                    t + 10 + 10 * (step - first),
                    "step",
                    k,
                    0,
                    step=step,
                    loss=2.0,
                    step_seconds=10.0,
                    samples=8,
                    tokens=512,
                )
            )
        if last:
            trainer += [
                line(t + 70, "checkpoint_end", k, 0, step=final, kind="final", blocked_seconds=1.0),
                line(t + 71, "exit", k, 0, code=0, reason="complete", step=final),
            ]
            executor.append(line(t + 72, "attempt_end", k, None, code=0, reason="complete"))
        else:
            executor += [
                line(t + 61, "preempt_notice_sent", k, None, deadline=t + 91),
                line(t + 62, "preempt_sigterm", k, None),
            ]
            trainer += [
                line(t + 63, "checkpoint_end", k, 0, step=final, kind="emergency", blocked_seconds=1.0),
                line(
                    t + 64,
                    "emergency_checkpoint",
                    k,
                    0,
                    step=final,
                    signal_to_commit_seconds=2.0,
                    durable_before_deadline=True,
                ),
                line(t + 65, "exit", k, 0, code=75, reason="preempted", step=final),
            ]
            executor.append(line(t + 70, "attempt_end", k, None, code=75, reason="preempted"))
        files[event_file_name(k, 0, None)] = "".join(executor).encode()
        files[event_file_name(k, 0, 0)] = "".join(trainer).encode()
    return files


def write_big_run(home: Path, name: str = "big", attempts: int = 20_000) -> Path:
    """A finished local run of `attempts` attempts under SKYSPOT_HOME=`home`: its ledger row and its events
    directory (two files per attempt). About 40,000 files, 60 MB; a few seconds to write."""
    from skyspot.events import EVENTS_DIR

    run_dir = home / "runs" / name
    events = run_dir / EVENTS_DIR
    events.mkdir(parents=True, exist_ok=True)
    for file_name, data in big_run_events(attempts, name).items():
        (events / file_name).write_bytes(data)
    _add_row(home, name, run_dir, total_steps=STEPS_PER_ATTEMPT * attempts)
    return run_dir


def write_huge_events_file(home: Path, name: str = "huge", size: int = 1 << 30) -> Path:
    """A finished local run of one attempt beside a 1 GiB events file under SKYSPOT_HOME=`home`. The file is
    sparse (zeros, no disk spent): a reader that opens it at all reads zeros as fast as the page cache gives
    them, so it costs the same as real data up to the first byte parsed; one that checks the size first
    reads none of it."""
    run_dir = home / "runs" / name
    events = run_dir / "events"
    events.mkdir(parents=True, exist_ok=True)
    for file_name, data in big_run_events(1, name).items():
        (events / file_name).write_bytes(data)
    with open(events / "attempt-9.node-0.rank-0.jsonl", "wb") as huge:
        huge.truncate(size)
    _add_row(home, name, run_dir, total_steps=STEPS_PER_ATTEMPT)
    return run_dir


def _add_row(home: Path, name: str, run_dir: Path, *, total_steps: int) -> None:
    from skyspot.ledger import Ledger

    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    with Ledger(home / "ledger.db") as ledger:
        ledger.add(
            name, "tiny", "local", run_dir=str(run_dir), total_steps=total_steps, num_nodes=1, info={"cloud": "aws"}
        )
        ledger.set_status(name, "SUCCEEDED")
