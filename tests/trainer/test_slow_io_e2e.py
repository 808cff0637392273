"""No rank waits inside the default process group for one rank's I/O (comm.py's I/O group).

With the distributed timeout at 20 s (SKYSPOT_DIST_TIMEOUT_SECONDS, 600 s on a cloud), a 2-rank run
of the real test model (real_model.py) whose slow I/O each takes longer than that:

    A  a fresh start: node 0's leader downloads the base model from the hub (tests/hub_server.py,
       behind tests/throttle.py's proxy at a rate that makes the weights take ~IO_S s) while rank 1
       waits; SIGTERM at step 6: both ranks save step 6, upload it to moto's S3 and exit 75
    B  a new machine (fresh run directory, empty Hugging Face cache), the store now throttled so that
       fetching the checkpoint takes ~IO_S s: the node leader fetches it while rank 1 waits; trains
       to the end, and final/ and every step's loss equal the uninterrupted reference bitwise

Without the I/O group, rank 1 would hit gloo's 20 s timeout in A's download or B's fetch.
"""

from __future__ import annotations

import os
import signal

import pytest

from skyspot.storage import open_store
from skyspot.trainer.exit_codes import PREEMPTED
from tests.throttle import ThrottledProxy
from tests.trainer.launch import events, finish, log_text, start, wait_for_file
from tests.trainer.real_model import HUB_ID, recipe_file
from tests.trainer.test_real_model import assert_equal_tensors, safetensors_of, steps

pytestmark = pytest.mark.slow

DIST_TIMEOUT_S = 20
IO_S = 26  # each throttled I/O: longer than the timeout, no longer than that proves


def test_slow_base_download_and_checkpoint_fetch_outlast_the_distributed_timeout(
    real_model, real_reference, s3_server, fake_hub, tmp_path
):
    fake_hub.serve(HUB_ID, real_model["model"])
    weights = sum(p.stat().st_size for p in real_model["model"].glob("*.safetensors"))
    hub = ThrottledProxy(fake_hub.server.server_address[1], rate=weights / IO_S)
    store = ThrottledProxy(s3_server.port)  # unthrottled until B
    uri = f"{s3_server.bucket()}/runs"
    recipe = recipe_file(tmp_path / "recipe.yaml", HUB_ID, real_model["alpaca"], store=uri)
    args = ["--run-name", "slow-io"]
    env = dict(
        SKYSPOT_DIST_TIMEOUT_SECONDS=str(DIST_TIMEOUT_S),
        HF_ENDPOINT=hub.url,
        AWS_ENDPOINT_URL=store.url,
        HF_HUB_DOWNLOAD_TIMEOUT="60",
        HF_HUB_ETAG_TIMEOUT="60",
        SKYSPOT_STORE_RETRY_MAX_SECONDS="1",
        SKYSPOT_EVENTS_SYNC_SECONDS="1",
    )
    try:
        # A: the weights come from the slow hub; SIGTERM while rank 0 holds at the end of step 6.
        first, faults = tmp_path / "node-a" / "run", tmp_path / "faults"
        proc = start(
            first,
            args,
            recipe=str(recipe),
            HF_HOME=str(tmp_path / "node-a" / "hf"),
            SKYSPOT_FAULT="step_end@6/0:pause=3",
            SKYSPOT_FAULT_DIR=str(faults),
            **env,
        )
        wait_for_file(faults / "step_end@6.rank0", proc, timeout=240)
        os.killpg(proc.pid, signal.SIGTERM)  # the supervisor forwards it to torchrun's group
        assert finish(proc) == PREEMPTED, log_text(first)
        loaded = [e for e in events(first, "base_model") if e["weights"]]
        assert loaded and loaded[0]["source"] == "hub" and loaded[0]["seconds"] > DIST_TIMEOUT_S, loaded

        # B: a new machine; the checkpoint (node 0's whole part) comes from the slow store.
        remote = open_store(uri)
        part = sum(len(remote.get_bytes(key) or b"") for key in remote.list("slow-io/checkpoints/step_6/"))
        store.rate = part / IO_S
        second = tmp_path / "node-b" / "run"
        code = finish(
            start(second, args, recipe=str(recipe), HF_HOME=str(tmp_path / "node-b" / "hf"), **env), timeout=300
        )
        assert code == 0, log_text(second)
    finally:
        hub.stop()
        store.stop()
        fake_hub.withdraw(HUB_ID)
    resumed = events(second, "resume")
    assert [(e["step"], e["source"]) for e in resumed] == [(6, "store")]
    assert resumed[0]["find_seconds"] > DIST_TIMEOUT_S, resumed
    assert_equal_tensors(safetensors_of(second / "final"), safetensors_of(real_reference / "final"))
    reference = steps(real_reference)
    assert steps(second) == reference[6:] and steps(first) == reference[:6]
