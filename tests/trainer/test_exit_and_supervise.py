"""Exit codes and the supervisor that carries them past torchrun (no torch needed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Optional

import psutil
import pytest

from skyspot.errors import CheckpointError, RecipeError, UsageError
from skyspot.trainer import exit_codes
from skyspot.trainer.supervise import FORWARDED
from skyspot.trainer.exit_codes import (
    COMPLETE,
    ERROR,
    INTERRUPTED,
    NO_VALID_CHECKPOINT,
    PREEMPTED,
    USAGE,
    Preempted,
    code_for,
    read_exit_record,
    write_exit_record,
)
from tests.trainer.launch import REPO, trainer_env


def test_exit_codes_are_the_documented_ones():
    assert (COMPLETE, ERROR, USAGE, NO_VALID_CHECKPOINT, PREEMPTED) == (0, 1, 2, 3, 75)
    assert code_for(Preempted(5, "x")) == 75
    assert code_for(CheckpointError("x")) == 3
    assert code_for(RecipeError("r", ["bad"])) == 2 and code_for(UsageError("x")) == 2
    assert code_for(KeyboardInterrupt()) == INTERRUPTED
    assert code_for(RuntimeError("boom")) == 1 and code_for(MemoryError()) == 1


def test_the_task_renders_the_same_recover_code():
    from skyspot.task.render import RECOVER_EXIT_CODE

    assert RECOVER_EXIT_CODE == PREEMPTED


def test_exit_record_is_trusted_only_for_this_start(tmp_path, monkeypatch):
    monkeypatch.setenv(exit_codes.TOKEN_ENV, "mine")
    write_exit_record(tmp_path, PREEMPTED, reason="preempted", attempt=2, step=6)
    assert read_exit_record(tmp_path, token="mine", since=0)["code"] == PREEMPTED
    assert read_exit_record(tmp_path, token="other", since=0) is None
    monkeypatch.delenv(exit_codes.TOKEN_ENV)
    write_exit_record(tmp_path, COMPLETE, reason="done", attempt=3, step=9)
    assert read_exit_record(tmp_path, token="any", since=0)["code"] == COMPLETE  # no token: by time
    assert read_exit_record(tmp_path, token="any", since=time.time() + 60) is None


# A stand-in for torchrun + trainer: records `code` for this start and exits 1 like torchrun does.
FAKE = textwrap.dedent("""
    import os, signal, sys, time
    from skyspot.trainer.exit_codes import write_exit_record
    run_dir, code, wait = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "wait"
    def on_term(signum, frame):
        write_exit_record(run_dir, 75, reason=f"got {signal.Signals(signum).name}", attempt=1, step=3)
        sys.exit(1)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGUSR1, on_term)
    open(os.path.join(run_dir, "ready"), "w").close()
    if wait:
        time.sleep(60)
    if code >= 0:
        write_exit_record(run_dir, code, reason="fake", attempt=1, step=3)
    sys.exit(1)
""")


def supervise(run_dir, *args, **kwargs) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "skyspot.trainer.supervise",
        "--run-dir",
        str(run_dir),
        "--",
        sys.executable,
        "-c",
        FAKE,
        str(run_dir),
        *args,
    ]
    return subprocess.Popen(command, cwd=REPO, env=trainer_env(), stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.parametrize("recorded", [0, 3, 75])
def test_supervisor_exits_with_the_code_the_trainer_recorded(tmp_path, recorded):
    proc = supervise(tmp_path, str(recorded), "go")
    assert proc.wait(30) == recorded


def test_supervisor_ignores_a_stale_record_and_passes_the_command_code(tmp_path):
    (tmp_path / "exit.json").write_text(json.dumps({"code": 75, "token": "old", "ts": time.time()}))
    proc = supervise(tmp_path, "-1", "go")
    assert proc.wait(30) == 1
    assert "no exit record" in proc.stderr.read()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_supervisor_forwards_signals_to_the_command(tmp_path, sig):
    proc = supervise(tmp_path, "-1", "wait")
    deadline = time.monotonic() + 30
    while not (tmp_path / "ready").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    proc.send_signal(sig)
    assert ended(proc, 30) == PREEMPTED


def ended(proc: subprocess.Popen, timeout: float) -> int:
    """The supervisor's exit code; past `timeout`, killed and failed with what it said on stderr."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the supervisor had not ended {timeout} s after the signal; it said: {proc.communicate()[1]!r}")


