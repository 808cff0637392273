"""Benchmark 4: lost work under preemption, skyspot against the baseline blueprints ship.

Both run `tiny` on the local executor replaying the same spot trace (a notice every P seconds
after launch, SIGTERM N seconds after each notice, then recovery):

- skyspot: `skyspot launch tiny --local --spot-trace T --notice N ...`, every feature on;
- baseline: the same launch (bench/_local_launch.py) with bench/_baseline_trainer.py on the
  nodes: skyspot's trainer with no signal handlers and no notice watcher, which is what a
  blueprint with interval checkpoints only does: it trains on until SIGTERM kills it.

Both checkpoint every 50 steps, so the only difference is the emergency path. From rank 0's
events, per attempt: the steps it executed and the step the next attempt resumed from.
Lost steps at a preemption = the attempt's last executed step - the next attempt's resume step.
Goals (skyspot): at most the one in-flight step lost per preemption, and steps needed / steps
executed >= 0.99 (the issue writes the ratio the other way up; executed >= needed always, so the
goal only makes sense as the useful fraction).

The trace and the run length come from `_plan`. Wall-clock to finish is reported too: skyspot
stops at the notice, the baseline trains on until SIGTERM.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import _launch
from bench._launch import BIN, bench_env, ensure_shm_op, events
from bench.common import Figure, Results

GOAL_FRACTION = 0.99
GOAL_LOST = 1
EVERY_STEPS = 50


def _plan(quick: bool) -> dict:
    """The trace and the run length for this machine (bench._launch.CALIBRATION).

    Full: notices 60 s and 120 s after launch, SIGTERM 30 s after each. --quick: one notice,
    15 s of training after the first start (a quick start here takes that much longer), 10 s to
    SIGTERM. The run is long enough that skyspot trains some seconds into the attempt after the
    last notice, and the baseline, which trains through the notice window, is still running at
    the first SIGTERM.
    """
    startup = _launch.CALIBRATION["startup_s"]
    step = _launch.CALIBRATION["step_s"]
    provision = 2.0
    if quick:
        notices, notice, tail = 1, 10.0, 5.0
        period = round(startup + 15.0)
    else:
        notices, notice, tail = 2, 30.0, 25.0
        period = 60.0
    ours = max(0.0, period - startup) + (notices - 1) * max(0.0, period - provision - startup) + tail
    baseline = max(0.0, period + notice - startup) + (5.0 if quick else 10.0)
    # The first steps of a start, which calibrated `step`, are slower than the steady ones.
    steps = max(2 * EVERY_STEPS, int(max(ours, baseline) / (0.8 * step)))
    return {"period": period, "notice": notice, "steps": steps, "provision": provision,
            "trace": [period * (i + 1) for i in range(notices)], "timeout": 420.0 if quick else 900.0}


def _launch_run(variant: str, home: Path, plan: dict, trace: Path, log: Path) -> tuple[int, float]:
    name = f"bench-{variant}"
    overrides = [f"train.steps={plan['steps']}", f"checkpoint.every_steps={EVERY_STEPS}", "train.log_every=100"]
    flags = ["--spot-trace", str(trace), "--notice", str(plan["notice"]), "--provision-delay", str(plan["provision"]),
             "-n", name]
    if variant == "skyspot":
        command = [str(BIN / "skyspot"), "launch", "tiny", "--local", *flags, *overrides]
    else:
        command = [sys.executable, "-m", "bench._local_launch", "--trainer-module", "bench._baseline_trainer",
                   *flags, "tiny", *overrides]
    env = bench_env(SKYSPOT_HOME=str(home))
    start = time.time()
    with open(log, "ab") as out:
        try:
            code = subprocess.run(command, cwd=_launch.REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=plan["timeout"]).returncode
        except subprocess.TimeoutExpired:
            subprocess.run([str(BIN / "skyspot"), "cancel", name, "-y"], env=env, stdout=out,
                           stderr=subprocess.STDOUT, timeout=400)
            raise RuntimeError(f"{variant}: the run did not finish within {plan['timeout']:.0f} s")
    return code, time.time() - start


def analyse(run_dir: Path, total: int) -> dict:
    """Per trainer attempt: executed steps and resume step; lost steps at each preemption."""
    by_attempt: dict[int, dict] = {}
    for e in events(run_dir, rank=0):
        a = by_attempt.setdefault(e.get("attempt", 0), {"steps": [], "resume": 0})
        if e["type"] == "step":
            a["steps"].append(e["step"])
        elif e["type"] == "resume":
            a["resume"] = e["step"]
    controller = [e for e in events(run_dir, "attempt_end", rank=None) if e.get("rank") is None]
    preempted = sum(1 for e in controller if e.get("reason") == "preempted")
    order = sorted(by_attempt)
    lost = []
    for a, b in zip(order, order[1:]):
        reached = max(by_attempt[a]["steps"], default=by_attempt[a]["resume"])
        lost.append(reached - by_attempt[b]["resume"])
    executed = sum(len(by_attempt[a]["steps"]) for a in order)
    return {"attempts": len(order), "preemptions": preempted, "lost": lost, "executed": executed,
            "fraction": total / executed if executed else 0.0}


def run(results: Results, quick: bool) -> None:
    ensure_shm_op(results)
    plan = _plan(quick)
    print(f"   lost_work: {plan['steps']} steps, notices at {plan['trace']} s, SIGTERM {plan['notice']:.0f} s later",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="skyspot-bench-lost-") as tmp:
        trace = Path(tmp) / "trace.yaml"
        trace.write_text(json.dumps({"preemptions": plan["trace"]}) + "\n")  # JSON is YAML
        found = {}
        for variant in ("skyspot", "baseline"):
            home = Path(tmp) / variant
            log = Path(tempfile.gettempdir()) / f"skyspot-bench-lost-{variant}.log"
            log.write_bytes(b"")
            code, wall = _launch_run(variant, home, plan, trace, log)
            if code != 0:
                text = log.read_text(errors="replace")
                if variant == "baseline" and "baseline not available" in text:
                    results.notes.append("lost_work: baseline not available (see bench/_baseline_trainer.py)")
                    continue
                raise RuntimeError(f"{variant} run exited {code}; see {log}")
            found[variant] = {**analyse(home / "runs" / f"bench-{variant}", plan["steps"]), "wall": wall}
            f = found[variant]
            print(f"   lost_work {variant}: {wall:.0f}s, {f['preemptions']} preemptions, lost {f['lost']}, "
                  f"{f['executed']} steps executed", file=sys.stderr, flush=True)

    setting = (f"tiny, {plan['steps']} steps, notices at {', '.join(f'{t:.0f}' for t in plan['trace'])} s, "
               f"SIGTERM {plan['notice']:.0f} s later")
    ours = found["skyspot"]
    base = found.get("baseline")
    lost = ours["lost"] or [0]
    results.add(Figure("lost_work", f"steps needed / executed, skyspot ({setting})", "x", [ours["fraction"]],
                       goal=f">= {GOAL_FRACTION}", met=ours["fraction"] >= GOAL_FRACTION,
                       note=f"{ours['executed']} executed, {ours['preemptions']} preemptions, "
                            f"{ours['wall']:.0f} s to finish"))
    results.add(Figure("lost_work", "lost steps per preemption, skyspot", "steps", lost,
                       goal=f"<= {GOAL_LOST}", met=max(lost) <= GOAL_LOST,
                       note="" if ours["lost"] else "no preemption hit the run: it finished first"))
    if base is not None:
        results.add(Figure("lost_work", "steps needed / executed, baseline (every 50 steps, no signal handling)",
                           "x", [base["fraction"]],
                           note=f"{base['executed']} executed, {base['preemptions']} preemptions, "
                                f"{base['wall']:.0f} s to finish"))
        results.add(Figure("lost_work", "lost steps per preemption, baseline", "steps", base["lost"] or [0],
                           note="" if base["lost"] else "no preemption hit the run: it finished first"))
        slower = ours["wall"] > base["wall"]
        results.add(Figure("lost_work", "wall-clock to finish, skyspot / baseline", "x", [ours["wall"] / base["wall"]],
                           note=f"{ours['wall']:.0f} s against {base['wall']:.0f} s" + (
                               f": skyspot checkpoints and exits at the notice, the baseline trains on through the "
                               f"{plan['notice']:.0f} s until SIGTERM" if slower else "")))
