"""Benchmark 3: recovery. A resumed attempt's start to its first step, against a cold start's.

Both run the real entry, as a node does:

    python -m skyspot.trainer.supervise --run-dir D -- \
        torchrun --nproc_per_node 2 -m skyspot.trainer tiny --run-dir D ...

in the same run directory, alternating: a cold start (`--fresh`, which moves earlier work aside)
runs until its first interval checkpoint is committed and is then killed (SIGKILL, like a VM taken
away); the next start resumes from that checkpoint and is killed after its first step. Each time
is measured from the launch (the parent's clock) to the first `step` event; the events also give
the trainer's own `start` time and the resume's `load_seconds`, compared with bytes / the run
directory's read bandwidth (page cache: the checkpoint was just written, as on a node restarted
in place; a replacement VM reads its disk or the store).

Goal: resume <= 1.3x cold start.
"""

from __future__ import annotations

import fcntl
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import _launch
from bench._launch import bench_env, disk_bandwidth, ensure_shm_op, events, kill_group, trainer_command, wait_for_event
from bench.common import Figure, Results

GOAL = 1.3
OVERRIDES = ["train.steps=100000", "checkpoint.every_steps=2", "train.log_every=100000"]
TIMEOUT_S = 300


def _after(t0: float, type: str):
    return lambda e: e.get("type") == type and e.get("rank") == 0 and e.get("ts", 0) >= t0


def _wait_unlocked(run_dir: Path, timeout: float = 60) -> None:
    """The killed trainer's lock is released once its last process is gone (flock)."""
    lock = run_dir / ".lock"
    deadline = time.monotonic() + timeout
    while lock.exists() and time.monotonic() < deadline:
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return
        except OSError:
            time.sleep(0.1)
        finally:
            os.close(fd)


def attempt(run_dir: Path, *, fresh: bool, log: Path) -> dict:
    """One start; returns launch -> first step, start event -> first step, and the resume event."""
    with open(log, "ab") as out:
        t0 = time.time()
        proc = subprocess.Popen(
            trainer_command(run_dir, OVERRIDES, fresh=fresh),
            cwd=_launch.REPO,
            env=bench_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            first = wait_for_event(run_dir, proc, _after(t0, "step"), TIMEOUT_S)
            if fresh:  # leave a committed checkpoint for the next start
                wait_for_event(run_dir, proc, _after(t0, "checkpoint_end"), TIMEOUT_S)
        finally:
            kill_group(proc)
    _wait_unlocked(run_dir)
    start = [e for e in events(run_dir, "start") if e["ts"] >= t0]
    resume = [e for e in events(run_dir, "resume") if e["ts"] >= t0]
    steps = [e for e in events(run_dir, "step") if e["ts"] >= t0]
    return {
        "launch_to_step": first["ts"] - t0,
        "start_to_step": first["ts"] - start[0]["ts"] if start else None,
        "resume": resume[0] if resume else None,
        "step_seconds": [e["step_seconds"] for e in steps],
    }


def run(results: Results, quick: bool) -> None:
    ensure_shm_op(results)
    rounds = 1 if quick else 3
    cold, warm = [], []
    with tempfile.TemporaryDirectory(prefix="skyspot-bench-recovery-") as tmp:
        run_dir = Path(tmp) / "run"
        log = Path(tempfile.gettempdir()) / "skyspot-bench-recovery.log"
        log.write_bytes(b"")
        for _ in range(rounds):
            cold.append(attempt(run_dir, fresh=True, log=log))
            warm.append(attempt(run_dir, fresh=False, log=log))
            print(
                f"   recovery: cold {cold[-1]['launch_to_step']:.1f}s, resume {warm[-1]['launch_to_step']:.1f}s",
                file=sys.stderr,
                flush=True,
            )
        missing = [w for w in warm if w["resume"] is None]
        if missing:
            raise RuntimeError("a resumed start logged no resume event (it started over?)")
        nbytes = max(int(w["resume"].get("bytes") or 0) for w in warm)
        _, read_bps = disk_bandwidth(run_dir, max(nbytes, 64 << 20))

    # Calibration for lost_work: how long a start takes here, and a step.
    steps = [s for a in cold + warm for s in a["step_seconds"][1:]]
    _launch.CALIBRATION.update(startup_s=statistics.median(a["launch_to_step"] for a in cold + warm))
    if steps:
        _launch.CALIBRATION.update(step_s=statistics.median(steps))

    c = [a["launch_to_step"] for a in cold]
    w = [a["launch_to_step"] for a in warm]
    ratios = [b / a for a, b in zip(c, w)]
    results.add(
        Figure(
            "recovery",
            "cold start: launch -> first step (tiny)",
            "s",
            c,
            note=f"trainer start event -> first step: "
            f"{statistics.median(a['start_to_step'] for a in cold):.2f} s (the rest is imports)",
        )
    )
    results.add(
        Figure(
            "recovery",
            "resumed start: launch -> first step (tiny)",
            "s",
            w,
            note=f"start event -> first step: {statistics.median(a['start_to_step'] for a in warm):.2f} s",
        )
    )
    median = statistics.median(ratios)
    results.add(
        Figure(
            "recovery",
            "resume / cold start",
            "x",
            ratios,
            goal=f"<= {GOAL}",
            met=median <= GOAL,
            note="" if median <= GOAL else "missed: see the load figure",
        )
    )
    loads = [a["resume"]["load_seconds"] for a in warm]
    floor = nbytes / read_bps
    results.add(
        Figure(
            "recovery",
            f"resume load (tiny, {nbytes / 1e6:.1f} MB)",
            "s",
            loads,
            note=f"bytes / read bandwidth = {floor * 1000:.1f} ms ({read_bps / 1e9:.1f} GB/s, page cache); "
            f"{statistics.median(loads) / floor:.0f}x that: DeepSpeed's load_checkpoint, RNG and "
            "bias-correction replay, not bytes, at this size",
        )
    )
