"""Benchmark: a hung rank, found and killed by the watchdog, against the collective timeout that would
otherwise end it.

Both run the real entry, as a node does (`supervise -- torchrun --nproc_per_node 2 -m skyspot.trainer
tiny`, ZeRO-3 on 2 CPU ranks over gloo); after step 5 the benchmark SIGSTOPs rank 1, the hang the
local executor's `--hang-at-steps` injects. Rank 0 then waits in its next collective.

- **watchdog**: `--hang-floor F` (the recipe's `resilience.hang_floor_seconds`; a `tiny` step is far
  below F / 10, so the floor is the bound): SIGSTOP -> the watchdog's kill (hang.json's `ts`), and that
  time less the bound (the watchdog's own cost: its 1 s poll and the py-spy dumps).
- **collective timeout**: `--no-watchdog`, `SKYSPOT_DIST_TIMEOUT_SECONDS=T`: SIGSTOP -> the node's exit,
  and whether gloo's timeout fired at all (its "Timed out" in the log). When it fires, rank 0 fails,
  and torchrun stops the other workers with SIGTERM, which a stopped rank cannot act on, then SIGKILL
  30 s later (torch's LocalElasticAgent._shutdown default on a worker failure; the supervisor's
  --grace, TORCH_ELASTIC_SHUTDOWN_TIMEOUT, applies only to signals torchrun receives).

Times are scaled down from a cloud's: the floor F = 10 s for the default 300 s, the timeout T = 20 s
for the task's 600 s (task/render.py DIST_ENV), halved again with --quick (F = 5 s, T = 10 s); torchrun's
30 s is what it is. The ratio (collective timeout path / watchdog) is from the one run; the note projects
both to the cloud's values, from what each path spent beyond its own bound, so full and quick runs
project alike.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench import _launch
from bench._launch import bench_env, ensure_shm_op, kill_group, torchrun, wait_for_event
from bench.common import Figure, Results

OVERRIDES = ["train.steps=100000", "checkpoint.every_steps=100000", "train.log_every=100000"]
FLOOR_S, TIMEOUT_S = 10.0, 20.0
QUICK_FLOOR_S, QUICK_TIMEOUT_S = 5.0, 10.0
TORCHRUN_STOP_S = 30.0  # LocalElasticAgent._shutdown(timeout=30): SIGTERM, then SIGKILL, on a worker failure
CLOUD = {"floor": 300.0, "timeout": 600.0}
START_TIMEOUT_S = 300


def _hang(run_dir: Path, log: Path, supervise_flags: list[str], wait_s: float, **env: str) -> dict:
    """Start a node, SIGSTOP rank 1 after step 5; seconds from the stop to the kill (hang.json) and to
    the node's exit (None when it had not exited within `wait_s`)."""
    command = [
        sys.executable,
        "-m",
        "skyspot.trainer.supervise",
        "--run-dir",
        str(run_dir),
        *supervise_flags,
        "--",
        *torchrun("skyspot.trainer", ["tiny", "--run-dir", str(run_dir), *OVERRIDES]),
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            command,
            cwd=_launch.REPO,
            env=bench_env(**env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for_event(run_dir, proc, lambda e: e.get("type") == "step" and e.get("step", 0) >= 5, START_TIMEOUT_S)
            launcher = psutil.Process(proc.pid).children()[0]
            (victim,) = [p for p in launcher.children() if p.environ().get("RANK") == "1"]
            victim.suspend()  # SIGSTOP
            stopped = time.time()
            try:
                proc.wait(wait_s)
                ended = time.time() - stopped
            except subprocess.TimeoutExpired:
                ended = None
        finally:
            kill_group(proc)
    hang = run_dir / "hang.json"
    record = json.loads(hang.read_text()) if hang.exists() else None
    return {
        "killed": record["ts"] - stopped if record else None,
        "ended": ended,
        "record": record,
        "code": proc.returncode,
    }


def run(results: Results, quick: bool) -> None:
    ensure_shm_op(results)
    floor, timeout = (QUICK_FLOOR_S, QUICK_TIMEOUT_S) if quick else (FLOOR_S, TIMEOUT_S)
    with tempfile.TemporaryDirectory(prefix="skyspot-bench-hang-") as tmp:
        log = Path(tempfile.gettempdir()) / "skyspot-bench-hang.log"
        log.write_bytes(b"")
        dog = _hang(Path(tmp) / "watchdog", log, ["--hang-floor", str(floor), "--hang-factor", "10"], wait_s=120)
        mark = len(log.read_bytes())
        timeout_wait = timeout + TORCHRUN_STOP_S + 120
        plain = _hang(
            Path(tmp) / "timeout",
            log,
            ["--no-watchdog"],
            wait_s=timeout_wait,
            SKYSPOT_DIST_TIMEOUT_SECONDS=str(timeout),
        )
        tail = log.read_bytes()[mark:].decode(errors="replace")
    if dog["record"] is None:
        raise RuntimeError("the watchdog declared no hang")
    bound = dog["record"]["bound_seconds"]
    fired = "Timed out" in tail or "timed out" in tail.lower()
    print(
        f"   hang: watchdog kill {dog['killed']:.1f}s (bound {bound:.0f}s), node exit "
        f"{dog['ended'] if dog['ended'] is None else round(dog['ended'], 1)}s; collective timeout path: "
        f"{plain['ended'] if plain['ended'] is None else round(plain['ended'], 1)}s, fired: {fired}",
        file=sys.stderr,
        flush=True,
    )
    results.add(
        Figure(
            "hang",
            f"SIGSTOP of a rank -> killed by the watchdog (floor {floor:.0f} s)",
            "s",
            [dog["killed"]],
            goal="<= bound + 3 s",
            met=dog["killed"] <= bound + 3,
            note=f"bound {bound:.0f} s; the node exits {dog['ended']:.1f} s after the stop "
            "(torchrun here has no in-place restarts)"
            if dog["ended"] is not None
            else f"bound {bound:.0f} s; the node had not exited",
        )
    )
    results.add(Figure("hang", "watchdog's own cost: kill - bound (poll, py-spy dumps)", "s", [dog["killed"] - bound]))
    if plain["ended"] is None:
        results.add(
            Figure(
                "hang",
                f"SIGSTOP -> node exit, no watchdog, collective timeout {timeout:.0f} s",
                "s",
                [timeout_wait],
                note=f"still hung after {timeout_wait:.0f} s (gloo's timeout "
                f"{'fired' if fired else 'did not fire'}); killed by the benchmark",
            )
        )
        return
    extra = plain["ended"] - timeout - TORCHRUN_STOP_S
    cloud_plain = CLOUD["timeout"] + TORCHRUN_STOP_S + extra
    cloud_dog = CLOUD["floor"] + dog["killed"] - bound
    results.add(
        Figure(
            "hang",
            f"SIGSTOP -> node exit, no watchdog: gloo timeout {timeout:.0f} s",
            "s",
            [plain["ended"]],
            note=(
                f"gloo's timeout {'fired' if fired else 'did not fire'} (exit {plain['code']}); then "
                f"torchrun's SIGTERM, which the stopped rank cannot act on, and its SIGKILL "
                f"{TORCHRUN_STOP_S:.0f} s later; {extra:+.1f} s beyond those two; no stacks"
            ),
        )
    )
    results.add(
        Figure(
            "hang",
            "collective timeout path / watchdog (same run)",
            "x",
            [plain["ended"] / dog["killed"]],
            note=(
                f"at the task's {CLOUD['timeout']:.0f} s timeout and the watchdog's default "
                f"{CLOUD['floor']:.0f} s floor: {cloud_plain:.0f} s against {cloud_dog:.0f} s, "
                f"{cloud_plain / cloud_dog:.1f}x"
            ),
        )
    )
