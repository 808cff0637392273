"""A disk that fills up while a checkpoint is written: the write is abandoned, nothing earlier is lost.

The run directory is a tmpfs mount a little larger than two of tiny's checkpoints, so the first two
interval checkpoints commit and the third runs out of space (ENOSPC) part-way through its files.
That needs root (`mount -t tmpfs`); without it the tmpfs tests skip, and the injected-ENOSPC test
(SKYSPOT_FAULT=<point>:enospc) covers the write path.

    start 1   on the small disk: steps 2 and 4 commit, step 6 hits ENOSPC, then the run stops
    start 2   after the disk is grown (remount): resumes from step 4, skipping the cut write, and
              finishes bitwise equal to the uninterrupted reference
"""

from __future__ import annotations

import json
import subprocess

import pytest

from skyspot.events import read_events_dir
from skyspot.trainer import manifest as mf
from tests.reliability.conftest import STEPS, same_params
from tests.trainer.launch import finish, log_text, start

pytestmark = pytest.mark.slow

OVERRIDES = [f"train.steps={STEPS}", "checkpoint.every_steps=2", "train.log_every=4", "checkpoint.keep=3"]
ENOSPC = "No space left on device"


def _mount(path, size_bytes: int) -> bool:
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(path)], capture_output=True
    )
    return done.returncode == 0


def _can_mount(tmp_path_factory) -> bool:
    probe = tmp_path_factory.mktemp("mount-probe")
    if not _mount(probe, 1 << 20):
        return False
    subprocess.run(["umount", str(probe)], capture_output=True)
    return True


@pytest.fixture(scope="module")
def full_disk(reference, tmp_path_factory):
    """Start 1 on a disk with room for two checkpoints. Everything a test needs is read before unmounting."""
    checkpoint_bytes = max(e["bytes"] for e in read_events_dir(reference / "events").of_type("checkpoint_end"))
    run_dir = tmp_path_factory.mktemp("disk-full") / "run"
    run_dir.mkdir()
    if not _mount(run_dir, int(2.5 * checkpoint_bytes) + (256 << 10)):
        pytest.skip("needs a size-limited filesystem: `mount -t tmpfs` as root")
    try:
        code = finish(start(run_dir, OVERRIDES, log_name="start1"))
        first = {
            "code": code,
            "log": log_text(run_dir, "start1"),
            "events": read_events_dir(run_dir / "events").events,
            "verdicts": {v.step: v for v in mf.scan(run_dir / "checkpoints")},
            "exit": json.loads((run_dir / "exit.json").read_text()) if (run_dir / "exit.json").exists() else None,
        }
        yield run_dir, first
    finally:
        subprocess.run(["umount", "-l", str(run_dir)], capture_output=True)


def test_checkpoints_written_before_the_disk_filled_survive_and_the_run_resumes_bitwise(full_disk, reference):
    run_dir, first = full_disk
    assert first["code"] == 1, first["log"][-3000:]  # documented: 1, an I/O error
    committed = sorted(e["step"] for e in first["events"] if e["type"] == "checkpoint_end")
    failed = sorted(e["step"] for e in first["events"] if e["type"] == "checkpoint_failed")
    assert committed[:2] == [2, 4] and failed and failed[0] == 6, (committed, failed)
    # The cut write is not a checkpoint (no marker), nothing is corrupt, the earlier ones verify.
    assert all(v.state != "corrupt" for v in first["verdicts"].values()), first["verdicts"]
    assert all(first["verdicts"][s].state != "valid" for s in failed if s in first["verdicts"])
    assert all(not (run_dir / "checkpoints" / f"step_{s}" / mf.MARKER).exists() for s in failed)
    assert sorted(s for s, v in first["verdicts"].items() if v.state == "valid") == committed

    # Room again: the next start resumes from the newest checkpoint that committed, and ends bitwise equal.
    grown = subprocess.run(["mount", "-o", "remount,size=64m", str(run_dir)], capture_output=True, text=True)
    assert grown.returncode == 0, grown.stderr
    code = finish(start(run_dir, OVERRIDES, log_name="start2"))
    assert code == 0, log_text(run_dir, "start2")[-3000:]
    attempt = max(e["attempt"] for e in first["events"] if e.get("rank") is not None) + 1
    resume = [e for e in read_events_dir(run_dir / "events").of_type("resume") if e["attempt"] == attempt]
    assert [e["step"] for e in resume] == [committed[-1]]
    assert not same_params(run_dir, reference)


def test_full_disk_abandons_each_write_and_stops_with_one_line_and_exit_1(full_disk):
    run_dir, first = full_disk
    failures = [e for e in first["events"] if e["type"] == "checkpoint_failed"]
    assert failures and all(ENOSPC in e["error"] for e in failures), failures
    # Abandoned cleanly: no directory of a failed write is left holding the space.
    assert all(v.state == "valid" for v in first["verdicts"].values()), first["verdicts"]
    # Training went on after the failed interval checkpoints, to the last step.
    assert max(e["step"] for e in first["events"] if e["type"] == "step") == STEPS
    # It stops because the final checkpoint cannot be written: exit 1, one line, no traceback from the
    # trainer (torchrun still prints its own ChildFailedError report for any worker that exits non-zero).
    assert first["code"] == 1
    assert first["exit"] is not None and first["exit"]["code"] == 1 and ENOSPC in first["exit"]["reason"]
    frames = [line for line in first["log"].splitlines() if 'File "' in line and "/skyspot/" in line]
    assert not frames, first["log"][-3000:]
    assert [line for line in first["log"].splitlines() if line.startswith("[skyspot]") and ENOSPC in line]


def test_injected_enospc_abandons_one_checkpoint_and_training_continues_bitwise(reference, tmp_path, tmp_path_factory):
    if _can_mount(tmp_path_factory):
        pytest.skip("a real full disk is tested above (tmpfs)")
    run_dir = tmp_path / "run"
    code = finish(start(run_dir, OVERRIDES, SKYSPOT_FAULT="mid_file@6/1:enospc"))
    assert code == 0, log_text(run_dir)[-3000:]
    log = read_events_dir(run_dir / "events")
    failed = log.of_type("checkpoint_failed")
    assert [e["step"] for e in failed] == [6] and ENOSPC in failed[0]["error"]
    assert 8 in [e["step"] for e in log.of_type("checkpoint_end")]
    assert not (run_dir / "checkpoints" / "step_6" / mf.MARKER).exists()
    assert not same_params(run_dir, reference)
