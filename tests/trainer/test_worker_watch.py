"""The supervisor's watch of torchrun's workers (worker_watch.py), against real processes.

A small launcher stands in for torchrun: it starts a generation of workers with LOCAL_RANK and RANK in
their environment, as torchrun's agent does, and when one ends it stops the rest and starts the next
generation (torchrun's restart in place). Every end must be noted with its rank, and the whole process
table must be scanned only while a generation is expected.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from skyspot.trainer import worker_watch
from skyspot.trainer.restart import WORKER_EXITS

LAUNCHER = r"""
import os, subprocess, sys, time
def generation():
    return [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             env={**os.environ, "LOCAL_RANK": str(r), "RANK": str(10 + r)}) for r in range(2)]
workers = generation()
print(" ".join(str(w.pid) for w in workers), flush=True)
while True:
    if any(w.poll() is not None for w in workers):
        for w in workers:
            w.kill(); w.wait()
        time.sleep(0.3)
        workers = generation()
        print(" ".join(str(w.pid) for w in workers), flush=True)
    time.sleep(0.05)
"""


def _exits(run_dir: Path) -> list[dict]:
    path = run_dir / WORKER_EXITS
    return json.loads(path.read_text())["exits"] if path.exists() else []


def _until(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out: {predicate()!r}")


@pytest.fixture
def launcher():
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    yield proc
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every generation of its workers
    proc.wait()


def _generation(proc: subprocess.Popen) -> list[int]:
    return [int(pid) for pid in proc.stdout.readline().split()]


def test_children_are_the_live_children_of_the_launcher_only(launcher):
    first = _generation(launcher)
    assert sorted(worker_watch.children(launcher.pid)) == sorted(first)
    ours = worker_watch.children(os.getpid())
    assert launcher.pid in ours and not set(first) & set(ours)  # children, not grandchildren
    assert all(worker_watch.alive_child(pid, launcher.pid) for pid in first)
    assert not worker_watch.alive_child(first[0], os.getpid())  # alive, but not our child
    os.kill(first[0], signal.SIGKILL)
    _until(lambda: not worker_watch.alive_child(first[0], launcher.pid))  # a zombie, then gone


@pytest.fixture
def found(monkeypatch) -> list[int]:
    """The pids the watch has learned a rank of, in order (the real lookup, recorded)."""
    seen: list[int] = []
    real = worker_watch._local_rank

    def recorded(pid: int):
        ranks = real(pid)
        if ranks is not None:
            seen.append(pid)
        return ranks

    monkeypatch.setattr(worker_watch, "_local_rank", recorded)
    return seen


def test_every_end_is_noted_with_its_rank_and_the_next_generation_is_found(launcher, tmp_path, monkeypatch, found):
    scans = []
    real = worker_watch.children
    monkeypatch.setattr(worker_watch, "children", lambda parent: scans.append(time.monotonic()) or real(parent))
    first = _generation(launcher)
    stop = worker_watch.watch_workers(launcher.pid, tmp_path, "t0k3n", settle_s=0.5)
    try:
        _until(lambda: set(first) <= set(found))
        time.sleep(0.7)  # past settle_s since the last worker was found
        settled_at = time.monotonic()
        time.sleep(3.0)
        slow = [t for t in scans if t > settled_at]
        # settled: one scan each SCAN_S (a loaded machine only stretches the gaps), not one every POLL_S
        assert slow and min((b - a for a, b in zip(slow, slow[1:])), default=1.0) >= 0.9, slow

        os.kill(first[1], signal.SIGKILL)
        second = _generation(launcher)
        exits = _until(lambda: len(_exits(tmp_path)) >= 2 and _exits(tmp_path))
        assert {(e["pid"], e["local_rank"], e["launcher_rank"]) for e in exits} == {
            (first[0], 0, "10"),
            (first[1], 1, "11"),
        }
        # the next generation, started 0.3 s after the end, is found: with no worker known the scans are
        # every POLL_S again (a worker that came and went within one poll would never be seen)
        _until(lambda: set(second) <= set(found))
        os.kill(second[0], signal.SIGKILL)
        exits = _until(lambda: len(_exits(tmp_path)) >= 4 and _exits(tmp_path))
        assert {e["pid"] for e in exits[2:]} == set(second)
        assert json.loads((tmp_path / WORKER_EXITS).read_text())["token"] == "t0k3n"
    finally:
        stop.set()


def test_the_watch_ends_when_the_launcher_does(launcher, tmp_path, found):
    first = _generation(launcher)
    worker_watch.watch_workers(launcher.pid, tmp_path, "t0k3n", settle_s=0.5)
    _until(lambda: set(first) <= set(found))
    launcher.kill()  # its workers live on, orphaned: no longer the launcher's, so ended for the run
    launcher.wait()
    exits = _until(lambda: len(_exits(tmp_path)) >= 2 and _exits(tmp_path))
    assert {e["pid"] for e in exits} == set(first)
    _until(lambda: not any(t.name == "skyspot-workers" for t in threading.enumerate()))  # the watch ended
