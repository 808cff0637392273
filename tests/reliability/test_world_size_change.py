"""Spot capacity changes: a run resumes on fewer ranks, then on more, and trains as if it never moved.

    start 1   2 ranks, killed (SIGKILL) right after step 8's checkpoint commits
    start 2   1 rank: step_8's two ZeRO-3 shards are converted to a universal checkpoint (DeepSpeed's
              ds_to_universal) and loaded; the global batch of 8 is kept as 4 x 2 accumulation steps;
              killed right after step 16 commits
    start 3   2 ranks: step_16 (one shard) is converted and loaded; micro batch 4 again; finishes

Stated tolerance: every step's loss within 1e-5 (relative) of the uninterrupted 2-rank run's, and the
final parameters within 1e-5 (absolute). The same samples make every step (data.rebatch) and fp32
gradients averaged over 2 ranks or accumulated over 2 micro batches agree, so on this machine the
run is in fact bitwise equal to the reference; the tolerance leaves room for reduction order elsewhere.
"""

from __future__ import annotations

import stat

import pytest

from skyspot.events import read_events_dir
from skyspot.trainer.reshard import CONVERTED, universal_root
from tests.reliability.conftest import STEPS
from tests.trainer.launch import finish, log_text, start

pytestmark = pytest.mark.slow

OVERRIDES = [f"train.steps={STEPS}", "checkpoint.every_steps=4", "train.log_every=4"]


def _losses(run_dir) -> dict[int, float]:
    """Rank 0's loss per step, the latest attempt's where a step ran twice."""
    steps = sorted(read_events_dir(run_dir / "events").of_type("step"), key=lambda e: e["attempt"])
    return {e["step"]: e["loss"] for e in steps if e.get("rank") == 0}


def test_resume_on_fewer_then_more_ranks_continues_the_same_training(reference, tmp_path):
    import torch
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    assert finish(start(run_dir, OVERRIDES, nproc=2, log_name="start1", SKYSPOT_FAULT="after_marker@8:kill")) != 0
    code = finish(start(run_dir, OVERRIDES, nproc=1, log_name="start2", SKYSPOT_FAULT="after_marker@16:kill"))
    assert code != 0, log_text(run_dir, "start2")[-3000:]
    second = log_text(run_dir, "start2")
    assert "world size 2 -> 1: keeping the global batch of 8 samples on 1 rank: micro batch 4 x 2" in second, second
    assert "step_8 was written by 2 ranks on 1 node(s), this start has 1 on 1" in second
    code = finish(start(run_dir, OVERRIDES, nproc=2, log_name="start3"))
    assert code == 0, log_text(run_dir, "start3")[-3000:]

    log = read_events_dir(run_dir / "events")
    resumes = [
        (e["step"], e["world_size_from"], e["world_size"], e["samples"])
        for e in log.of_type("resume")
        if e.get("rank") == 0
    ]
    assert resumes == [(8, 2, 1, 64), (16, 1, 2, 128)]  # the data position continues: 8 samples a step
    # One conversion cache per node, for the latest conversion.
    assert [p.name for p in universal_root(run_dir).iterdir() if p.is_dir()] == ["step_16"]
    assert (universal_root(run_dir) / "step_16" / CONVERTED).is_file()
    # What the trainer creates is the user's alone.
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in (run_dir / "checkpoints", universal_root(run_dir)))

    ours, theirs = _losses(run_dir), _losses(reference)
    assert sorted(ours) == list(range(1, STEPS + 1))
    drift = max(abs(ours[s] - theirs[s]) / abs(theirs[s]) for s in ours)
    a, b = load_file(run_dir / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    param_drift = max((a[k] - b[k]).abs().max().item() for k in b)
    print(f"world 2 -> 1 -> 2: loss drift {drift:.2e} (relative), parameter drift {param_drift:.2e}")
    assert drift <= 1e-5 and param_drift <= 1e-5, (drift, param_drift)
    assert set(a) == set(b) and all(a[k].dtype == b[k].dtype == torch.float32 for k in b)
