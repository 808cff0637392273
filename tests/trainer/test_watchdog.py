"""The hang watchdog (trainer/watchdog.py): its bound, what counts as progress, its detection on event
files the test writes, the stack dumps (py-spy, and faulthandler where ptrace is refused), and the
supervisor's flags as the run script renders them. Real processes throughout: the "ranks" are Python
children of a stand-in launcher, with torchrun's RANK / LOCAL_RANK in their environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from skyspot.events import EventWriter, read_events_dir
from skyspot.trainer.supervise import parse_args, watchdog_bounds
from skyspot.trainer.watchdog import (
    HANG_JSON,
    Bounds,
    Progress,
    Watchdog,
    Worker,
    _faulthandler_dump,
    dump_one,
    find_workers,
    hang_bound,
    py_spy,
    top_frame,
)

BOUNDS = Bounds(factor=10, floor_seconds=5, first_step_seconds=60)


def step(ts: float, n: int, seconds: float = 0.1, rank: int = 0, **fields) -> dict:
    return {
        "ts": ts,
        "type": "step",
        "rank": rank,
        "node_rank": 0,
        "attempt": 1,
        "run_id": "r",
        "step": n,
        "step_seconds": seconds,
        **fields,
    }


def event(ts: float, type: str, rank: int = 0, **fields) -> dict:
    return {"ts": ts, "type": type, "rank": rank, "node_rank": 0, "attempt": 1, "run_id": "r", **fields}


# ---------------------------------------------------------------------------------------- the bound


def test_bound_is_factor_times_the_median_step_or_the_floor():
    assert hang_bound([1.0, 1.0, 2.0, 100.0], BOUNDS) == 15.0  # 10 x median 1.5; one slow step moves nothing
    assert hang_bound([0.1] * 9, BOUNDS) == 5.0  # the floor
    assert hang_bound([], BOUNDS) == 5.0
    assert hang_bound([0.1], BOUNDS, longest_pause=40.0) == 80.0  # twice the longest eval or save measured


def test_no_first_step_within_its_bound_is_a_hang():
    p = Progress(BOUNDS, armed_at=1000.0)
    p.feed(event(1001.0, "start", total_steps=100))
    p.feed(event(1030.0, "resume"))  # events before the first step do not stretch the first-step bound
    assert p.bound() == 60.0
    assert p.overdue(1059.0) is None
    assert p.overdue(1061.0) == pytest.approx(61.0)


def test_after_a_step_any_event_from_a_rank_counts_as_progress():
    p = Progress(BOUNDS, armed_at=0.0)
    for n in range(1, 6):
        p.feed(step(10.0 + n, n, seconds=1.0))
    assert p.bound() == 10.0
    assert p.overdue(24.9) is None and p.overdue(25.1) == pytest.approx(10.1)
    p.feed(event(24.0, "upload_end", rank=1))
    assert p.overdue(25.1) is None and p.overdue(34.1) == pytest.approx(10.1)
    p.feed(event(33.0, "eval", seconds=30.0))  # an eval measured: the next one is not a hang
    assert p.bound() == 60.0 and p.overdue(90.0) is None and p.overdue(93.5) is not None


def test_no_hang_on_the_way_out_or_after_the_last_step():
    for last in (
        event(12.0, "signal", signum=15),
        event(12.0, "preemption_notice"),
        event(12.0, "emergency_checkpoint"),
        event(12.0, "exit", code=1),
    ):
        p = Progress(BOUNDS, armed_at=0.0)
        p.feed(step(11.0, 1))
        p.feed(last)
        assert p.overdue(10_000.0) is None, last["type"]
    p = Progress(BOUNDS, armed_at=0.0)
    p.feed(event(1.0, "start", total_steps=3))
    for n in (1, 2, 3):
        p.feed(step(1.0 + n, n))
    assert p.stopped == "the last step" and p.overdue(10_000.0) is None  # the final save, export, upload
    p = Progress(BOUNDS, armed_at=0.0)
    p.feed(event(1.0, "start", total_steps=3))
    p.feed(event(2.0, "resume", step=3))  # resumed at the end: only the final save and export remain
    assert p.overdue(10_000.0) is None


def test_a_restart_rearms_with_the_first_step_bound_and_keeps_the_step_history():
    p = Progress(BOUNDS, armed_at=0.0)
    for n in range(1, 4):
        p.feed(step(float(n), n, seconds=2.0))
    p.feed(event(4.0, "exit", code=1))
    p.arm(100.0)  # the workers changed
    p.feed(step(50.0, 4, seconds=2.0))  # a late line of the old workers: history, not progress
    assert p.stopped is None and p.last_step_at is None and p.bound() == 60.0
    assert p.overdue(159.0) is None and p.overdue(161.0) is not None
    p.feed(step(120.0, 4, seconds=2.0))
    assert p.bound() == 20.0 and p.step == 4  # median of all four starts' steps: 2 s


def test_a_start_event_after_steps_rearms_even_unseen_workers():
    p = Progress(BOUNDS, armed_at=0.0)
    p.feed(step(1.0, 1))
    p.feed(event(30.0, "start", total_steps=100))
    assert p.last_step_at is None and p.armed_at == 30.0 and p.bound() == 60.0


def test_the_supervisor_flags_carry_the_bounds_and_the_switch():
    args, command = parse_args(
        ["--run-dir", "d", "--hang-factor", "4", "--hang-floor", "7", "--first-step-bound", "90", "--", "torchrun"]
    )
    assert watchdog_bounds(args) == Bounds(4.0, 7.0, 90.0) and command == ["torchrun"]
    args, _ = parse_args(["--run-dir", "d", "--", "torchrun"])
    assert watchdog_bounds(args) == Bounds(10.0, 300.0, 3600.0)  # the recipe's defaults
    args, _ = parse_args(["--run-dir", "d", "--no-watchdog", "--", "torchrun"])
    assert watchdog_bounds(args) is None
    with pytest.raises(SystemExit) as usage:
        parse_args(["--run-dir", "d", "--hang-floor", "-1", "--", "torchrun"])
    assert usage.value.code == 2


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--hang-factor", "1.5"),  # the recipe wants 2..1e6
        ("--hang-factor", "2e6"),
        ("--hang-floor", "1e300"),  # the recipe: at most 1e12
        ("--hang-floor", "nan"),
        ("--first-step-bound", "inf"),
        ("--first-step-bound", "0"),
    ],
)
def test_the_supervisor_refuses_what_the_recipe_refuses(flag, value, capsys):
    """Issue 31, item 13: the supervisor took bounds the recipe refuses (a hand-written run script, or one
    rendered by another skyspot version, reached the watchdog unchecked)."""
    from pydantic import ValidationError

    from skyspot.recipe import ResilienceSection

    field = {
        "--hang-factor": "hang_factor",
        "--hang-floor": "hang_floor_seconds",
        "--first-step-bound": "first_step_seconds",
    }
    with pytest.raises(ValidationError):
        ResilienceSection.model_validate({field[flag]: float(value)})
    with pytest.raises(SystemExit) as usage:
        parse_args(["--run-dir", "d", flag, value, "--", "torchrun"])
    assert usage.value.code == 2
    assert f"invalid resilience.{field[flag]} value: '{value}'" in capsys.readouterr().err


def test_the_run_script_passes_the_recipes_resilience_to_the_supervisor():
    from skyspot.recipe import load_recipe
    from skyspot.task.render import run_script

    recipe = load_recipe(
        "tiny", ["resilience.hang_factor=4", "resilience.hang_floor_seconds=30", "resilience.first_step_seconds=900"]
    )
    line = next(s for s in run_script(recipe, "tiny", []).splitlines() if "skyspot.trainer.supervise" in s)
    assert "--hang-factor 4 --hang-floor 30 --first-step-bound 900 --" in line
    off = load_recipe("tiny", ["resilience.watchdog=false"])
    assert "--no-watchdog --" in run_script(off, "tiny", [])


# ------------------------------------------------------------------------------------ stacks parsing

PYSPY = """Process 4242: python -m skyspot.trainer tiny
Python v3.11.7 (/usr/bin/python3.11)

