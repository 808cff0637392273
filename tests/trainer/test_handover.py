"""A new stage's nodes wait for the stage they replace (trainer/handover.py): the node's side of a deadline's
make-before-break on SkyPilot. The real module in a real process, over a real store (a local directory; the
store protocol is the same for the buckets: tests/storage)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from skyspot.storage import open_store
from skyspot.trainer.handover import handover_key

from tests.conftest import REPO


def _start(store_dir, token: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "SKYSPOT_HANDOVER": token,
        "SKYSPOT_RUN_NAME": "due",
        "SKYSPOT_HANDOVER_POLL_SECONDS": "0.1",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "skyspot.trainer.handover", "tiny", f"storage.store={store_dir}"],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_the_nodes_wait_until_the_controller_writes_the_handover(tmp_path):
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    waiting = _start(store_dir, "stage-1-spot")
    time.sleep(3.0)  # the module's start-up and many polls
    assert waiting.poll() is None, waiting.communicate()[0]  # still waiting: nothing was handed over
    written = time.time()
    open_store(str(store_dir)).put_bytes(handover_key("due", "stage-1-spot"), b"{}")
    out, _ = waiting.communicate(timeout=30)
    assert waiting.returncode == 0 and time.time() >= written
    assert "waiting for the stage it replaces to checkpoint and stop (handover stage-1-spot)" in out
    assert "has stopped: starting" in out


def test_a_stage_recovered_later_finds_its_handover_and_starts_at_once(tmp_path):
    store_dir = tmp_path / "store"
    open_store(str(store_dir)).put_bytes(handover_key("due", "stage-1-spot"), b"{}")
    done = _start(store_dir, "stage-1-spot")
    out, _ = done.communicate(timeout=60)
    assert done.returncode == 0 and "waiting" not in out


def test_a_token_that_is_no_object_name_is_refused_in_one_line(tmp_path):
    refused = _start(tmp_path, "../../other-run/checkpoints")
    out, _ = refused.communicate(timeout=60)
    assert refused.returncode == 2 and out.count("\n") == 1 and "Traceback" not in out


def test_dot_tokens_and_a_run_name_that_is_a_path_are_refused(tmp_path):
    for token in ("..", ".", ".hidden"):
        refused = _start(tmp_path, token)
        out, _ = refused.communicate(timeout=60)
        assert refused.returncode == 2 and out.count("\n") == 1 and "Traceback" not in out, (token, out)


def test_the_nodes_give_up_when_no_handover_comes(tmp_path, monkeypatch):
    monkeypatch.setenv("SKYSPOT_HANDOVER_TIMEOUT_SECONDS", "1")
    (tmp_path / "store").mkdir()
    waited = _start(tmp_path / "store", "stage-abc")
    out, _ = waited.communicate(timeout=60)
    assert waited.returncode == 1 and "no handover stage-abc within 1s: giving up" in out


@pytest.mark.slow  # a real start of tiny: DeepSpeed under torchrun, about half a minute
def test_the_rendered_run_script_waits_for_its_handover_then_trains(tmp_path):
    """The task's own `run` (task/render.py), as a node runs it with SKYSPOT_HANDOVER set: nothing of the
    trainer starts, nothing is written to the store, until the controller's handover is there; then it trains."""
    from skyspot.app.launch import build
    from skyspot.ports import free_port
    from tests.trainer.launch import trainer_env

    store_dir, run_dir = tmp_path / "store", tmp_path / "node"
    store_dir.mkdir()
    task = build(
        "tiny", ["train.steps=4", "checkpoint.every_steps=2"], run_name="due", flags={"storage.store": str(store_dir)}
    ).task
    env = trainer_env(
        SKYSPOT_PYTHON=sys.executable,
        SKYSPOT_RUN_NAME="due",
        SKYSPOT_RUN_DIR=str(run_dir),
        SKYSPOT_HANDOVER="stage-0123456789abcdef",
        SKYSPOT_HANDOVER_POLL_SECONDS="0.2",
        SKYSPOT_MASTER_PORT=str(free_port()),
        SKYPILOT_NODE_RANK="0",
        SKYPILOT_NODE_IPS="127.0.0.1",
        SKYPILOT_NUM_NODES="1",
        SKYPILOT_NUM_GPUS_PER_NODE="0",
    )
    node = subprocess.Popen(
        ["bash", "-c", task["run"]], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    time.sleep(8.0)
    assert node.poll() is None
    assert not (run_dir / "events").exists() and not any(store_dir.rglob("*"))  # nothing started, nothing written
    written = time.time()
    open_store(str(store_dir)).put_bytes(handover_key("due", "stage-0123456789abcdef"), b"{}")
    out, _ = node.communicate(timeout=300)
    assert node.returncode == 0, out[-3000:]
    assert "waiting for the stage it replaces" in out and "has stopped: starting" in out
    events = [
        json.loads(line) for f in sorted((run_dir / "events").glob("*.jsonl")) for line in f.read_text().splitlines()
    ]
    assert events and min(e["ts"] for e in events) >= written
    assert max(e["step"] for e in events if e["type"] == "step") == 4
