"""The node's hang watchdog: a thread in the supervisor (supervise.py) that turns a hang into a restart.

A hang (a rank stuck in a collective because a peer, a GPU or a link stalled; a deadlock; a SIGSTOP)
ends nothing by itself: every rank waits, at best until the collective timeout (600 s on a cloud, and
gloo's and NCCL's do not always fire), while the cluster bills. The watchdog follows the ranks'
own event files in DIR/events/ (events.EventTail: what the trainer writes anyway, no heartbeat of its
own) and declares a hang when

- no first step arrived within `first_step_seconds` of a (re)start: torchrun's rendezvous, the model's
  download and load, the resume and the first step's compile all fit in it; or
- after a step, no event from any rank for longer than
  max(hang_factor x the median step time, hang_floor_seconds, 2 x the longest pause measured)
  (`hang_bound`), where the median is over the newest step times the node has recorded (this start's
  and, in DIR/events/, earlier ones), and a pause is an eval's or a checkpoint's blocking time at a
  step boundary (their `eval` and `checkpoint_end` events): an eval or a save never reads as a hang
  once one of its kind was measured, and any event (an upload, a checkpoint's begin) counts as life.

It does not watch where nothing should step: after a `signal`, `preemption_notice`,
`emergency_checkpoint` or `exit` event (the trainer is on its way out, under the notice's own
deadline and torchrun's grace), and after the last step or a resume at it (the final save, export and
upload, which take what they take). It re-arms, with the first-step bound, whenever the worker processes change
(torchrun's agent restarted them) or a `start` event follows. Step events come from global rank 0
only, so only the node that runs it declares hangs; a rank stuck on any node stops global rank 0 at the
next step's vote, so that node sees every hang (other nodes' stacks are not dumped: their supervisors
do not know; docs/reliability.md).

On a hang: py-spy dumps every local rank's Python stacks (in parallel, each within `dump_timeout_s`;
a SIGSTOPped rank is read without pausing it, `--nonblocking`; where ptrace is refused, the rank's
faulthandler writes them on SIGUSR2, stacks.py) into DIR/hangs/<UTC time>/rank-<R>.txt; then
DIR/hang.json (ts, step, bound_seconds, seconds_without_step, stacks, ranks), the `hang` event in
DIR/events/attempt-<A>.node-<N>.supervisor.jsonl, one line on stderr, and SIGKILL to every worker (it
works on a stopped process too), so torchrun's agent restarts them in place, or, without restarts
left, exits with the error. Only then the dumps and the event file go to the run's store (run.json's
`store`), so a slow or failing store never delays the kill.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from skyspot.events import EVENTS_DIR, EventTail, EventWriter
from skyspot.trainer.cluster import pinned_rank
from skyspot.trainer.files import atomic_write_json, read_json
from skyspot.trainer.rundir import ATTEMPTS, RUN_JSON
from skyspot.trainer.stacks import DUMP_SIGNAL, HANGS_DIR, faulthandler_file
from skyspot.events import EventType as T

HANG_JSON = "hang.json"
POLL_SECONDS = 1.0
DUMP_TIMEOUT_SECONDS = 10.0
STEP_HISTORY = 200  # the median is over the newest this many step times
# The trainer is on its way out after these, under deadlines of its own (the notice's, torchrun's grace).
SHUTDOWN_EVENTS = frozenset({T.SIGNAL, T.PREEMPTION_NOTICE, T.EMERGENCY_CHECKPOINT, T.EXIT})


@dataclass(frozen=True)
class Bounds:
    """The recipe's `resilience` values (recipe.ResilienceSection), as the supervisor's flags carry them."""

    factor: float
    floor_seconds: float
    first_step_seconds: float


def hang_bound(step_seconds: Iterable[float], bounds: Bounds, longest_pause: float = 0.0) -> float:
    """Seconds without any event, after a step, that make a hang: max(factor x median step time, floor,
    2 x the longest eval or checkpoint pause measured). Without a step time: the floor and pauses."""
    times = [s for s in step_seconds if s >= 0]
    median = statistics.median(times) if times else 0.0
    return max(bounds.factor * median, bounds.floor_seconds, 2.0 * longest_pause)


class Progress:
    """What the node's ranks did, from their events: whether and since when the watchdog is overdue.

    Pure state (no clock, no files): `feed` events, `arm` at a (re)start, ask `overdue(now)`."""

    def __init__(self, bounds: Bounds, armed_at: float):
        self.bounds = bounds
        self.step_seconds: deque[float] = deque(maxlen=STEP_HISTORY)
        self.longest_pause = 0.0
        self.total_steps: Optional[int] = None
        self.step: Optional[int] = None  # the last step seen, kept across re-arms (hang.json's step)
        self.identity: dict[str, Any] = {}  # run_id, attempt, node_rank of the newest event
        self.arm(armed_at)

    def arm(self, now: float) -> None:
        """A (re)start: the first-step bound again, from `now`."""
        self.armed_at = now
        self.last_event = now
        self.last_step_at: Optional[float] = None
        self.stopped: Optional[str] = None

    def feed(self, event: dict[str, Any]) -> None:
        if event.get("rank") is None:  # the executor's, or this supervisor's own
            return
        type, ts = event.get("type"), float(event["ts"])
        seconds = event.get("step_seconds") if type == T.STEP else None
        if isinstance(seconds, (int, float)):
            self.step_seconds.append(float(seconds))  # history counts too: the median of the run
        pause = (
            event.get("seconds")
            if type == T.EVAL
            else event.get("blocked_seconds")
            if type == T.CHECKPOINT_END
            else None
        )
        if isinstance(pause, (int, float)):
            self.longest_pause = max(self.longest_pause, float(pause))
        if type == T.START and isinstance(event.get("total_steps"), int):
            self.total_steps = event["total_steps"]
        if ts < self.armed_at:
            return  # before this (re)start: the workers that wrote it are gone
        if type == T.START and (self.last_step_at is not None or self.stopped):
            self.arm(ts)  # new workers we did not see change (psutil could not tell)
        self.identity = {k: event.get(k) for k in ("run_id", "attempt", "node_rank")}
        self.last_event = max(self.last_event, ts)
        if type == T.STEP:
            self.last_step_at, self.step = ts, event.get("step")
        if type in (T.STEP, T.RESUME) and self._at_the_end(event.get("step")):
            self.stopped = "the last step"  # the final save, export and upload (a resume at the end: only those)
        elif type in SHUTDOWN_EVENTS:
            self.stopped = type

    def _at_the_end(self, step: Any) -> bool:
        return self.total_steps is not None and isinstance(step, int) and step >= self.total_steps

    def bound(self) -> float:
        if self.last_step_at is None:
            return self.bounds.first_step_seconds
        return hang_bound(self.step_seconds, self.bounds, self.longest_pause)

    def overdue(self, now: float) -> Optional[float]:
        """Seconds past the reference (the (re)start before a first step, else the newest event) when
        more than the bound; None while in bounds or not watching."""
        if self.stopped:
            return None
        since = self.armed_at if self.last_step_at is None else self.last_event
        elapsed = now - since
        return elapsed if elapsed > self.bound() else None

    def without_step(self, now: float) -> float:
        return now - (self.last_step_at if self.last_step_at is not None else self.armed_at)


@dataclass(frozen=True)
class Worker:
    pid: int
    rank: int
    local_rank: int
    process: Any  # psutil.Process: its kill() checks the pid still names the same process


def find_workers(launcher_pid: int, cache: Optional[dict] = None) -> list[Worker]:
    """The launcher's worker processes, numbered by the rank they train as: its descendants whose
    environment has RANK and LOCAL_RANK and whose parent's does not (a worker's own children, data
    loaders, compilers, inherit both)."""
    import psutil

    cache = {} if cache is None else cache
    try:
        descendants = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.Error:
        return []
    ranks: dict[int, tuple[int, int]] = {}
    alive = set()
    for process in descendants:
        try:
            key = (process.pid, process.create_time())
            alive.add(key)
            if key not in cache:
                env = process.environ()
                # The rank the trainer trains as (cluster.pinned_rank), not torchrun's: the c10d rendezvous
                # may number another node's worker 0, and global rank 0 is the one that writes the steps.
                cache[key] = (
                    (pinned_rank(env), int(env["LOCAL_RANK"])) if "RANK" in env and "LOCAL_RANK" in env else None
                )
        except (psutil.Error, ValueError, OSError):
            continue
        if cache[key] is not None:
            ranks[process.pid] = cache[key]
    for gone in set(cache) - alive:
        del cache[gone]
    workers = []
    for process in descendants:
        if process.pid not in ranks:
            continue
        try:
            if process.ppid() in ranks:
                continue
        except psutil.Error:
            continue
        rank, local_rank = ranks[process.pid]
        workers.append(Worker(process.pid, rank, local_rank, process))
    return sorted(workers, key=lambda w: w.rank)


# py-spy: 'Thread 4242 (idle): "MainThread"' then frames '    function (file:line)', innermost first.
# faulthandler: 'Current thread 0x... (most recent call first):' then '  File "file", line N in function'.
_PYSPY_THREAD = re.compile(r'^Thread (\S+) \((\w+)\)(?:: "(.*)")?')
_PYSPY_FRAME = re.compile(r"^\s+(.+?) \((.+):(\d+)\)\s*$")
_FAULT_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
_FAULT_FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in (.+)$')


def top_frame(text: str, pid: Optional[int] = None) -> Optional[str]:
    """ "file:line function" of the main thread's innermost frame in a py-spy or faulthandler dump."""
    blocks: list[tuple[bool, list[str]]] = []  # (is the main thread, frames)
    for line in text.splitlines():
        header = _PYSPY_THREAD.match(line)
        if header:
            ident, name = header.group(1), header.group(3)
            main = name == "MainThread" or (pid is not None and ident in (str(pid), hex(pid)))
            blocks.append((main, []))
            continue
        header = _FAULT_THREAD.match(line)
        if header:
            blocks.append((header.group(1) == "Current thread", []))  # the signal runs in the main thread
            continue
        if not blocks:
            continue
        frame = _PYSPY_FRAME.match(line)
        if frame:
            blocks[-1][1].append(f"{frame.group(2)}:{frame.group(3)} {frame.group(1)}")
            continue
        frame = _FAULT_FRAME.match(line)
        if frame:
            blocks[-1][1].append(f"{frame.group(1)}:{frame.group(2)} {frame.group(3)}")
    for main, frames in sorted(blocks, key=lambda b: not b[0]):
        if frames:
            return frames[0]
    return None


