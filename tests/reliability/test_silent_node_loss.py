"""A node whose link goes silent mid-step, as a preempted VM does: the other notices, both restart, no bit differs.

Two hosts with their own addresses (skyspot/executors/local/netns.py: a namespace each, one veth into a bridge), one
node on each: `supervise -- torchrun --nnodes 2 --node_rank K --nproc_per_node 1 --master_addr <host 0>
--local_addr <host K> -m skyspot.trainer tiny`, with SKYPILOT_NODE_IPS the two addresses and gloo on
the namespace's interface (GLOO_SOCKET_IFNAME), as a cloud node sees it. Once a few checkpoints are
committed, host 1's link is cut: its packets are dropped, nothing is reset, so unlike a killed process
on 127.0.0.1 (test_node_loss.py) no socket of node 0 closes.

Which bound applies: node 0's rank is then blocked in a default-group collective (DeepSpeed's, or the
step-boundary vote), whose timeout is SKYSPOT_DIST_TIMEOUT_SECONDS (trainer/process_env.py
dist_timeout, passed to init_process_group). The supervisor's hang watchdog would fire only after
max(hang_factor x median step, hang_floor_seconds = 300 s by default) (trainer/watchdog.py hang_bound),
far later, so the collective timeout is what stops node 0: not sooner (nothing reset the connection),
not much later. Then the link heals and both nodes start again (a new attempt, as the executor would
after a recovery); the run resumes from the newest checkpoint both committed and ends bitwise equal
to the uninterrupted `reference`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from skyspot.ports import free_port
from skyspot.executors.local.netns import Hosts, unavailable_reason
from tests.reliability.conftest import STEPS, same_params
from tests.trainer.launch import REPO, events, host_node, log_text

REASON = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=f"netns harness unavailable: {REASON}")]

OVERRIDES = [f"train.steps={STEPS}", "checkpoint.every_steps=2", "train.log_every=4"]
CUT_AT_STEP = 7  # rank 0 has logged this step: checkpoints 2, 4 and 6 are behind us
DIST_TIMEOUT_S = 20
SLACK_S = 30  # the trainer's way out after the collective fails, and torchrun's teardown
RUN_TIMEOUT_S = 300


def start_node(hosts: Hosts, k: int, run_dir: Path, port: int, log_name: str) -> subprocess.Popen:
    command, env = host_node(hosts, k, run_dir, OVERRIDES, port, SKYSPOT_DIST_TIMEOUT_SECONDS=str(DIST_TIMEOUT_S))
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"{run_dir.name}.{log_name}.txt", "wb")
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def rank0_step(run_dir: Path) -> int:
    try:
        return max([0] + [e["step"] for e in events(run_dir, "step")])
    except ValueError:  # a line being written
        return 0


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
            raise AssertionError(f"a node was still up {timeout:.0f} s on")
    return [p.returncode for p in procs]


def test_a_node_whose_link_goes_silent_stops_the_other_within_the_dist_timeout_and_the_restart_is_exact(
    reference, tmp_path
):
    began = time.monotonic()
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    with Hosts(2) as hosts:
        port = free_port()
        procs = [start_node(hosts, k, dirs[k], port, "first") for k in range(2)]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while rank0_step(dirs[0]) < CUT_AT_STEP:
            assert all(p.poll() is None for p in procs), log_text(dirs[0], "first") + log_text(dirs[1], "first")
            assert time.monotonic() < deadline, f"step {CUT_AT_STEP} not reached: " + log_text(dirs[0], "first")
            time.sleep(0.05)
        hosts.cut(1)
        cut = time.monotonic()
        cut_at = rank0_step(dirs[0])
        deadline = cut + DIST_TIMEOUT_S + SLACK_S
        while procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        noticed_s = time.monotonic() - cut
        print(
            f"node 0 stopped {noticed_s:.1f} s after node 1's link was cut at step {cut_at} (timeout {DIST_TIMEOUT_S} s)"
        )
        assert procs[0].poll() is not None, f"node 0 still up {noticed_s:.0f} s after the cut: " + log_text(
            dirs[0], "first"
        )
        # Not at once: nothing reset node 0's connections; its collective timed out.
        assert DIST_TIMEOUT_S - 1 <= noticed_s < DIST_TIMEOUT_S + SLACK_S, noticed_s
        assert procs[0].returncode != 0, log_text(dirs[0], "first")
        # gloo's own words: the collective's timeout, not a closed or reset connection.
        assert f"Timed out waiting {DIST_TIMEOUT_S * 1000}ms" in log_text(dirs[0], "first"), log_text(dirs[0], "first")
        assert "Connection reset" not in log_text(dirs[0], "first")
        first_codes = wait_all(procs, DIST_TIMEOUT_S + SLACK_S)  # node 1 times out on its own too
        assert first_codes[1] != 0, first_codes
        committed = sorted({e["step"] for e in events(dirs[0], "checkpoint_end")})
        assert committed and max(committed) <= cut_at, (committed, cut_at)

        hosts.heal(1)
        port = free_port()
        procs = [start_node(hosts, k, dirs[k], port, "second") for k in range(2)]
        codes = wait_all(procs, RUN_TIMEOUT_S)
        assert codes == [0, 0], log_text(dirs[0], "second")[-4000:] + log_text(dirs[1], "second")[-4000:]
    resumes = [e for e in events(dirs[0], "resume") if e.get("rank") == 0]
    assert resumes and max(committed) - 2 <= resumes[-1]["step"] <= cut_at, (committed, resumes)
    assert max(e["step"] for e in events(dirs[0], "step")) == STEPS
    assert same_params(dirs[0], reference) == []
    print(f"the test itself took {time.monotonic() - began:.0f} s (not counting the shared reference run)")


def test_the_local_executor_recovers_a_run_whose_node_link_was_cut(reference, monkeypatch):
    """The same fault through `skyspot launch --local --netns --cut-link-at-steps`: the executor runs each node
    in a namespace of its own (SKYPILOT_NODE_IPS their addresses, the metadata server on the bridge), cuts
    node 1's link once rank 0 logged step 7, and recovers onto new machines (links healed): SUCCEEDED, bitwise."""
    from skyspot.events import read_events_dir
    from skyspot.task import render as task
    from tests.reliability.test_node_loss import RDZV_JOIN_S, check_recovered, runner
    from skyspot.cli.main import app
    from skyspot.ledger import Ledger

    monkeypatch.setitem(task.DIST_ENV, "SKYSPOT_DIST_TIMEOUT_SECONDS", str(DIST_TIMEOUT_S))
    monkeypatch.setitem(task.DIST_ENV, "SKYSPOT_RDZV_JOIN_TIMEOUT_SECONDS", str(RDZV_JOIN_S))
    name = "cut-node-1"
    result = runner.invoke(
        app,
        ["launch", "tiny", "--local", "-d", "-n", name, "--provision-delay", "0.5", "--netns"]
        + ["--cut-link-at-steps", f"{CUT_AT_STEP}:1", *OVERRIDES, "resources.num_nodes=2", "resources.cpu_ranks=1"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    run_dir = Path(Ledger().get(name).run_dir)
    first = check_recovered(name, run_dir, reference, STEPS)
    log = read_events_dir(run_dir / "events")
    (cut,) = log.of_type("link_cut_injected")
    assert cut["attempt"] == 1 and cut["node"] == 1 and cut["step"] >= CUT_AT_STEP, cut
    ips = {e["attempt"]: e for e in log.of_type("attempt_start")}
    assert len(ips) == 2
    # Node 0 stopped on the collective timeout (not at once: nothing was reset), then its agent's
    # rendezvous for a restart in place waited out RDZV_JOIN_S before the attempt ended.
    seconds = first["ts"] - cut["ts"]
    print(f"attempt 1 ended {seconds:.1f} s after the cut (collective timeout {DIST_TIMEOUT_S} s)")
    assert DIST_TIMEOUT_S - 1 <= seconds <= DIST_TIMEOUT_S + RDZV_JOIN_S + SLACK_S + 30, seconds
    text = (run_dir / "logs" / "run.log").read_text(errors="replace")
    assert "link cut at step" in text and "Connection reset" not in text, text[-4000:]
    assert "10.213." in text  # the nodes' own addresses, said when the run began
