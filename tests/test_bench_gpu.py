"""The GPU check (bench/gpu.py, scripts/gpu_check.sh) on its CPU path: `tiny`, one rank, the same
three checks end to end (preempted resume bitwise, checkpoint stall against the copy floor, steps/s
against a bare DeepSpeed loop), and its JSON and markdown. No GPU here; on one the 1B model runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import gpu
from tests.trainer.launch import REPO, trainer_env


def test_the_gpu_spec_is_a_1b_llama_in_bf16_on_one_gpu_and_the_cpu_spec_is_tiny():
    assert "deepspeed.bf16=true" in gpu.LLAMA_1B and "model.config.num_hidden_layers=22" in gpu.LLAMA_1B
    assert gpu.spec(False)["env"] == {"SKYPILOT_NUM_GPUS_PER_NODE": "1"}  # the trainer's CUDA refusal is armed
    assert gpu.spec(True)["model"] == [] and gpu.spec(True)["preempt_at"] < gpu.spec(True)["steps"]


def test_the_report_says_what_failed_without_figures():
    text = gpu.markdown({"machine": {"card": "none"}, "command": "x", "seconds": 1.0, "errors": ["resume: boom"]})
    assert "| error | resume: boom | |" in text


@pytest.mark.slow
def test_the_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--gpu", "--out", str(out)],
        cwd=REPO,
        timeout=900,
        env=trainer_env(SKYSPOT_GPU_CHECK_CPU="1"),
        capture_output=True,
        text=True,
    )
    report = json.loads((out / "gpu_check.json").read_text())
    assert done.returncode == 0 and report["errors"] == [], done.stderr[-3000:]
    resume, stall, speed = report["resume"], report["stall"], report["speed"]
    assert resume["bitwise"] and resume["losses_equal"] and resume["tensors_differing"] == 0
    assert resume["emergency_bytes"] > 0 and resume["preempted_at"] == 4
    assert stall["emergency_signal_to_commit_s"] > 0
    assert stall["stall_s"] > 0 and stall["floor_s"] > 0 and stall["state_bytes"] > 0
    assert speed["trainer_steps_per_s"] > 0 and speed["bare_steps_per_s"] > 0
    text = (out / "gpu_check.md").read_text()
    assert "bitwise equal to the uninterrupted run | yes" in text and "none (CPU path)" in text
