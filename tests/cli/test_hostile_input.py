"""What a hostile or unlucky machine state does to the CLI (issue 23, items 5, 6, 13, 14, 15): a reused
PID, a planted link or file where output goes, escape sequences in a ledger row, a FIFO among the
events, `cp` of a file that is not a recipe, and local options a dry run must refuse like a launch.

Each test reproduces the item against the real CLI (Typer's runner, or a subprocess where a hang must
be bounded), with real processes, locks, FIFOs and sockets; nothing is mocked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from skyspot.events import EVENTS_DIR
from skyspot.executors.local import controller_lock
from skyspot.ledger import Ledger, skyspot_home
from tests.cli.test_status_cost_cli import _raw, invoke, make_run, one_line_error
from tests.conftest import REPO

# --------------------------------------------------------------------------- item 5: PID identity


@pytest.fixture
def stranger():
    """An unrelated live process: what a controller's PID may belong to after the system reuses it."""
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    proc.kill()
    proc.wait()


def running_row(name: str, pid: int) -> Path:
    run_dir = make_run(name, status="RUNNING")
    with Ledger() as ledger:
        ledger.set_controller(name, pid)
    return run_dir


def released_lock(run_dir: Path, pid: int) -> None:
    """What a controller that died leaves: its lock file, naming it, held by nobody."""
    fd = controller_lock.acquire(run_dir)
    controller_lock.record(fd, pid)
    os.close(fd)


@pytest.mark.parametrize("lock_file", ["none", "released"])
def test_cancel_never_signals_a_process_that_only_has_the_recorded_pid(stranger, lock_file):
    """The controller died without a word (OOM, reboot) and its PID now names a stranger: cancel ends at
    once with one clear line, marks the run, and the stranger lives. 'released': the dead controller's
    lock file is there, naming that PID with the stranger's own start time, but nobody holds the lock."""
    run_dir = running_row("r", stranger.pid)
    if lock_file == "released":
        released_lock(run_dir, stranger.pid)
    start = time.monotonic()
    result = invoke("cancel", "r", "-y")
    assert time.monotonic() - start < 5
    assert result.exit_code == 0, result.stderr
    assert f"run 'r' had no live controller; marked CANCELLED (pid {stranger.pid}" in result.stderr
    assert stranger.poll() is None  # not signalled
    with Ledger() as ledger:
        assert ledger.get("r").status == "CANCELLED"


HOLDER = textwrap.dedent("""
    import os, sys, time
    from skyspot.executors.local import controller_lock
    fd = controller_lock.acquire(sys.argv[1])
    controller_lock.record(fd, int(sys.argv[2]) if len(sys.argv) > 2 else os.getpid())
    print("held", flush=True)
    time.sleep(120)
""")


