"""A checkpoint from the store cannot run code: every file is loaded weights-only (trainer/safe_load.py).

Whoever can write to the bucket can rewrite a checkpoint's files *and* the manifest whose sha256
vets them, so the tests plant a file whose pickle runs `os.system` on load, with the manifest and
marker rewritten to match, as such an attacker would. The payload writes a marker file: it must
never appear.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from skyspot.errors import CheckpointError
from skyspot.trainer import manifest as mf
from skyspot.trainer import safe_load
from skyspot.trainer.exit_codes import NO_VALID_CHECKPOINT
from tests.trainer.launch import REPO, finish, log_text, start, trainer_env

SHORT = ["train.steps=4", "checkpoint.every_steps=4", "train.log_every=4"]


def plant_payload(path: Path, marker: Path) -> None:
    """Replace `path` with a torch file whose unpickling runs `touch MARKER` (through a subprocess, so
    this test process never unpickles it)."""
    script = textwrap.dedent(f"""
        import os, torch
        class Payload:
            def __reduce__(self):
                return (os.system, ("touch {marker}",))
        torch.save({{"rng": Payload(), "module": {{}}}}, {str(path)!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, env=trainer_env(), cwd=REPO)


def reseal(step_dir: Path) -> None:
    """What an attacker with write access to the bucket also does: the manifest's sizes and sums, and
    the marker's hash of the manifest, made to match the planted file."""
    manifest = json.loads((step_dir / mf.MANIFEST).read_text())
    for name, entry in manifest["files"].items():
        entry["sha256"] = mf.sha256_file(step_dir / name)
        entry["size"] = (step_dir / name).stat().st_size
    data = json.dumps(manifest, indent=2, sort_keys=True).encode()
    (step_dir / mf.MANIFEST).write_bytes(data)
    marker = json.loads((step_dir / mf.MARKER).read_text())
    marker["manifest_sha256"] = mf.sha256_bytes(data)
    (step_dir / mf.MARKER).write_text(json.dumps(marker))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("safe") / "run"
    assert finish(start(run_dir, SHORT)) == 0, log_text(run_dir)
    return run_dir


def test_a_pickle_that_runs_code_is_refused_in_one_line_and_runs_nothing(tmp_path):
    target, marker = tmp_path / "trainer_state_rank_0.pt", tmp_path / "PWNED"
    plant_payload(target, marker)
    with pytest.raises(CheckpointError) as refused:
        safe_load.load(target, map_location="cpu")
    with pytest.raises(CheckpointError):
        safe_load.vet(target)
    assert "\n" not in str(refused.value)
    assert "refusing" in str(refused.value) and "system" in str(refused.value)
    assert not marker.exists()


@pytest.mark.slow
def test_what_deepspeed_and_the_trainer_pickle_is_allowed(trained):
    """The allow-list holds what real files need: a checkpoint written by DeepSpeed 0.19.8's ZeRO-3 and
    our trainer state, read back weights-only (the classes listed in safe_load's docstring)."""
    files = sorted((trained / "checkpoints" / "step_4").glob("*.pt"))
    assert {f.name.split("_rank_")[0] for f in files} >= {"trainer_state", "zero_pp"}
    for path in files:
        safe_load.vet(path)
        assert safe_load.load(path, map_location="cpu") is not None


@pytest.mark.slow
@pytest.mark.parametrize(
    "planted",
    [
        "trainer_state_rank_0.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
    ],
)
def test_resume_from_a_planted_checkpoint_refuses_and_runs_nothing(trained, tmp_path, planted):
    """Our own load (the trainer state) and DeepSpeed's (model and ZeRO optimizer states, through the
    snapshot engine) alike: the resume stops with NO_VALID_CHECKPOINT and one line naming the file."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    step_dir, marker = run_dir / "checkpoints" / "step_4", tmp_path / "PWNED"
    plant_payload(step_dir / planted, marker)
    reseal(step_dir)
    code = finish(start(run_dir, ["train.steps=8", "checkpoint.every_steps=4", "train.log_every=4"]))
    log = log_text(run_dir)
    assert code == NO_VALID_CHECKPOINT, log
    assert not marker.exists()
    # One line from the trainer, and the supervisor's one line with the exit code (torchrun adds its own
    # ChildFailedError report whenever a worker exits non-zero; that is not ours).
    assert any(
        line.startswith("[skyspot] rank ") and "refusing" in line and planted in line for line in log.splitlines()
    ), log
    assert any(
        line.startswith("[skyspot.supervise] trainer exit 3 (no valid checkpoint: rank ") and planted in line
        for line in log.splitlines()
    ), log
