"""setup's `prepare`: the DeepSpeed ops a start of the recipe loads, built once on the node (the CUDA
refusal is in test_gpu_refusal.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from skyspot.recipe import load_recipe
from skyspot.trainer.prepare import COMM_OP, CPU_ADAM_OP, ops_for
from tests.trainer.launch import REPO, trainer_env


def test_an_offload_recipe_needs_cpu_adam_and_no_recipe_keeps_todays_ops():
    assert ops_for(None) == [COMM_OP]  # `python -m skyspot.trainer.prepare` without a recipe, as before
    assert ops_for(load_recipe("tiny", [], environ={})) == [COMM_OP]
    assert ops_for(load_recipe("tiny", ["deepspeed.offload_optimizer=cpu"], environ={})) == [COMM_OP, CPU_ADAM_OP]


def test_a_bad_recipe_is_one_line_and_exit_2():
    done = subprocess.run(
        [sys.executable, "-m", "skyspot.trainer.prepare", "tiny", "deepspeed.offload_optimizer=gpu"],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert [line for line in done.stderr.splitlines() if line.strip()] == [done.stderr.strip()]


@pytest.mark.slow
def test_prepare_builds_the_cpu_adam_the_trainer_loads(tmp_path):
    """The first time, a compile of DeepSpeedCPUAdam (a minute or more; cached in torch's extension
    directory after); then the optimizer ZeRO-Offload constructs loads it without building."""
    env = trainer_env()
    done = subprocess.run(
        [sys.executable, "-m", "skyspot.trainer.prepare", "tiny", "deepspeed.offload_optimizer=cpu"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "deepspeed.ops.adam.cpu_adam_op" in done.stdout and "failed" not in done.stderr, done.stdout + done.stderr
    check = (
        "import time, torch; from deepspeed.ops.adam import DeepSpeedCPUAdam; t = time.monotonic(); "
        "DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))]); print(time.monotonic() - t)"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", check], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert loaded.returncode == 0, loaded.stderr
    assert float(loaded.stdout.strip().splitlines()[-1]) < 10.0, loaded.stdout  # loaded from the cache, not compiled