@contextmanager
def hold_lock(run_dir: Path, *named: int) -> Iterator[subprocess.Popen]:
    """A process that holds the run's controller lock, as a controller does (and dies on SIGTERM
    without updating the ledger, as a crashing one would); killed on leaving."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir), *map(str, named)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_cancel_signals_the_lock_holder_and_reconciles_a_controller_that_dies_silently():
    run_dir = running_row("r", 1)  # the PID in the row is stale; the lock names the live controller
    with hold_lock(run_dir) as holder:
        start = time.monotonic()
        result = invoke("cancel", "r", "-y")
        assert time.monotonic() - start < 10
        assert holder.wait(5) == -signal.SIGTERM
        assert result.exit_code == 0 and "its controller ended without recording it; marked CANCELLED" in result.stderr
        with Ledger() as ledger:
            assert ledger.get("r").status == "CANCELLED"


def test_a_lock_naming_another_process_than_its_holder_is_no_identity(stranger):
    """Held, but naming a PID whose process did not start when the named one did: nobody is signalled,
    and cancel says so in one line rather than guessing (the run is left as it was)."""
    run_dir = running_row("r", stranger.pid)
    with hold_lock(run_dir, stranger.pid) as holder:  # records the stranger's PID with the stranger's start time
        # Issue 31, item 13: named with its true start, the stranger was signalled; it holds no lock, so no more.
        assert controller_lock.state(run_dir) == (True, None)
        line = one_line_error(invoke("cancel", "r", "-y"))
        assert "is not the controller it names; nothing was signalled" in line and stranger.poll() is None
        data = json.loads((run_dir / controller_lock.LOCK_NAME).read_text())
        data["started"] -= 3600  # a process with this PID that started an hour earlier: not this one
        data["start_id"] = data["start_id"].rsplit(":", 1)[0] + ":1"  # (the kernel's figure says so too)
        (run_dir / controller_lock.LOCK_NAME).write_text(json.dumps(data))
        assert controller_lock.state(run_dir) == (True, None)
        line = one_line_error(invoke("cancel", "r", "-y"))
        assert "is not the controller it names; nothing was signalled" in line
        assert stranger.poll() is None and holder.poll() is None
        with Ledger() as ledger:
            assert ledger.get("r").status == "RUNNING"


def test_a_stepped_wall_clock_does_not_make_the_live_controller_a_stranger(stranger):
    """What failed in CI: the wall-clock start that psutil derives from the boot time moved by more than
    the tolerance during a long run (NTP, a resumed VM), and cancel refused the live controller. The
    kernel's own start (boot id and ticks) is what identifies it; a wall-clock figure 30 s off changes
    nothing, and the holder is signalled."""
    run_dir = running_row("r", 1)
    with hold_lock(run_dir) as holder:
        data = json.loads((run_dir / controller_lock.LOCK_NAME).read_text())
        assert data["start_id"] == controller_lock.start_id(holder.pid)
        data["started"] += 30  # the boot time as the kernel reports it stepped by 30 s
        (run_dir / controller_lock.LOCK_NAME).write_text(json.dumps(data))
        assert controller_lock.state(run_dir) == (True, holder.pid)
        result = invoke("cancel", "r", "-y")
        assert result.exit_code == 0, result.stderr
        assert holder.wait(5) == -signal.SIGTERM


def test_status_marks_a_run_whose_controller_died_silently(stranger):
    """Its lock file is there and nobody holds it: FAILED_CONTROLLER with the cause, as SkyPilot says of
    a managed job whose controller is gone; a live holder's run, and a run without a lock file, stay."""
    released_lock(running_row("dead", stranger.pid), stranger.pid)
    running_row("legacy", stranger.pid)  # launched before the lock existed: nothing to go by
    with hold_lock(running_row("live", 1)):
        result = invoke("status")
        rows = {r["name"]: r["status"] for r in json.loads(invoke("status", "--json").stdout)}
        assert rows == {"dead": "FAILED_CONTROLLER", "legacy": "RUNNING", "live": "RUNNING"}
        assert "dead FAILED_CONTROLLER: the local controller ended without recording" in result.stderr
        assert stranger.poll() is None


def test_resume_knows_a_live_controller_by_its_lock_not_its_pid(stranger):
    run_dir = running_row("r", stranger.pid)
    # A stranger with the PID: the run is not live, so resume goes on (to its missing spec, here).
    line = one_line_error(invoke("resume", "r"))
    assert "cannot be resumed: its spec" in line and stranger.poll() is None
    with hold_lock(run_dir):
        assert "is still RUNNING" in one_line_error(invoke("resume", "r"))


# --------------------------------------------------------------------------- item 6: output files


def test_plot_never_writes_through_a_link_and_never_over_a_file_without_force(tmp_path):
    make_run()
    tmp_path = tmp_path / "out"
    tmp_path.mkdir()
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    chart = tmp_path / "chart.png"
    chart.symlink_to(notes)
    line = one_line_error(invoke("cost-report", "run-1", "--plot", str(chart)))
    assert "already exists; nothing was overwritten" in line and "--force" in line
    assert notes.read_text() == "precious" and chart.is_symlink()
    forced = invoke("cost-report", "run-1", "--plot", str(chart), "--force")
    assert forced.exit_code == 0, forced.stderr
    assert notes.read_text() == "precious"  # the link itself was replaced, not what it pointed to
    assert not chart.is_symlink() and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {chart}" in forced.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chart.png", "notes.txt"]  # no temp file left


@pytest.mark.parametrize("name", ["notes.txt", "chart", "chart.PNG.bak", ".png"])
def test_a_plot_name_without_an_image_extension_is_one_line(tmp_path, name):
    make_run()
    tmp_path = tmp_path / "out"
    tmp_path.mkdir()
    line = one_line_error(invoke("cost-report", "run-1", "--plot", str(tmp_path / name)))
    assert "name a .png, .svg, .pdf file" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix, magic", [("png", b"\x89PNG"), ("svg", b"<?xml"), ("pdf", b"%PDF")])