def py_spy() -> Optional[str]:
    """The py-spy beside this interpreter (the node's venv), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def dump_one(worker: Worker, run_dir: Path, deadline: float) -> str:
    """One rank's stacks as text (what went wrong, when nothing could be read), by `deadline`."""
    tried = []
    binary = py_spy()
    if binary is not None:
        stopped = _is_stopped(worker)
        # A stopped process cannot be paused again (py-spy's "Failed to suspend process"): read it as it
        # is; a running one is paused for a consistent read, and read as it runs if that fails.
        for extra in [["--nonblocking"], []] if stopped else [[], ["--nonblocking"]]:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                done = subprocess.run(
                    [binary, "dump", "--pid", str(worker.pid), *extra],
                    capture_output=True,
                    text=True,
                    timeout=left,
                    stdin=subprocess.DEVNULL,
                )
            except subprocess.TimeoutExpired:
                tried.append("py-spy timed out")
                break
            except OSError as err:
                tried.append(f"py-spy: {err}")
                break
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout
            tried.append(f"py-spy {' '.join(extra)}: {(done.stderr or done.stdout).strip().splitlines()[:3]}")
    else:
        tried.append("py-spy is not installed")
    fallback = _faulthandler_dump(worker, run_dir, deadline)
    if fallback:
        return fallback + "\n(faulthandler, after: " + "; ".join(tried) + ")\n"
    return "no stacks: " + "; ".join(tried) + "\n"


