"""CLI latency: `skyspot --help`, `recipes`, `render llama70b`, `status` with 100 runs, against `sky --help`.

Each command runs as a fresh process, as a user types it; goal: each at most 0.3 s. `render` and
`recipes` repeat from skyspot's output cache (skyspot/cli/cache.py) once run; a render with an empty
cache (a new recipe, a changed checkout: the recipe models load and the wheel is built) is measured
too, with its own SKYSPOT_HOME each time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import Figure, Results, timed

GOAL_S = 0.3


def _seed_ledger(home: Path, runs: int) -> None:
    """100 finished local runs with a small event log each, as `status` would find them."""
    import json

    from skyspot.events import EventWriter
    from skyspot.ledger import Ledger

    os.environ["SKYSPOT_HOME"] = str(home)
    ledger = Ledger()
    for i in range(runs):
        name = f"bench-{i:03d}"
        run_dir = home / "runs" / name
        ledger.add(name, "tiny", "local", status="SUCCEEDED", run_dir=str(run_dir), total_steps=200, num_nodes=1)
        events = EventWriter(run_dir, name, 1, 0, None)
        events.emit(
            "attempt_start",
            where={
                "cloud": "aws",
                "region": "us-east-1",
                "instance_type": "g5.48xlarge",
                "spot": True,
                "num_nodes": 1,
                "simulated": True,
            },
        )
        trainer = EventWriter(run_dir, name, 1, 0, 0)
        for step in range(1, 201):
            trainer.emit("step", step=step, loss=1.0, step_seconds=0.1, samples=8, tokens=512)
        trainer.emit("exit", code=0, reason="complete", step=200)
        events.emit("attempt_end", code=0, reason="complete")
    ledger.close()
    os.environ.pop("SKYSPOT_HOME")
    del json


def run(results: Results, quick: bool) -> None:
    repeats = 3 if quick else 7
    bin_dir = Path(sys.executable).parent
    skyspot = [str(bin_dir / "skyspot")]
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        _seed_ledger(home, 100)
        env = {**os.environ, "SKYSPOT_HOME": str(home), "NO_COLOR": "1"}
        commands = {
            "skyspot --help": skyspot + ["--help"],
            "skyspot recipes": skyspot + ["recipes"],
            "skyspot render llama70b": skyspot + ["render", "llama70b"],
            "skyspot status (100 runs)": skyspot + ["status", "-a"],
        }
        sky_cmd = [str(bin_dir / "sky"), "--help"]
        sky_times = timed(lambda: subprocess.run(sky_cmd, env=env, capture_output=True, check=True), repeats)
        results.add(Figure("cli", "sky --help (reference)", "s", sky_times))
        for label, cmd in commands.items():
            subprocess.run(cmd, env=env, capture_output=True, check=True)  # warm the page cache
            values = timed(lambda: subprocess.run(cmd, env=env, capture_output=True, check=True), repeats)
            median = sorted(values)[len(values) // 2]
            ratio = median / sorted(sky_times)[len(sky_times) // 2]
            results.add(
                Figure(
                    "cli",
                    label,
                    "s",
                    values,
                    goal=f"<= {GOAL_S} s",
                    met=median <= GOAL_S,
                    note=f"{ratio:.2f}x sky --help",
                )
            )
        cold = []
        for i in range(repeats):
            fresh = {**env, "SKYSPOT_HOME": str(Path(tmp) / f"cold-{i}")}
            cold += timed(
                lambda: subprocess.run(skyspot + ["render", "llama70b"], env=fresh, capture_output=True, check=True), 1
            )
        results.add(
            Figure(
                "cli",
                "skyspot render llama70b, empty cache",
                "s",
                cold,
                note="loads the pydantic recipe models and builds the skyspot wheel the task mounts "
                "(hashes every package file, reads the installed versions to pin); no goal: "
                "a first render of a recipe",
            )
        )