Thread 4250 (idle): "skyspot-uploader"
    wait (threading.py:327)
Thread 4242 (active): "MainThread"
    all_gather_into_tensor (torch/distributed/distributed_c10d.py:3901)
    _vote (skyspot/trainer/loop.py:571)
"""

FAULTHANDLER = """Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait

Current thread 0x00007f0000000002 (most recent call first):
  File "/x/skyspot/trainer/loop.py", line 571 in _vote
  File "/x/skyspot/trainer/loop.py", line 690 in train
"""


def test_top_frame_is_the_main_threads_innermost_frame():
    assert top_frame(PYSPY, 4242) == "torch/distributed/distributed_c10d.py:3901 all_gather_into_tensor"
    assert top_frame(FAULTHANDLER) == "/x/skyspot/trainer/loop.py:571 _vote"
    assert top_frame("no stacks: py-spy is not installed\n") is None


# ------------------------------------------------------------------------------ real processes

RANK_CODE = textwrap.dedent("""
    import os, subprocess, sys, time
    sys.path.insert(0, {repo!r})
    if os.environ["RANK"] == "0":  # a rank's own child inherits RANK: it is not a rank (a data loader, a compiler)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    if os.environ.get("REGISTER"):
        from skyspot.trainer.stacks import allow_stack_dumps
        allow_stack_dumps(os.environ["RUN_DIR"])
    open(os.environ["READY"], "w").close()
    def waiting_in_a_collective():
        while True:
            time.sleep(0.05)
    waiting_in_a_collective()