def test_the_plot_message_names_the_file_it_wrote(tmp_path, suffix, magic):
    make_run()
    tmp_path = tmp_path / "out"
    tmp_path.mkdir()
    target = tmp_path / f"chart.{suffix}"
    result = invoke("cost-report", "run-1", "--plot", str(target))
    assert result.exit_code == 0 and f"wrote {target}\n" in result.stderr
    assert target.read_bytes().startswith(magic) and [p.name for p in tmp_path.iterdir()] == [target.name]


def test_render_output_is_written_like_the_plot(tmp_path):
    """One helper for every output file: render -o refuses an existing file and a link without --force."""
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    (tmp_path / "task.yaml").symlink_to(notes)
    assert "already exists" in one_line_error(invoke("render", "tiny", "-o", str(tmp_path / "task.yaml")))
    assert invoke("render", "tiny", "-o", str(tmp_path / "task.yaml"), "--force").exit_code == 0
    assert notes.read_text() == "precious" and not (tmp_path / "task.yaml").is_symlink()


def test_a_dangling_link_at_the_output_name_is_refused_too(tmp_path):
    (tmp_path / "task.yaml").symlink_to(tmp_path / "elsewhere.yaml")
    assert "already exists" in one_line_error(invoke("render", "tiny", "-o", str(tmp_path / "task.yaml")))
    assert not (tmp_path / "elsewhere.yaml").exists()


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _char_device(path: Path) -> Path:
    """A character device node of our own (the major/minor of /dev/null), never /dev/null itself."""
    if os.geteuid() != 0:
        pytest.skip("mknod of a device node needs root")
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return path


def _socket(path: Path) -> Path:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()  # the socket file stays at the name
    return path


@pytest.mark.parametrize("make, kind", [(_fifo, "FIFO"), (_char_device, "device"), (_socket, "socket")])
@pytest.mark.parametrize("command", [("render", "tiny", "-o"), ("cost-report", "run-1", "--plot")])
def test_force_replaces_only_a_regular_file_or_a_link(tmp_path, make, kind, command):
    """Issue 31 item 2: `--force` over a device node, a FIFO or a socket is one line and leaves it as it
    was (the old code renamed a plain file over it; as root that turned /dev/null into a file)."""
    make_run()
    tmp_path = tmp_path / "out"
    tmp_path.mkdir()
    target = make(tmp_path / ("chart.png" if command[0] == "cost-report" else "task.yaml"))
    before = os.lstat(target)
    line = one_line_error(invoke(*command, str(target), "--force"))
    assert f"is a {kind}, not a regular file; nothing was written" in line
    after = os.lstat(target)
    assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode) and after.st_ino == before.st_ino
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # no temp file left


# --------------------------------------------------------------------------- item 13: terminal escapes

ESCAPES = "\x1b]0;owned\x07\x1b[2J\x1b[H\x9b31m\r"


def test_no_escape_sequence_from_a_ledger_row_reaches_the_terminal():
    """A cause, a recipe and a run name holding a window-title, clear-screen and cursor sequence: every
    command that prints rows shows them escaped (`\\x1b`), on stdout and stderr alike."""
    make_run("run-1", status="FAILED", info={"cloud": "aws", "cause": f"boom{ESCAPES}"})
    _raw("UPDATE runs SET recipe = ? WHERE name = 'run-1'", f"tiny{ESCAPES}")
    make_run(f"odd{ESCAPES}", status="FAILED", info={"cause": ESCAPES})
    results = [
        invoke(*args)
        for args in (
            ["status"],
            ["status", "-a"],
            ["cost-report"],
            ["cost-report", "run-1"],
            ["cost-report", "--csv"],
            ["cost-report", "run-1", "--csv"],  # issue 31.13
            ["cancel", "--all", "-y"],
            ["logs", "run-1"],
            ["status", "--json"],
        )
    ]
    for result in results:
        text = result.stdout + result.stderr
        assert not any(c in text for c in "\x1b\x07\x9b\r"), repr(text)
    status = results[0].stderr
    assert "boom\\x1b]0;owned\\x07\\x1b[2J" in status
    assert "tiny\\x1b]0;owned\\x07" in results[4].stdout  # the CSV keeps the cell, escaped


