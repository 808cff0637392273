"""Issue 31, item 9, through the real CLI: a run of 20,000 attempts and a 1 GiB events file. `status -a`,
`cost-report RUN` and `cost-report RUN --plot` answer with the right totals, and the huge file is skipped
unread with one line naming it. How long each takes and how much memory it holds is a benchmark's
figure (bench/bounds.py, docs/benchmarks.md), not a test's: here only a generous timeout stops a hang.
The 20,000-attempt tests run with `-m slow` (each command reads 280,000 events); the 1 GiB file's by default."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.bounds import STEPS_PER_ATTEMPT, write_big_run, write_huge_events_file
from tests.conftest import REPO

ATTEMPTS = 20_000


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One SKYSPOT_HOME for the module, with the huge file's run (sparse: no time to write)."""
    home = tmp_path_factory.mktemp("bounds") / "home"
    write_huge_events_file(home, "huge")
    return home


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A home of its own with the big run (40,000 files, a few seconds to write) beside the huge file's run:
    only the slow tests read it, so `home` stays as its docstring says whatever the order."""
    big = tmp_path_factory.mktemp("bounds-big") / "home"
    write_big_run(big, "big", ATTEMPTS)
    write_huge_events_file(big, "huge")
    return big


def cli(home, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "SKYSPOT_HOME": str(home), "PYTHONPATH": str(REPO), "NO_COLOR": "1", "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "skyspot.cli.main", *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.mark.slow  # 10-60 s each on a loaded 2-core machine: with `-m slow`
def test_status_lists_twenty_thousand_attempts_and_names_the_skipped_file(big):
    done = cli(big, "status", "-a", "--json")
    rows = {r["name"]: r for r in json.loads(done.stdout)}
    assert rows["big"]["recoveries"] == ATTEMPTS - 1 and rows["big"]["step"] == STEPS_PER_ATTEMPT * ATTEMPTS
    assert rows["big"]["malformed_event_lines"] == 0 and rows["big"]["interruptions"] == {
        "spot-preemption": ATTEMPTS - 1
    }
    assert rows["huge"]["oversized_event_files"] == ["attempt-9.node-0.rank-0.jsonl"]
    notes = [line for line in done.stderr.splitlines() if "over 128 MiB" in line]
    assert notes == [
        "huge: skipped 1 events file(s) over 128 MiB unread (one process's events are far smaller): "
        "attempt-9.node-0.rank-0.jsonl"
    ]


@pytest.mark.slow  # 10-60 s each on a loaded 2-core machine: with `-m slow`
def test_cost_report_of_twenty_thousand_attempts_adds_up(big):
    data = json.loads(cli(big, "cost-report", "big", "--json").stdout)[0]
    assert len(data["attempts"]) == ATTEMPTS and len(data["recovery_details"]) == ATTEMPTS - 1
    assert data["preemptions"] == ATTEMPTS - 1 and data["lost_steps"] == 0
    assert data["useful_steps"] == STEPS_PER_ATTEMPT * ATTEMPTS
    # Each attempt: billed 70 s (72 s the last), 50 s of steps, 1 s checkpoint stall; the lines add up.
    assert data["billed_seconds"] == pytest.approx(70.0 * (ATTEMPTS - 1) + 72.0)
    assert sum(data["goodput_breakdown"].values()) == pytest.approx(data["billed_seconds"])
    assert data["goodput_breakdown"]["checkpoint_stalls"] == pytest.approx(float(ATTEMPTS))
    text = cli(big, "cost-report", "big").stdout
    assert f"interrupted by: {ATTEMPTS - 1} spot preemptions" in text


def refused(home, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "SKYSPOT_HOME": str(home), "PYTHONPATH": str(REPO), "NO_COLOR": "1", "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "skyspot.cli.main", *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return done


def test_the_plot_of_more_attempts_than_it_can_draw_is_refused_in_one_line_before_a_line_is_read(tmp_path):
    """Past MAX_PLOT_ATTEMPTS (20,000 took 9-10.5 s to read and draw, issue 31's bound is 10 s), `--plot`
    refuses at once, counting attempts from the events files' names: here empty files, so a reader that read
    them would find nothing to refuse. At the bound itself the plot is drawn."""
    from skyspot.app.report import MAX_PLOT_ATTEMPTS

    home = tmp_path / "home"
    run_dir = write_big_run(home, "long", 2)
    for k in range(2, MAX_PLOT_ATTEMPTS):  # attempts 0 and 1 are the written run's
        (run_dir / "events" / f"attempt-{k}.executor.jsonl").touch()
    plot = tmp_path / "long.png"
    drawn = cli(home, "cost-report", "long", "--plot", str(plot))  # MAX_PLOT_ATTEMPTS attempts: drawn
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {plot}" in drawn.stderr
    (run_dir / "events" / f"attempt-{MAX_PLOT_ATTEMPTS}.node-0.rank-0.jsonl").touch()
    before = plot.read_bytes()
    done = refused(home, "cost-report", "long", "--plot", str(plot), "--force")
    assert done.stderr.strip().splitlines() == [
        f"error: run 'long' has {MAX_PLOT_ATTEMPTS + 1:,} attempts; --plot draws at most {MAX_PLOT_ATTEMPTS:,} "
        "(more would each be narrower than a pixel): `skyspot cost-report long --json` has every one"
    ]
    assert plot.read_bytes() == before  # nothing already saved is overwritten


@pytest.mark.slow  # 10-60 s each on a loaded 2-core machine: with `-m slow`
def test_the_plot_of_twenty_thousand_attempts_is_refused_in_one_line(big, tmp_path):
    done = refused(big, "cost-report", "big", "--plot", str(tmp_path / "big.png"))
    assert "has 20,000 attempts; --plot draws at most" in done.stderr and len(done.stderr.splitlines()) == 1
    assert not (tmp_path / "big.png").exists()


@pytest.mark.parametrize("args", [["cost-report", "huge"], ["cost-report", "huge", "--plot", "PLOT"]])
def test_a_one_gib_events_file_is_one_line_and_the_rest_reported(home, tmp_path, args):
    done = cli(home, *[str(tmp_path / "h.png") if a == "PLOT" else a for a in args])
    notes = [line for line in done.stderr.splitlines() if "events file" in line]
    assert notes == [
        "note: skipped 1 events file(s) over 128 MiB unread (one process's events are far smaller): "
        "attempt-9.node-0.rank-0.jsonl"
    ]
    assert "goodput" in done.stdout  # the run's own events are still reported


def test_a_long_attempt_table_prints_its_ends_and_a_line_for_the_rest(tmp_path):
    """Past TABLE_ROWS attempts the human table shows the first and last 25 and says how many it left out;
    --json still carries every attempt (20,000 printed rows were seconds of layout, issue 31)."""
    home = tmp_path / "home"
    write_big_run(home, "mid", 60)
    text = cli(home, "cost-report", "mid").stdout
    assert "… 10 more attempts between these (the first and last 25 shown); --json or --csv for all" in text
    assert "… 9 more recoveries between these (the first and last 25 shown); --json or --csv for all" in text
    assert "interrupted by: 59 spot preemptions" in text
    data = json.loads(cli(home, "cost-report", "mid", "--json").stdout)[0]
    assert len(data["attempts"]) == 60 and len(data["recovery_details"]) == 59
