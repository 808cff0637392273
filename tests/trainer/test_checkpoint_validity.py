"""Checkpoints that cannot be half-valid: the commit protocol, validation, resume choice, retention.

The writer runs here without torchrun (one rank; the cross-rank exchange is the identity). A kill
at each point of a write is a real SIGKILL of a subprocess, via the SKYSPOT_FAULT test hook.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from skyspot.trainer import manifest as mf
from skyspot.trainer.checkpoint import choose, retention_victims
from skyspot.trainer.manifest import remove_checkpoint_dir
from tests.trainer.launch import REPO, trainer_env

WRITE = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from skyspot.trainer.writer import CheckpointWriter
    root = Path(sys.argv[1])
    w = CheckpointWriter(rank=0, node_rank=0, is_node_leader=True, exchange=lambda obj: [obj])
    for step in map(int, sys.argv[2:]):
        d = root / f"step_{step}"
        d.mkdir(parents=True, exist_ok=True)
        w.begin(step, "interval", d)
        w.add(d / "zero_pp_rank_0_mp_rank_00_optim_states.pt", {"w": torch.full((4096,), float(step))})
        w.add(d / "trainer_state_rank_0.pt", {"step": step})
        w.submit({"format": 1, "step": step, "world_size": 1}, blocked_seconds=0.0)
        result = w.wait()
        assert result.committed, result.error
    w.close()
""")


def start_writer(root: Path, *steps: int, fault: str = "") -> subprocess.Popen:
    env = trainer_env(SKYSPOT_FAULT=fault) if fault else trainer_env()
    return subprocess.Popen(
        [sys.executable, "-c", WRITE, str(root), *map(str, steps)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def write(root: Path, *steps: int, fault: str = "") -> int:
    return start_writer(root, *steps, fault=fault).wait(120)


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    assert write(root, 1, 2) == 0
    return root


def copy(committed: Path, tmp_path: Path) -> Path:
    import shutil

    root = tmp_path / "checkpoints"
    shutil.copytree(committed, root)
    return root


def test_a_committed_checkpoint_is_valid(committed):
    verdict = mf.inspect(committed / "step_2")
    assert verdict.state == "valid", verdict.reason
    files = verdict.manifest["files"]
    assert set(files) == {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "trainer_state_rank_0.pt"}
    assert all(meta["size"] == (committed / "step_2" / rel).stat().st_size for rel, meta in files.items())
    assert (committed / "latest").read_text() == "step_2"


KILL_POINTS = {
    "write_begin": "incomplete",
    "mid_file": "incomplete",
    "before_manifest": "incomplete",
    "before_marker": "incomplete",
    "after_marker": "valid",
}


@pytest.fixture(scope="module")
def killed(committed, tmp_path_factory) -> dict[str, tuple[Path, int]]:
    """One copy of the committed checkpoints per kill point, each then hit by a write of step 3
    that is SIGKILLed at that point (the writers run in parallel)."""
    import shutil

    procs = {}
    for point in KILL_POINTS:
        root = tmp_path_factory.mktemp(point) / "checkpoints"
        shutil.copytree(committed, root)
        procs[point] = (root, start_writer(root, 3, fault=f"{point}@3:kill"))
    return {point: (root, proc.wait(120)) for point, (root, proc) in procs.items()}


@pytest.mark.parametrize("point, state", KILL_POINTS.items())
def test_sigkill_during_a_write_never_yields_a_broken_checkpoint(killed, point, state):
    root, code = killed[point]
    assert code == -9  # SIGKILL: no handler ran, nothing was flushed on the way out
    verdict = mf.inspect(root / "step_3")
    assert verdict.state == state, verdict.reason
    choice = choose([mf.scan(root)])
    assert choice.step == (3 if state == "valid" else 2)
    if state != "valid":
        assert any("step_3" in w and "never finished" in w for w in choice.warnings)


def test_a_partial_first_file_is_really_partial(committed, killed):
    root, _ = killed["mid_file"]
    written = (root / "step_3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").stat().st_size
    full = (root / "step_2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").stat().st_size
    assert 0 < written < full


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda d: (d / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x"), "bytes"),
        (lambda d: _flip_byte(d / "trainer_state_rank_0.pt"), "sha256"),
        (lambda d: (d / "trainer_state_rank_0.pt").unlink(), "missing"),
        (
            lambda d: (d / mf.MANIFEST).write_text(
                (d / mf.MANIFEST).read_text().replace('"world_size": 1', '"world_size": 2')
            ),
            "hash",
        ),
        (lambda d: (d / mf.MARKER).write_text("{not json"), "JSON"),
        (lambda d: (d / mf.MARKER).write_text(json.dumps({"step": 7, "manifest_sha256": "x"})), "names step 7"),
    ],
)
def test_damaged_checkpoint_is_corrupt_and_resume_uses_the_previous_one(committed, tmp_path, damage, reason):
    root = copy(committed, tmp_path)
    damage(root / "step_2")
    verdict = mf.inspect(root / "step_2")
    assert verdict.state == "corrupt" and reason in verdict.reason
    choice = choose([mf.scan(root)])
    assert choice.step == 1 and choice.problem is None
    assert any(line.startswith("skipping step_2: corrupt") for line in choice.warnings)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_when_every_checkpoint_is_corrupt_resume_refuses_to_start_over(committed, tmp_path):
    root = copy(committed, tmp_path)
    for d in ("step_1", "step_2"):
        _flip_byte(root / d / "trainer_state_rank_0.pt")
    choice = choose([mf.scan(root)])
    assert choice.step is None and "none is usable" in choice.problem


def test_only_never_committed_directories_mean_a_fresh_start(committed, tmp_path):
    root = copy(committed, tmp_path)
    for d in ("step_1", "step_2"):
        (root / d / mf.MARKER).unlink()
    choice = choose([mf.scan(root)])
    assert choice.step is None and choice.problem is None and len(choice.warnings) == 2


def test_resume_needs_a_step_valid_on_every_node(committed, tmp_path):
    node0 = mf.scan(committed)
    node1 = [v for v in node0 if v.step == 1]
    choice = choose([node0, node1])
    assert choice.step == 1 and any("not on every node" in w for w in choice.warnings)


def _verdicts(spec: dict[int, str]) -> list[mf.Verdict]:
    return [mf.Verdict(step, Path(f"/x/step_{step}"), state) for step, state in sorted(spec.items(), reverse=True)]


def test_retention_keeps_the_newest_and_asks_before_deleting():
    verdicts = _verdicts({1: "valid", 2: "incomplete", 3: "valid", 4: "valid", 5: "valid", 6: "incomplete"})
    victims = retention_victims(verdicts, keep=2, newest=5, can_delete=lambda s: True)
    assert sorted(p.name for p in victims) == ["step_1", "step_2", "step_3"]  # step_6 is newer: untouched
    vetoed = retention_victims(verdicts, keep=2, newest=5, can_delete=lambda s: s != 1)
    assert sorted(p.name for p in vetoed) == ["step_2", "step_3"]
    assert retention_victims(_verdicts({5: "valid"}), keep=1, newest=5, can_delete=lambda s: True) == []


def test_deleting_a_checkpoint_drops_its_marker_first(committed, tmp_path):
    root = copy(committed, tmp_path)
    remove_checkpoint_dir(root / "step_1")
    assert not (root / "step_1").exists()
    assert [v.step for v in mf.scan(root)] == [2]