""")

LAUNCHER_CODE = textwrap.dedent("""
    import os, subprocess, sys, time
    code = sys.argv[1]
    ranks = []
    for rank in range(int(sys.argv[2])):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), READY=os.environ["READY"] + str(rank))
        ranks.append(subprocess.Popen([sys.executable, "-c", code], env=env))
    for r in ranks:
        r.wait()
""")


@pytest.fixture
def launcher(tmp_path):
    """A stand-in torchrun with `n` ranks that loop in `waiting_in_a_collective`; yields its Popen."""
    procs = []

    def start(n: int = 2, **env) -> subprocess.Popen:
        ready = tmp_path / "ready"
        code = RANK_CODE.format(repo=str(Path(__file__).resolve().parents[2]))
        proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER_CODE, code, str(n)],
            env=dict(os.environ, READY=str(ready), RUN_DIR=str(tmp_path / "run"), **env),
        )
        procs.append(proc)
        deadline = time.monotonic() + 30
        while not all(Path(f"{ready}{r}").exists() for r in range(n)):
            assert time.monotonic() < deadline, "the stand-in ranks did not start"
            time.sleep(0.05)
        return proc

    yield start
    for proc in procs:
        for child in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
            child.kill()
        proc.kill()
        proc.wait()


def test_find_workers_takes_the_launchers_ranks_not_their_children(launcher):
    proc = launcher(2)
    workers = find_workers(proc.pid)
    assert [(w.rank, w.local_rank) for w in workers] == [(0, 0), (1, 1)]
    assert all(psutil.Process(w.pid).ppid() == proc.pid for w in workers)


def gone(pid: int, timeout: float = 5.0) -> bool:
    """Whether `pid` died (a zombie its stand-in launcher has not reaped yet counts) within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def _ptrace_refused() -> str | None:
    if py_spy() is None:
        return "py-spy is not installed"
    probe = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        done = subprocess.run([py_spy(), "dump", "--pid", str(probe.pid)], capture_output=True, text=True, timeout=20)
        if done.returncode != 0:
            return f"ptrace is not permitted here: {done.stderr.strip().splitlines()[:2]}"
    finally:
        probe.kill()
        probe.wait()
    return None


def test_py_spy_reads_a_stopped_ranks_stack(launcher, tmp_path):
    refused = _ptrace_refused()
    if refused:
        pytest.skip(refused)
    proc = launcher(1)
    worker = find_workers(proc.pid)[0]
    os.kill(worker.pid, signal.SIGSTOP)
    started = time.monotonic()
    text = dump_one(worker, tmp_path, time.monotonic() + 10)
    assert time.monotonic() - started < 10
    assert "waiting_in_a_collective" in text, text
    assert top_frame(text, worker.pid).endswith(" waiting_in_a_collective")
    assert psutil.Process(worker.pid).status() == psutil.STATUS_STOPPED  # read, not continued


def test_faulthandler_writes_the_stacks_where_ptrace_is_refused(launcher, tmp_path):
    proc = launcher(1, REGISTER="1", TORCHELASTIC_RUN_ID="test")
    worker = find_workers(proc.pid)[0]
    os.kill(worker.pid, signal.SIGSTOP)  # a stopped rank is continued to run its handler
    text = _faulthandler_dump(worker, tmp_path / "run", time.monotonic() + 10)
    assert text and "waiting_in_a_collective" in text, text
    assert top_frame(text) is not None and top_frame(text).endswith(("waiting_in_a_collective", "<module>"))


def test_a_rank_without_the_handler_is_never_sent_the_signal(launcher, tmp_path):
    proc = launcher(1)
    worker = find_workers(proc.pid)[0]
    assert _faulthandler_dump(worker, tmp_path / "run", time.monotonic() + 2) is None
    assert psutil.Process(worker.pid).is_running()  # an unhandled SIGUSR2 would have killed it