# --------------------------------------------------------------------------- item 14: odd files in events/


def plant_odd_files(events: Path) -> list[socket.socket]:
    os.mkfifo(events / "attempt-5.node-0.rank-0.jsonl")
    (events / "attempt-6.node-0.rank-0.jsonl").symlink_to("/dev/zero")  # a device that reads without end
    (events / "attempt-7.node-0.rank-0.jsonl").mkdir()
    held = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(events)  # a relative name: the absolute one is longer than a socket address may be
    try:
        held.bind("attempt-8.executor.jsonl")
    finally:
        os.chdir(cwd)
    return [held]


@pytest.mark.parametrize(
    "args",
    [["status", "-a", "--json"], ["cost-report", "run-1", "--json"], ["cost-report", "--json"], ["status", "-a"]],
)
def test_a_fifo_socket_or_device_among_the_events_never_hangs_a_reader(tmp_path, args):
    """Run as a subprocess with a timeout: the bug this guards is a read that never returns."""
    run_dir = make_run()
    sockets = plant_odd_files(run_dir / EVENTS_DIR)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "skyspot.cli.main", *args], env=env, capture_output=True, text=True, timeout=30
        )
    finally:
        for s in sockets:
            s.close()
    assert time.monotonic() - start < 15
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    if args[-1] == "--json":
        rows = json.loads(done.stdout)
        assert rows[0].get("malformed_event_lines", 4) == 4  # each odd file is counted, none read


# --------------------------------------------------------------------------- item 15: cp, dry-run options


def test_cp_copies_only_recipes(tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$salt$hash:19000:0:99999:7:::\n")
    secret.chmod(0o600)
    line = one_line_error(invoke("cp", str(secret), str(tmp_path / "x.yaml")))
    assert "is not a recipe skyspot can load" in line and "copies recipes only" in line
    assert not (tmp_path / "x.yaml").exists()
    line = one_line_error(invoke("cp", "/etc/shadow", str(tmp_path / "y.yaml")))
    assert "copies recipes only" in line or "not found" in line
    assert not (tmp_path / "y.yaml").exists()


def test_cp_never_makes_a_copy_more_open_than_its_source(tmp_path):
    assert invoke("cp", "tiny", str(tmp_path / "mine.yaml")).exit_code == 0
    private = tmp_path / "mine.yaml"
    private.chmod(0o600)
    assert invoke("cp", str(private), str(tmp_path / "copy.yaml")).exit_code == 0
    assert stat.S_IMODE((tmp_path / "copy.yaml").stat().st_mode) == 0o600


@pytest.mark.parametrize("destination", ["", " "])
def test_cp_refuses_an_empty_destination(tmp_path, monkeypatch, destination):
    tmp_path = tmp_path / "cwd"
    tmp_path.mkdir()
    monkeypatch.chdir(tmp_path)
    assert "DEST is empty" in one_line_error(invoke("cp", "tiny", destination))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "options, message",
    [
        (["--preempt-at-steps", "abc"], "--preempt-at-steps 'abc' must be comma-separated step numbers"),
        (["--spot-nodes", "0"], "--spot-nodes takes node counts >= 1"),
        (["--simulate", "bogus"], "--simulate 'bogus' is not one of aws, gcp, azure"),
        (["--spot-trace", "/nonexistent"], "cannot read spot trace '/nonexistent'"),
        (["--fallback-after", "-3"], "--fallback-after"),
        (["--preempt-every", "0"], "--preempt-every takes seconds > 0, at most"),
        (["--preempt-every", "5", "--preempt-at-steps", "3"], "use one of --preempt-every, --preempt-at-steps"),
        (["--spot-nodes", "2"], "above resources.num_nodes"),
        # Found by the bounded property test: the deadline's plan line came before this error (two lines).
        (["--fallback-after", "1", "--deadline", "1h"], "--fallback-after and a deadline both decide"),
        # Issue 31, item 10: an infinite wait killed the controller at its first recovery (OverflowError).
        *[
            ([flag, value], f"{flag} takes seconds from 0 to 604800 (a week)")
            for flag in ("--provision-delay", "--notice", "--grace")
            for value in ("inf", "1e308")
        ],
        (["--preempt-every", "1e308"], "--preempt-every takes seconds > 0, at most 604800 (a week)"),
    ],
)
def test_a_dry_run_refuses_the_local_options_a_launch_refuses(options, message):
    dry = one_line_error(invoke("launch", "tiny", "--dry-run", *options))
    real = one_line_error(invoke("launch", "tiny", "-d", *options))
    assert message in dry and dry == real
    with Ledger() as ledger:
        assert ledger.runs() == []  # the real launch refused before recording anything
    assert not (skyspot_home() / "runs").exists() or list((skyspot_home() / "runs").iterdir()) == []


