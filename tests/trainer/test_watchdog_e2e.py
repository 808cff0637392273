"""End to end: the supervisor's watchdog over a real training (the tiny recipe, DeepSpeed ZeRO-3 on 2 CPU
ranks under torchrun, gloo), one rank SIGSTOPped by the test after a few steps. The hang is detected
within its bound, every rank's stacks are on disk, the `hang` event says where each rank was, and the
ranks are killed. Without in-place restarts (torchrun here has none), the node then ends with an error;
a restart in place after the kill is the in-place restart's test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from skyspot.trainer.watchdog import HANG_JSON, find_workers
from tests.trainer.launch import REPO, events, torchrun_command, trainer_env

pytestmark = pytest.mark.slow

FLOOR_S = 3.0
OVERRIDES = ["train.steps=5000", "checkpoint.every_steps=1000", "train.log_every=1000"]


@pytest.fixture(scope="module")
def hung(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("watchdog") / "run"
    run_dir.mkdir()
    command = [
        sys.executable,
        "-m",
        "skyspot.trainer.supervise",
        "--run-dir",
        str(run_dir),
        "--hang-factor",
        "10",
        "--hang-floor",
        str(FLOOR_S),
        "--first-step-bound",
        "300",
        "--",
        *torchrun_command(run_dir, OVERRIDES),
    ]
    log = open(run_dir.parent / "log.txt", "wb")
    proc = subprocess.Popen(
        command, cwd=REPO, env=trainer_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while not [e for e in events(run_dir, "step") if e["step"] >= 5]:
            assert proc.poll() is None, (run_dir.parent / "log.txt").read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "no step 5 in time"
            time.sleep(0.1)
        torchrun = psutil.Process(proc.pid).children()[0]
        workers = find_workers(torchrun.pid)
        victim = next(w for w in workers if w.rank == 1)
        os.kill(victim.pid, signal.SIGSTOP)
        stopped_at = time.time()
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for w in locals().get("workers", []):
            try:
                w.process.kill()
            except psutil.Error:
                pass
    return {
        "run_dir": run_dir,
        "workers": workers,
        "stopped_at": stopped_at,
        "code": code,
        "log": (run_dir.parent / "log.txt").read_text(errors="replace"),
    }


def test_the_hang_is_detected_within_its_bound(hung):
    record = json.loads((hung["run_dir"] / HANG_JSON).read_text())
    assert record["bound_seconds"] >= FLOOR_S and record["first_step"] is False
    last_life = max(e["ts"] for e in events(hung["run_dir"]) if e["rank"] is not None and e["ts"] < record["ts"])
    assert record["ts"] - last_life >= record["bound_seconds"]  # never early
    # the bound, the watchdog's poll (1 s) and the dumps
    assert record["ts"] - hung["stopped_at"] <= record["bound_seconds"] + 3.0, record
    assert record["step"] >= 5


def test_every_ranks_stacks_are_on_disk_and_the_event_says_where_each_was(hung):
    record = json.loads((hung["run_dir"] / HANG_JSON).read_text())
    texts = {
        r: (hung["run_dir"] / "hangs" / os.path.basename(record["stacks"]) / f"rank-{r}.txt").read_text()
        for r in (0, 1)
    }
    for rank, text in texts.items():
        assert "skyspot/trainer/loop.py" in text and "train" in text, (rank, text)
    (hang,) = events(hung["run_dir"], "hang")
    assert hang["rank"] is None and hang["attempt"] == 1 and hang["stacks"] == record["stacks"]
    assert {(r["rank"], r["pid"]) for r in hang["ranks"]} == {(w.rank, w.pid) for w in hung["workers"]}
    assert all(r["top"] for r in hang["ranks"]), hang["ranks"]
    assert "hang: no step after step" in hung["log"]


def test_the_ranks_are_killed_and_the_node_ends_with_an_error(hung):
    assert hung["code"] != 0
    for worker in hung["workers"]:
        assert not psutil.pid_exists(worker.pid) or psutil.Process(worker.pid).status() == psutil.STATUS_ZOMBIE
    assert not [e for e in events(hung["run_dir"], "exit") if e["code"] == 0]