def test_a_hang_on_event_files_is_detected_dumped_recorded_and_the_ranks_killed(launcher, tmp_path):
    run_dir, store = tmp_path / "run", tmp_path / "store"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"run_id": "hung-run", "store": str(store)}))
    proc = launcher(2)
    lines = []
    dog = Watchdog(run_dir, proc.pid, Bounds(factor=10, floor_seconds=1.0, first_step_seconds=30), say=lines.append)
    writers = [EventWriter(run_dir, "hung-run", 3, 0, rank) for rank in (0, 1)]
    writers[0].emit("start", total_steps=1000)
    for n in range(1, 6):
        writers[0].emit("step", step=n, step_seconds=0.01)
    last = time.time()
    assert dog.check() is None
    workers = find_workers(proc.pid)
    os.kill(workers[1].pid, signal.SIGSTOP)
    record = None
    while record is None and time.time() - last < 10:
        time.sleep(0.1)
        record = dog.check()
    assert record is not None
    assert 1.0 < record["ts"] - last < 1.0 + 1.0  # the bound (the floor), give or take this loop's 0.1 s
    assert record["step"] == 5 and record["bound_seconds"] == 1.0 and record["first_step"] is False
    on_disk = json.loads((run_dir / HANG_JSON).read_text())
    assert on_disk == record and set(on_disk) >= {"ts", "step", "bound_seconds", "stacks", "seconds_without_step"}
    stacks = Path(record["stacks"])
    assert sorted(p.name for p in stacks.iterdir()) == ["rank-0.txt", "rank-1.txt"]
    assert all(gone(w.pid) for w in workers)
    hang = read_events_dir(run_dir / "events").of_type("hang")
    assert len(hang) == 1 and hang[0]["rank"] is None and hang[0]["attempt"] == 3 and hang[0]["run_id"] == "hung-run"
    assert [r["rank"] for r in hang[0]["ranks"]] == [0, 1] and hang[0]["stacks"] == record["stacks"]
    assert (run_dir / "events" / "attempt-3.node-0.supervisor.jsonl").exists()
    if _ptrace_refused() is None:
        assert all(r["top"] and r["top"].endswith("waiting_in_a_collective") for r in hang[0]["ranks"]), hang
    assert (store / "hung-run" / "hangs" / stacks.name / "rank-1.txt").exists()
    assert (store / "hung-run" / "events" / "attempt-3.node-0.supervisor.jsonl").exists()
    assert len(lines) == 1 and lines[0].startswith("hang: no step after step 5 for 1 s (bound 1 s)")
    # re-armed with the first-step bound for the restarted workers (none come here)
    assert dog.progress.last_step_at is None and dog.progress.bound() == 30


def test_a_store_that_fails_costs_a_line_not_the_kill(launcher, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"run_id": "r", "store": "s3://"}))  # not a store
    proc = launcher(1)
    lines = []
    dog = Watchdog(run_dir, proc.pid, Bounds(10, 0.2, 0.5), say=lines.append, dump_timeout_s=5)
    worker = find_workers(proc.pid)[0]
    time.sleep(0.6)
    record = dog.check()  # no first step within 0.5 s
    assert record is not None and record["first_step"] is True and record["step"] is None
    assert gone(worker.pid)
    assert len(lines) == 2 and lines[0].startswith("hang: no first step") and "not copied to s3://" in lines[1]


def test_no_hang_where_global_rank_zero_is_not(launcher, tmp_path, monkeypatch):
    """Step events come from global rank 0 alone: a node without it has nothing to measure."""
    proc = launcher(1)
    real = find_workers(proc.pid)
    monkeypatch.setattr(
        "skyspot.trainer.watchdog.find_workers", lambda pid, cache=None: [Worker(w.pid, 1, 0, w.process) for w in real]
    )
    dog = Watchdog(tmp_path, proc.pid, Bounds(10, 0.1, 0.1), say=lambda line: None)
    time.sleep(0.3)
    assert dog.check() is None and psutil.Process(real[0].pid).is_running()


def test_a_workers_start_removes_the_files_of_workers_that_are_gone(tmp_path):
    from skyspot.trainer.stacks import _parent_of, _remove_stale

    stale, live = tmp_path / "pid-999999999.txt", tmp_path / f"pid-{os.getpid()}.txt"
    stale.write_text("")
    live.write_text("")
    _remove_stale(tmp_path)
    assert not stale.exists() and live.exists()
    assert _parent_of(os.getpid()) == os.getppid()  # whom a worker names its tracer: torchrun's parent