FORWARDED_BITS = set(FORWARDED)


def blocked(pid: int, tid: int) -> Optional[set[int]]:
    """The signals thread `tid` of `pid` blocks (proc(5): SigBlk, a hex mask, bit N-1 for signal N); None
    when the thread has ended since it was listed."""
    try:
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    except FileNotFoundError:
        return None
    for line in status.splitlines():
        if line.startswith("SigBlk:"):
            mask = int(line.split()[1], 16)
            return {n for n in range(1, 65) if mask >> (n - 1) & 1}
    raise AssertionError(f"no SigBlk for thread {tid}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_only_the_supervisors_main_thread_can_take_a_forwarded_signal(tmp_path):
    """A signal to a process goes to any thread not blocking it, and Python runs handlers only in the main
    thread: one taken by the watchdog's or the worker watch's thread while the main thread waits on the
    command would never be forwarded (CI saw a SIGTERM go unforwarded for 30 s). The helpers block them."""
    proc = supervise(tmp_path, "-1", "wait")
    deadline = time.monotonic() + 30
    while not (tmp_path / "ready").exists() or len(os.listdir(f"/proc/{proc.pid}/task")) < 3:
        assert time.monotonic() < deadline and proc.poll() is None  # main, the watchdog, the worker watch
        time.sleep(0.02)
    threads = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
    helpers = [t for t in threads if t != proc.pid]
    main = blocked(proc.pid, proc.pid)
    assert main is not None and not FORWARDED_BITS & main
    masks = [m for m in (blocked(proc.pid, t) for t in helpers) if m is not None]  # None: ended since listed
    assert masks and all(FORWARDED_BITS <= m for m in masks)
    (command,) = psutil.Process(proc.pid).children()
    theirs = blocked(command.pid, command.pid)
    assert theirs is not None and not FORWARDED_BITS & theirs  # the command inherits no blocked signal
    proc.send_signal(signal.SIGTERM)
    assert ended(proc, 30) == PREEMPTED


def test_supervisor_usage_errors_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "skyspot.trainer.supervise", "--run-dir", str(tmp_path)],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "--" in proc.stderr


def test_command_killed_by_a_signal_maps_to_128_plus_n(tmp_path):
    command = [
        sys.executable,
        "-m",
        "skyspot.trainer.supervise",
        "--run-dir",
        str(tmp_path),
        "--",
        sys.executable,
        "-c",
        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    ]
    assert subprocess.run(command, cwd=REPO, env=trainer_env(), timeout=30).returncode == 137


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_orphan_never_runs_on_when_its_parent_died_before_the_death_signal_was_armed():
    """Found by the wiped-disk random kills (docs/reliability.md): a child whose parent is not the one it
    expects exits at once, in the supervisor's child (before exec) and in the trainer's workers."""
    import os

    from skyspot.trainer import process_env
    from skyspot.trainer.supervise import _child_setup

    me = os.getpid()  # read here: the preexec function runs in the child
    mine = subprocess.run(
        [sys.executable, "-c", "print('ran')"], preexec_fn=lambda: _child_setup(me), capture_output=True, text=True
    )
    assert mine.returncode == 0 and mine.stdout.strip() == "ran"  # its parent is the one it expects
    stranger = subprocess.run(
        [sys.executable, "-c", "print('ran')"], preexec_fn=lambda: _child_setup(1), capture_output=True, text=True
    )
    assert stranger.returncode == 1 and stranger.stdout == ""  # never exec'd
    assert not process_env.is_launcher(os.getpid())  # pytest is no torch elastic launcher