def _is_stopped(worker: Worker) -> bool:
    try:
        import psutil

        return worker.process.status() == psutil.STATUS_STOPPED
    except Exception:
        return False


def _faulthandler_dump(worker: Worker, run_dir: Path, deadline: float) -> Optional[str]:
    """SIGUSR2 to a rank that registered faulthandler for it (its file exists: stacks.py), and what it
    wrote. A stopped rank is continued to run its handler (it is killed next anyway); SIGCONT goes to
    every rank, since one being stopped may not show as stopped yet, and a running one ignores it."""
    path = faulthandler_file(run_dir, worker.pid)
    try:
        before = path.stat().st_size
        worker.process.send_signal(DUMP_SIGNAL)
        worker.process.send_signal(signal.SIGCONT)
    except Exception:
        return None
    size, end = before, min(deadline, time.monotonic() + 5.0)
    while time.monotonic() < end:
        time.sleep(0.1)
        try:
            grown = path.stat().st_size
        except OSError:
            return None
        if grown > before and grown == size:
            break  # grew, then stopped growing: the dump is written
        size = grown
    if size <= before:
        return None
    with open(path, "rb") as f:
        f.seek(before)
        return f.read().decode("utf-8", errors="replace")


class Watchdog:
    """The thread: every `poll_s`, read the new events, look at the workers, and act on a hang."""

    def __init__(
        self,
        run_dir: Path,
        launcher_pid: int,
        bounds: Bounds,
        *,
        say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
        poll_s: float = POLL_SECONDS,
        dump_timeout_s: float = DUMP_TIMEOUT_SECONDS,
        clock: Callable[[], float] = time.time,
    ):
        self.run_dir = Path(run_dir)
        self.launcher_pid = launcher_pid
        self.say = say
        self.poll_s = poll_s
        self.dump_timeout_s = dump_timeout_s
        self.clock = clock
        self.progress = Progress(bounds, clock())
        self.hangs: list[dict[str, Any]] = []
        self._tail = EventTail(self.run_dir / EVENTS_DIR)
        self._env_cache: dict = {}
        self._pids: frozenset[int] = frozenset()
        self._writers: dict[int, EventWriter] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._failed = False

    def start(self) -> "Watchdog":
        self._thread = threading.Thread(target=self._run, name="skyspot-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop watching; waits (at most `timeout`) for a hang being handled, its store copy included."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for writer in self._writers.values():
            writer.close()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception as err:  # never take the supervisor down; say it once
                if not self._failed:
                    self._failed = True
                    self.say(f"watchdog: {type(err).__name__}: {err} (still watching)")

    def check(self) -> Optional[dict[str, Any]]:
        """One look; the hang record when this look declared one."""
        for event in self._tail.poll():
            self.progress.feed(event)
        now = self.clock()
        workers = find_workers(self.launcher_pid, self._env_cache)
        pids = frozenset(w.pid for w in workers)
        if pids != self._pids:
            if self._pids:
                self.progress.arm(now)  # torchrun's agent restarted (or is restarting) the workers
            self._pids = pids
        if not workers or not any(w.rank == 0 for w in workers):
            return None  # nothing to kill, or global rank 0 (the one that writes steps) is on another node
        overdue = self.progress.overdue(now)
        if overdue is None:
            return None
        return self._hang(workers, now, overdue)

    def _hang(self, workers: list[Worker], now: float, overdue: float) -> dict[str, Any]:
        progress = self.progress
        bound = progress.bound()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
        directory = self.run_dir / HANGS_DIR / stamp
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        texts: dict[int, str] = {}
        deadline = time.monotonic() + self.dump_timeout_s
        threads = [
            threading.Thread(
                target=lambda w=w: texts.__setitem__(w.rank, dump_one(w, self.run_dir, deadline)), daemon=True
            )
            for w in workers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
        ranks = []
        for worker in workers:
            text = texts.get(worker.rank, "no stacks: the dump did not finish in time\n")
            (directory / f"rank-{worker.rank}.txt").write_text(text, encoding="utf-8")
            ranks.append(
                {
                    "rank": worker.rank,
                    "local_rank": worker.local_rank,
                    "pid": worker.pid,
                    "top": top_frame(text, worker.pid),
                }
            )
        first_step = progress.last_step_at is None
        record = {
            "ts": now,
            "step": progress.step,
            "bound_seconds": round(bound, 3),
            "seconds_without_step": round(progress.without_step(now), 3),
            "stacks": str(directory),
            "first_step": first_step,
            "ranks": ranks,
        }
        atomic_write_json(self.run_dir / HANG_JSON, record)
        writer = self._writer()
        if writer is not None:
            writer.emit(
                "hang",
                step=record["step"],
                seconds_without_step=record["seconds_without_step"],
                bound_seconds=record["bound_seconds"],
                ranks=ranks,
                stacks=str(directory),
                first_step=first_step,
            )
        where = ", ".join(f"rank {r['rank']} in {r['top'] or '?'}" for r in ranks)
        what = "no first step" if first_step else f"no step after step {progress.step}"
        self.say(
            f"hang: {what} for {overdue:.0f} s (bound {bound:.0f} s); stacks in {directory}; "
            f"killing {len(workers)} rank(s): {where}"
        )
        for worker in workers:
            try:
                worker.process.kill()  # SIGKILL: a stopped process dies too
            except Exception:
                pass
            try:
                faulthandler_file(self.run_dir, worker.pid).unlink()
            except OSError:
                pass
        progress.arm(self.clock())  # torchrun's agent restarts them, or the command ends
        self.hangs.append(record)
        self._copy_to_store(directory, writer)
        return record

    def _writer(self) -> Optional[EventWriter]:
        """The supervisor's event writer for the trainer's current attempt (the newest event's, else
        DIR/attempts.json's), one file per attempt beside the ranks' files."""
        identity = self.progress.identity
        attempt = identity.get("attempt")
        if not isinstance(attempt, int):
            counted = read_json(self.run_dir / ATTEMPTS)
            attempt = counted.get("attempt") if isinstance(counted, dict) else None
        if not isinstance(attempt, int):
            return None
        if attempt not in self._writers:
            node_rank = identity.get("node_rank")
            if not isinstance(node_rank, int):
                node_rank = int(os.environ.get("SKYPILOT_NODE_RANK") or 0)
            self._writers[attempt] = EventWriter(
                self.run_dir, self._run_id() or "", attempt, node_rank, None, supervisor=True
            )
        return self._writers[attempt]

    def _run_id(self) -> Optional[str]:
        run = read_json(self.run_dir / RUN_JSON)
        return self.progress.identity.get("run_id") or (run.get("run_id") if isinstance(run, dict) else None)

    def _copy_to_store(self, directory: Path, writer: Optional[EventWriter]) -> None:
        """The dumps and the event file into `<store>/<run>/`; a store that fails costs a line."""
        run = read_json(self.run_dir / RUN_JSON)
        uri, run_id = (run.get("store") if isinstance(run, dict) else None), self._run_id()
        if not uri or not run_id:
            return
        try:
            from skyspot.storage import join_key, open_store

            store = open_store(uri)
            for path in sorted(directory.iterdir()):
                store.put_file(path, join_key(run_id, HANGS_DIR, directory.name, path.name))
            if writer is not None:
                store.put_file(writer.path, join_key(run_id, EVENTS_DIR, writer.path.name))
        except Exception as err:
            self.say(f"hang: stacks not copied to {uri}: {type(err).__name__}: {err}")


def start_watchdog(
    run_dir: Path, launcher_pid: int, bounds: Optional[Bounds], say: Callable[[str], None]
) -> Optional[Watchdog]:
    """The supervisor's entry: a started watchdog, or None when off (or it cannot start: never fatal)."""
    if bounds is None:
        return None
    try:
        return Watchdog(run_dir, launcher_pid, bounds, say=say).start()
    except Exception as err:
        say(f"not watching for hangs: {err}")
        return None
