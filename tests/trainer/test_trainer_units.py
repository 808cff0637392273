"""Small pieces of the trainer: preemption flags, LR schedule, DeepSpeed config, placement, run dir."""

from __future__ import annotations

import json
import os
import signal

import pytest

from skyspot.recipe import load_recipe
from skyspot.trainer import cluster, rundir
from skyspot.trainer.engine import deepspeed_config, lr_factor
from skyspot.trainer.preemption import PreemptionWatch


def test_signals_set_a_flag_and_nothing_else():
    watch = PreemptionWatch()
    watch.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        watch.uninstall()
    pending = watch.take()
    assert pending.emergency and [name for _, name, _ in pending.signals] == ["SIGUSR1", "SIGTERM"]
    again = watch.take()
    assert again.emergency and again.signals == []  # the flag stays until the process exits


def test_notice_and_rebalance_entry_points():
    watch = PreemptionWatch()
    watch.request_checkpoint("aws rebalance")
    pending = watch.take()
    assert pending.checkpoint and not pending.emergency
    assert not watch.take().checkpoint  # a checkpoint request is consumed
    watch.request_emergency(deadline=2000.0, source="gcp")
    watch.request_emergency(deadline=1000.0, source="aws", action="terminate")
    pending = watch.take()
    assert pending.emergency and pending.deadline == 1000.0 and len(pending.notices) == 2


def test_lr_warms_up_then_decays_by_cosine_to_the_floor():
    f = lr_factor(warmup_steps=4, total_steps=20, min_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0 and f(20) == pytest.approx(0.1) and f(99) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(4, 20))


def test_deepspeed_config_from_the_recipe():
    recipe = load_recipe(
        "tiny",
        ["train.grad_accum=2", "deepspeed.extra={zero_optimization: {stage3_max_live_parameters: 1000}}"],
        environ={},
    )
    config = deepspeed_config(recipe)
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["stage3_max_live_parameters"] == 1000  # extra merged last
    assert config["gradient_accumulation_steps"] == 2 and config["train_micro_batch_size_per_gpu"] == 4
    assert config["optimizer"]["params"]["torch_adam"] is True  # stateless bias correction: exact resume
    offload = deepspeed_config(load_recipe("tiny", ["deepspeed.offload_optimizer=cpu"], environ={}))
    assert "torch_adam" not in offload["optimizer"]["params"]  # ZeRO-Offload needs DeepSpeedCPUAdam


def test_placement_reads_skypilot_and_torchrun_variables():
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "SKYPILOT_NODE_RANK": "2",
        "SKYPILOT_NUM_NODES": "4",
        "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2\n",
        "SKYPILOT_TASK_ID": "sky-1",
        "SKYPILOT_CLUSTER_INFO": json.dumps(
            {"cloud": "GCP", "region": "us-central1", "zone": "us-central1-a", "use_spot": True}
        ),
    }
    p = cluster.from_environment(env)
    assert (p.rank, p.world_size, p.local_rank, p.node_rank, p.num_nodes, p.local_world_size) == (5, 8, 1, 2, 4, 2)
    assert p.node_ips == ("10.0.0.1", "10.0.0.2") and not p.is_node_leader
    assert p.where == {
        "cloud": "gcp",
        "region": "us-central1",
        "zone": "us-central1-a",
        "instance_type": "unknown",
        "spot": True,
        "num_nodes": 4,
    }
    assert cluster.from_environment({}).where["cloud"] == "unknown"


def test_run_id_precedence(tmp_path):
    d = tmp_path / "myrun"
    assert cluster.run_id("flag", d, {"SKYSPOT_RUN_NAME": "env", "SKYPILOT_TASK_ID": "task"}) == "flag"
    assert cluster.run_id(None, d, {"SKYSPOT_RUN_NAME": "env", "SKYPILOT_TASK_ID": "task"}) == "env"
    assert cluster.run_id(None, d, {"SKYPILOT_TASK_ID": "task"}) == "task"
    assert cluster.run_id(None, d, {}) == "myrun"


def test_attempts_count_up_and_fresh_moves_work_aside(tmp_path):
    assert [rundir.next_attempt(tmp_path) for _ in range(3)] == [1, 2, 3]
    (tmp_path / "checkpoints" / "step_4").mkdir(parents=True)
    (tmp_path / "final").mkdir()
    moved = rundir.move_aside(tmp_path)
    assert (moved / "checkpoints" / "step_4").is_dir() and (moved / "final").is_dir()
    assert not (tmp_path / "checkpoints").exists()
    assert rundir.next_attempt(tmp_path) == 4  # attempts keep counting across --fresh


def test_one_trainer_per_run_directory(tmp_path):
    first, second = rundir.RunLock(tmp_path), rundir.RunLock(tmp_path)
    assert first.acquire() is None
    assert "pid" in second.acquire()
    first.release()
    assert second.acquire() is None
    second.release()


def test_recipe_changes_on_resume_are_named_and_the_architecture_comes_from_the_checkpoint():
    from skyspot.trainer.resume import reconcile_recipe

    saved = load_recipe("tiny", ["train.steps=40", "model.config.hidden_size=32"], environ={})
    now = load_recipe("tiny", ["train.steps=60"], environ={})
    merged, lines = reconcile_recipe(now, saved.model_dump(mode="json"))
    assert merged.train.steps == 60 and merged.model.config["hidden_size"] == 32
    assert "recipe differs from the checkpoint: train.steps 40 -> 60 (the recipe's value is used)" in lines
    assert any("model.config.hidden_size 32 -> 64 (the checkpoint's value is used)" in line for line in lines)
    assert reconcile_recipe(now, now.model_dump(mode="json")) == (now, [])


def test_ranks_wait_for_one_ranks_io_as_long_as_the_io_timeout_says():
    """comm.py's I/O group: 2 h unless SKYSPOT_IO_TIMEOUT_SECONDS says otherwise; nonsense keeps the default."""
    from skyspot.trainer.comm import IO_TIMEOUT_S, io_timeout

    assert io_timeout({}).total_seconds() == IO_TIMEOUT_S == 7200
    assert io_timeout({"SKYSPOT_IO_TIMEOUT_SECONDS": "90"}).total_seconds() == 90
    assert io_timeout({"SKYSPOT_IO_TIMEOUT_SECONDS": "soon"}).total_seconds() == IO_TIMEOUT_S
    assert io_timeout({"SKYSPOT_IO_TIMEOUT_SECONDS": "-1"}).total_seconds() == IO_TIMEOUT_S