@pytest.mark.parametrize("grace", ["inf", "nan", "1e308", "-1"])
def test_the_supervisor_refuses_a_grace_that_never_ends(grace, tmp_path):
    """With --grace inf a trainer that ignores SIGTERM was never killed: argparse's one line, exit 2."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "skyspot.trainer.supervise", "--run-dir", str(tmp_path), "--grace", grace, "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "argument --grace: invalid number of seconds (0 to 86400) value" in done.stderr


def test_a_file_that_is_not_a_recipe_is_refused_without_echoing_its_lines(tmp_path):
    """`skyspot render /etc/shadow` printed each line's password-hash field as an unknown key (issue 31.13)."""
    shadow = tmp_path / "shadow"
    shadow.write_text("root:$6$CANARYhash:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n")
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("name: x\nroot:$6$CANARYhash:1:\n")
    for args in (["render", shadow], ["launch", shadow, "--dry-run"], ["keys", shadow], ["render", mixed]):
        line = one_line_error(invoke(*map(str, args)))
        assert "CANARY" not in line and "$6$" not in line, line
    assert "not a recipe: none of its 2 top-level key(s) is a recipe section" in one_line_error(
        invoke("render", str(shadow))
    )
    assert "a key (line 2): unknown key" in one_line_error(invoke("render", str(mixed)))


def test_a_step_time_hint_below_the_physical_floor_is_refused_as_the_missing_hint_is():
    """Issue 31, item 12: `--deadline 2h resources.step_seconds_hint=0.001` passed the check a missing hint fails."""
    args = ["launch", "llama70b", "--dry-run", "--deadline", "2h", "--store", "s3://my-bucket/runs"]
    line = one_line_error(invoke(*args, "resources.step_seconds_hint=0.001"))
    assert "resources.step_seconds_hint 0.001s is below the fastest a step of this recipe can be (14s" in line
    assert "even all on-demand cannot make the deadline" in one_line_error(invoke(*args))  # as without a hint
    assert invoke("launch", "tiny", "--dry-run", "--deadline", "2h", "resources.step_seconds_hint=0.5").exit_code == 0


def test_render_refuses_a_cloud_task_with_a_store_on_this_machine_as_launch_does():
    """Issue 31, item 13: `render llama8b storage.store=./rel` emitted a cloud task that launch refuses."""
    rendered = one_line_error(invoke("render", "llama8b", "storage.store=./rel"))
    launched = one_line_error(invoke("launch", "llama8b", "-y", "-d", "--store", "./rel"))
    assert "is a directory on this machine; a cloud run's checkpoints must outlive its VMs" in rendered
    assert rendered.split(": ", 1)[1] == launched.split(": ", 1)[1]


def test_a_huge_events_file_is_skipped_and_counted_not_read_whole():
    """Issue 31, item 9: a 1 GB events file made `cost-report` die with a MemoryError traceback. A sparse file
    of 1 GiB stands for it (no disk spent): status and the report answer, and say a file was skipped."""
    import resource

    run_dir = make_run("big")
    huge = run_dir / "events" / "attempt-9.node-0.rank-0.jsonl"
    with open(huge, "wb") as f:
        f.truncate(1 << 30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for args in (["status", "-a"], ["cost-report", "big"], ["cost-report", "big", "--json"]):
        result = invoke(*args)
        assert result.exit_code == 0 and "Traceback" not in result.stdout + result.stderr
    assert "skipped 1 malformed event line(s)" in invoke("status", "-a").stderr
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 300 * 1024  # KiB: never read whole
