"""Reads without bounds (issue 31, items 9 and 13): `status -a`, `cost-report RUN` and `cost-report RUN --plot`
on a run of 20,000 attempts (280,000 events in 40,000 files, as the local executor writes them) and on a
run beside a 1 GiB events file; `render tiny` with 20,000 overrides.

Each command is a fresh process, as a user types it; the figures are its wall time and its peak resident
memory (ru_maxrss of the child, read with os.wait4). Goal: each within 10 s and 500 MB (the issue's
Done-when). `--quick`: 2,000 attempts and 2,000 overrides, once each (under 20 s on an idle 2-core machine); the full run
20,000 of each. The runs are written by tests/bounds.py, the tests' own fixture.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Figure, Results

GOAL_S = 10.0
GOAL_MB = 500.0


def measure(args: list[str], env: dict[str, str], refusal_ok: bool = False) -> tuple[float, float]:
    """(wall seconds, peak MB) of one CLI process; `refusal_ok`: exit 2 (a one-line refusal) counts too."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "skyspot.cli.main", *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.monotonic() - start
    if proc.returncode != 0 and not (refusal_ok and proc.returncode == 2):
        raise RuntimeError(f"skyspot {' '.join(args[:3])} ... exited {proc.returncode}")
    return seconds, usage.ru_maxrss / 1024  # KiB on Linux


def run(results: Results, quick: bool) -> None:
    from tests.bounds import write_big_run, write_huge_events_file

    attempts = overrides = 2_000 if quick else 20_000
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        write_big_run(home, "big", attempts)
        write_huge_events_file(home, "huge")
        env = {
            **os.environ,
            "SKYSPOT_HOME": str(home),
            "NO_COLOR": "1",
            "COLUMNS": "200",
            "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        }
        plot = str(Path(tmp) / "plot.png")
        commands = {
            f"status -a ({attempts:,} attempts + 1 GiB file)": ["status", "-a"],
            f"cost-report RUN ({attempts:,} attempts)": ["cost-report", "big"],
            f"cost-report RUN --plot ({attempts:,} attempts)": ["cost-report", "big", "--plot", plot, "--force"],
            "cost-report RUN (1 GiB events file)": ["cost-report", "huge"],
            "cost-report RUN --plot (1 GiB events file)": ["cost-report", "huge", "--plot", plot, "--force"],
            f"render tiny ({overrides:,} overrides)": [
                "render",
                "tiny",
                "-o",
                str(Path(tmp) / "t.yaml"),
                "--force",
                *[f"deepspeed.extra.k{i}={i}" for i in range(overrides)],
            ],
        }
        for label, args in commands.items():
            if args[0] == "status":
                subprocess.run(
                    [sys.executable, "-m", "skyspot.cli.main", "status", "-a"], env=env, capture_output=True
                )  # its summary cache: the figure is a re-read of the events
                _drop_cache(home)
            # More attempts than --plot draws (app/report.py MAX_PLOT_ATTEMPTS) are refused in one line.
            seconds, mb = measure(args, env, refusal_ok="--plot" in args)
            results.add(
                Figure("bounds", f"{label}: time", "s", [seconds], goal=f"<= {GOAL_S:g} s", met=seconds <= GOAL_S)
            )
            results.add(
                Figure("bounds", f"{label}: peak memory", "MB", [mb], goal=f"<= {GOAL_MB:g} MB", met=mb <= GOAL_MB)
            )


def _drop_cache(home: Path) -> None:
    """Forget status's cached rows, so the figure is the events read again, not the ledger's cache."""
    import sqlite3

    db = sqlite3.connect(home / "ledger.db")
    db.execute("UPDATE runs SET info = json_remove(info, '$.summary', '$.summary_of')")
    db.commit()
    db.close()
