"""Refuse, never fall back: a node SkyPilot gave GPUs, where torch cannot use CUDA, exits 2 with one line
(driver, torch's CUDA line, devices seen) from setup's `prepare` and from the trainer, before anything
but the exit record is written. This machine has no CUDA: SKYPILOT_NUM_GPUS_PER_NODE=1 stands for a
GPU node whose image's driver does not fit torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from skyspot.errors import UsageError
from skyspot.trainer import gpu
from skyspot.trainer.exit_codes import USAGE
from tests.trainer.launch import REPO, TINY, finish, log_text, start, trainer_env


def test_the_refusal_names_driver_cuda_line_and_devices():
    line = gpu.problem(
        8,
        available=True,
        devices=4,
        torch_version="2.13.0",
        cuda="13.0",
        driver="NVIDIA driver 535.1",
        source="SKYPILOT_NUM_GPUS_PER_NODE=8",
    )
    assert "\n" not in line and "535.1" in line and "CUDA 13.0" in line and "sees 4 CUDA devices" in line
    assert "for 8 ranks" in line
    none = gpu.problem(
        1,
        available=False,
        devices=0,
        torch_version="2.13.0+cpu",
        cuda=None,
        driver="no NVIDIA driver (no nvidia-smi)",
        source="SKYPILOT_SETUP_NUM_GPUS_PER_NODE=1",
    )
    assert "built without CUDA" in none and "cannot use CUDA" in none and "no NVIDIA driver" in none
    assert gpu.problem(8, available=True, devices=8, torch_version="2.13.0", cuda="13.0", driver="", source="x") is None


def test_a_node_without_gpus_is_not_checked():
    assert gpu.require_cuda(environ={}) == 0
    assert gpu.require_cuda(environ={"SKYPILOT_NUM_GPUS_PER_NODE": "0"}) == 0
    assert gpu.gpus_per_node({"SKYPILOT_SETUP_NUM_GPUS_PER_NODE": "4"}) == 4  # setup's own name


def test_a_gpu_node_without_cuda_is_refused_here():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UsageError, match="refusing to train on the CPU"):
        gpu.require_cuda(environ={"SKYPILOT_NUM_GPUS_PER_NODE": "1"})


def _one_line(stderr: str, prefix: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith(prefix) and "refusing to train on the CPU" in lines[0], lines[0]
    return lines[0]


def test_prepare_refuses_a_gpu_node_without_cuda(tmp_path):
    env = trainer_env(SKYPILOT_SETUP_NUM_GPUS_PER_NODE="1")
    done = subprocess.run(
        [sys.executable, "-m", "skyspot.trainer.prepare", "tiny"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == USAGE, done.stdout + done.stderr
    line = _one_line(done.stderr, "skyspot prepare: ")
    assert "SKYPILOT_SETUP_NUM_GPUS_PER_NODE=1" in line and "no NVIDIA driver" in line
    assert "loading DeepSpeed" not in done.stdout  # nothing built


def test_the_trainer_refuses_a_gpu_node_without_cuda_and_writes_no_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    env = trainer_env(SKYPILOT_NUM_GPUS_PER_NODE="1")
    done = subprocess.run(
        [sys.executable, "-m", "skyspot.trainer", "tiny", "--run-dir", str(run_dir), *TINY],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == USAGE, done.stdout + done.stderr
    _one_line(done.stderr, "[skyspot] this node has GPUs for 1 rank")
    assert sorted(p.name for p in run_dir.iterdir()) == ["exit.json"]  # no checkpoints/, events/, run.json
    assert json.loads((run_dir / "exit.json").read_text())["code"] == USAGE


def test_the_supervisor_passes_the_refusal_through_torchrun(tmp_path):
    run_dir = tmp_path / "run"
    code = finish(start(run_dir, TINY, nproc=1, SKYPILOT_NUM_GPUS_PER_NODE="1"), timeout=120)
    assert code == USAGE, log_text(run_dir)  # not 1 (torchrun's), and not 75: SkyPilot does not recover it
    assert log_text(run_dir).count("[skyspot] this node has GPUs for 1 rank") == 1
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "events").exists()


@pytest.mark.parametrize("restarts", [0, 3])
def test_a_refusal_under_the_supervisor_and_torchrun_ends_the_log_with_its_line_and_exits_2(tmp_path, restarts):
    """The rendered run: supervise -- torchrun --max-restarts N -m skyspot.trainer. Before, with restarts off,
    torchrun's ChildFailedError traceback followed the line and torchrun exited 1; with restarts on, the
    supervisor's own line repeated it. Now the line is the log's last, the exit 2 (configuration), and the
    worker ran once: a refusal is not restarted in place."""
    from tests.trainer.launch import torchrun_command

    run_dir = tmp_path / "run"
    command = torchrun_command(run_dir, TINY, 1)
    command[1:1] = ["--max-restarts", str(restarts)]
    done = subprocess.run(
        [sys.executable, "-m", "skyspot.trainer.supervise", "--run-dir", str(run_dir), "--", *command],
        cwd=REPO,
        env=trainer_env(SKYPILOT_NUM_GPUS_PER_NODE="1", CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = done.stdout + done.stderr
    assert done.returncode == USAGE, log
    assert "Traceback" not in log and "ChildFailedError" not in log, log
    lines = [line for line in log.splitlines() if line.strip()]
    assert lines[-1].startswith("[skyspot] this node has GPUs for 1 rank"), log
    assert log.count("this node has GPUs for 1 rank") == 1, log  # one start: not restarted in place
    assert json.loads((run_dir / "exit.json").read_text())["code"] == USAGE
