"""Restarts in place, the parts that need no training: the budget and its backoff, naming what failed
and when, the exit status a final ending gives torchrun, the pinned ranks, the injected rank faults,
and the torchrun line the task renders."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from skyspot.errors import UsageError
from skyspot.executors.local import rank_faults
from skyspot.trainer import cluster
from skyspot.trainer.exit_codes import ERROR, PREEMPTED, USAGE, process_code
from skyspot.trainer.restart import BACKOFF_CAP_S, HOUR_S, decide, diagnose

NOW = 10_000.0


def test_the_first_restarts_of_an_hour_are_allowed_each_after_twice_the_last_wait():
    first, second, third = (
        decide([], NOW, 3, 5.0),
        decide([NOW - 60], NOW, 3, 5.0),
        decide([NOW - 90, NOW - 60], NOW, 3, 5.0),
    )
    assert (first.allowed, first.within_hour, first.wait_seconds) == (True, 1, 5.0)
    assert (second.allowed, second.within_hour, second.wait_seconds) == (True, 2, 10.0)
    assert (third.allowed, third.within_hour, third.wait_seconds) == (True, 3, 20.0)


def test_past_the_hourly_budget_the_restart_is_refused_and_an_hour_later_allowed_again():
    three = [NOW - 300, NOW - 200, NOW - 100]
    assert not decide(three, NOW, 3, 5.0).allowed
    assert decide(three, NOW + HOUR_S - 299, 3, 5.0).allowed  # the first of them has left the hour
    assert decide([NOW - HOUR_S - 1] * 10, NOW, 3, 5.0).within_hour == 1  # older ones never count


def test_the_backoff_is_capped_and_zero_restarts_disables_them():
    assert decide([NOW - 1] * 20, NOW, 1000, 5.0).wait_seconds == BACKOFF_CAP_S
    assert decide([], NOW, 3, 0.0).wait_seconds == 0.0
    assert not decide([], NOW, 0, 5.0).allowed


def _death(pid, ts):
    return {"pid": pid, "ts": ts, "local_rank": 0}


def _failure(pid, ts):
    return {"pid": pid, "ts": ts, "reason": "RuntimeError: Connection closed by peer"}


def test_a_rank_that_died_without_a_word_before_its_peers_errors_is_a_crash():
    views = [
        {"deaths": [_death(10, 101.0)], "failures": [_failure(10, 100.3)]},  # node 0: a peer's symptom
        {"deaths": [_death(20, 100.2)], "failures": []},
    ]  # node 1: SIGKILLed, silent
    assert diagnose(views, fallback=0.0) == ("crash", 100.2)


def test_an_exception_first_is_an_error_even_when_a_peer_is_killed_silently_later():
    views = [
        {"deaths": [_death(10, 100.9)], "failures": [_failure(10, 100.0)]},
        {"deaths": [_death(20, 131.0)], "failures": []},
    ]  # SIGKILLed by its agent 30 s on
    assert diagnose(views, fallback=0.0) == ("error", 100.0)


def test_a_hang_the_watchdog_recorded_names_the_cause_and_its_time():
    views = [
        {"deaths": [_death(10, 200.0)], "failures": [], "hang": {"ts": 190.0, "step": 7}},
        {"deaths": [_death(20, 200.1)], "failures": [], "hang": None},
    ]
    assert diagnose(views, fallback=0.0) == ("hang", 190.0)
    assert diagnose([{"deaths": [], "failures": []}], fallback=42.0) == ("crash", 42.0)


@pytest.mark.parametrize("code", [0, USAGE, 3, PREEMPTED, 130])
def test_a_final_ending_exits_0_under_a_torchrun_that_would_restart_it(code):
    assert process_code(code, True, {"TORCHELASTIC_MAX_RESTARTS": "72"}) == 0
    assert process_code(code, True, {"TORCHELASTIC_MAX_RESTARTS": "0"}) == code  # no restarts: as before
    assert process_code(code, True, {}) == code  # not under torchrun


@pytest.mark.parametrize("code", [USAGE, PREEMPTED])
def test_a_final_ending_exits_0_under_the_supervisors_torchrun_even_with_restarts_off(code):
    supervised = {"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "r", "SKYSPOT_SUPERVISOR_TOKEN": "t"}
    assert process_code(code, True, supervised) == 0  # the record carries the code; torchrun stays quiet
    assert process_code(code, True, {**supervised, "SKYSPOT_SUPERVISOR_TOKEN": ""}) == code  # bare torchrun
    assert process_code(ERROR, False, supervised) == ERROR  # a crash stays a crash


def test_an_error_keeps_its_code_so_torchrun_restarts_it():
    assert process_code(ERROR, False, {"TORCHELASTIC_MAX_RESTARTS": "72"}) == ERROR
    assert process_code(ERROR, True, {"TORCHELASTIC_MAX_RESTARTS": "72"}) == 0  # the budget spent: final


def test_the_global_rank_follows_the_skypilot_node_rank_not_the_rendezvous_order():
    env = {
        "GROUP_RANK": "0",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "4",
        "SKYPILOT_NODE_RANK": "1",
        "SKYPILOT_NUM_NODES": "2",
    }
    assert cluster.pin_rank(env)
    assert env["RANK"] == "3" and env[cluster.LAUNCHER_RANK_ENV] == "1"
    assert not cluster.pin_rank(env) and env["RANK"] == "3"  # once
    plain = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}  # not under torchrun's rendezvous
    assert not cluster.pin_rank(plain) and plain["RANK"] == "1"
    odd = {**env, "WORLD_SIZE": "3"}
    odd.pop(cluster.LAUNCHER_RANK_ENV)
    assert not cluster.pin_rank(odd)  # not SkyPilot's equal nodes: torchrun's numbering stays


def test_rank_faults_name_a_step_and_optionally_a_node_and_local_rank():
    assert rank_faults.parse("12:1,7,9:0.1", "crash") == [
        {"action": "crash", "step": 7, "node": None, "local_rank": None},
        {"action": "crash", "step": 9, "node": 0, "local_rank": 1},
        {"action": "crash", "step": 12, "node": 1, "local_rank": None},
    ]
    for bad in ("x", "3:a", "0", "3:-1", "3:1.x"):
        with pytest.raises(UsageError, match="--hang-at-steps"):
            rank_faults.parse(bad, "hang")
    with pytest.raises(UsageError, match="node 2 of a run on 2 node"):
        rank_faults.check(rank_faults.parse("3:2", "crash"), 2, 1)
    with pytest.raises(UsageError, match="local rank 1 of 1"):
        rank_faults.check(rank_faults.parse("3:0.1", "crash"), 2, 1)


def test_rank_faults_are_for_local_runs_only():
    from skyspot.cli.main import app

    result = CliRunner().invoke(app, ["launch", "tiny", "--cloud", "--dry-run", "--crash-at-steps", "5"])
    assert result.exit_code != 0 and "--crash-at-steps" in result.output and "--local" in result.output


def test_the_task_hands_torchrun_the_budget_as_its_ceiling_and_zero_as_none():
    from skyspot.recipe import load_recipe
    from skyspot.task.render import run_script

    assert "--max-restarts 72 " in run_script(load_recipe("tiny", []), "tiny", [])
    off = run_script(load_recipe("tiny", ["resilience.restarts_in_place=0"]), "tiny", [])
    assert "--max-restarts 0 " in off and "--rdzv_backend c10d" in off


def test_an_injected_fault_signals_the_nodes_worker_by_local_rank(tmp_path):
    """Stand-ins for two workers of node 1 (a node's SkyPilot environment and torchrun's): a hang stops the
    last local rank by default, a crash aimed at local rank 0 kills that one; node 0 has none."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    procs = []
    for local_rank in (0, 1):
        env = {
            **os.environ,
            "SKYSPOT_RUN_NAME": "faulty",
            "SKYPILOT_NODE_RANK": "1",
            "TORCHELASTIC_RUN_ID": "faulty",
            "LOCAL_RANK": str(local_rank),
        }
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env))
    try:
        deadline = time.monotonic() + 10
        while len(rank_faults.workers("faulty", 1)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rank_faults.inject(rank_faults.parse("3:0", "hang")[0], "faulty", 2) is None  # node 0: nobody
        hung = rank_faults.inject(rank_faults.parse("3", "hang")[0], "faulty", 2)
        assert hung == {"node": 1, "local_rank": 1, "pid": procs[1].pid, "signal": "SIGSTOP"}
        deadline = time.monotonic() + 10
        while psutil.Process(procs[1].pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.05)
        assert psutil.Process(procs[1].pid).status() == psutil.STATUS_STOPPED
        crashed = rank_faults.inject(rank_faults.parse("5:1.0", "crash")[0], "faulty", 2)
        assert crashed["pid"] == procs[0].pid and crashed["signal"] == "SIGKILL"
        assert procs[0].wait(timeout=10) == -signal.SIGKILL
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_the_watchdog_numbers_a_worker_as_the_trainer_will_not_as_the_rendezvous_did():
    """cluster.pinned_rank: node 1's worker that torchrun's c10d rendezvous numbered 0 trains as rank 1, so
    the watchdog on node 1 does not take it for global rank 0 (the one that writes the steps); off a
    SkyPilot node, or once pinned, torchrun's RANK is the rank."""
    from skyspot.trainer.cluster import LAUNCHER_RANK_ENV, pinned_rank

    node1 = {
        "GROUP_RANK": "0",
        "SKYPILOT_NODE_RANK": "1",
        "SKYPILOT_NUM_NODES": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "WORLD_SIZE": "2",
    }
    assert pinned_rank(node1) == 1
    assert pinned_rank({**node1, "SKYPILOT_NODE_RANK": "0", "RANK": "1"}) == 0
    assert pinned_rank({"RANK": "3", "LOCAL_RANK": "1"}) == 3
    assert pinned_rank({**node1, LAUNCHER_RANK_ENV: "0", "RANK": "1"}) == 1
    assert pinned_rank({"LOCAL_RANK": "0"}) is None
