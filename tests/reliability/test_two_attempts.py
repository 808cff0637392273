"""Two attempts of one run alive at once, on one store (issue 34): the older one's commits after the
newer one started are refused, it exits STALE, `status` and `cost-report` count it, and the run ends
bitwise equal to an uninterrupted one. On the local store and on each store's own server (moto's S3,
fake-gcs-server, Azurite: each honours the conditional writes the fence needs, tests/storage/test_conditional.py).

How the overlap comes about on a cloud: SkyPilot's controller relaunches on status-check timeouts while
the old cluster still trains (skypilot-org/skypilot #10123, #10664). Here the two attempts are two real
nodes (supervisor, torchrun, 2 CPU ranks), each with its own disk: attempt A is held at the end of step
10 (checkpoints 4 and 8 durable), attempt B starts on a fresh disk and takes the store, then A goes on."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.ledger import Ledger
from skyspot.storage import open_store
from skyspot.trainer import fence
from skyspot.trainer.exit_codes import STALE
from skyspot.trainer.remote import remote_checkpoints
from tests.reliability.conftest import STEPS, same_params
from tests.trainer.launch import finish, log_text, start

pytestmark = pytest.mark.slow
runner = CliRunner()
HOLD_AT = 10


def _wait(what: str, done, proc, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return
        assert proc.poll() is None, f"the attempt ended (code {proc.returncode}) before {what}"
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


@pytest.mark.parametrize("backend", ["local", "s3", "gs", "az"])
def test_the_older_of_two_live_attempts_is_refused_and_exits_stale(backend, request, tmp_path, reference, monkeypatch):
    uri = (
        str(tmp_path / "bucket")
        if backend == "local"
        else request.getfixturevalue({"s3": "s3_server", "gs": "gcs_server", "az": "azure_server"}[backend]).bucket()
    )
    store = open_store(uri)
    overrides = [f"train.steps={STEPS}", "checkpoint.every_steps=4", "train.log_every=4", f"storage.store={uri}"]
    faults = tmp_path / "faults"
    older = start(
        tmp_path / "a" / "run", overrides, SKYSPOT_FAULT=f"step_end@{HOLD_AT}:hold=300", SKYSPOT_FAULT_DIR=str(faults)
    )
    _wait(
        "A holds at step 10 with checkpoint 8 durable",
        lambda: len(list(faults.glob(f"step_end@{HOLD_AT}.rank*"))) == 2 and 8 in remote_checkpoints(store, "run"),
        older,
    )
    assert fence.read(store, "run")["epoch"] == 1

    newer = start(tmp_path / "b" / "run", overrides)  # a fresh disk: it resumes from the store alone
    _wait("B holds the store", lambda: fence.read(store, "run")["epoch"] == 2, newer)
    for fired in faults.glob(f"step_end@{HOLD_AT}.rank*"):
        (fired.parent / (fired.name + ".release")).touch()  # A goes on, as an old cluster that was not gone

    assert finish(older, timeout=240) == STALE, log_text(tmp_path / "a" / "run")[-3000:]
    assert finish(newer, timeout=400) == 0, log_text(tmp_path / "b" / "run")[-3000:]
    text = log_text(tmp_path / "a" / "run")
    assert "a newer attempt (epoch 2) holds the run's store" in text, text[-3000:]

    doc = fence.read(store, "run")
    assert all(set(by.values()) == {2} for step, by in doc["commits"].items() if int(step) > 8), doc
    assert max(remote_checkpoints(store, "run")) == STEPS
    resumed = [
        json.loads(line)
        for path in (tmp_path / "b" / "run" / "events").glob("*.jsonl")
        for line in path.read_text().splitlines()
        if '"resume"' in line
    ]
    assert [e["step"] for e in resumed if e["type"] == "resume"] == [8]
    assert same_params(tmp_path / "b" / "run", reference) == []
    stale = [e for e in store.list("run/stale/")]
    assert stale == ["run/stale/epoch-1.node-0.jsonl"]

    # What status and the cost report say of it: read from the store, as for a cloud run (no job id: SkyPilot
    # is not asked).
    home = tmp_path / "home"
    monkeypatch.setenv("SKYSPOT_HOME", str(home))
    home.mkdir(mode=0o700)
    with Ledger(home / "ledger.db") as ledger:
        ledger.add("run", "tiny", "sky", store=uri, total_steps=STEPS, num_nodes=1, info={"cloud": "aws"})
        ledger.set_status("run", "SUCCEEDED")
    status = runner.invoke(app, ["status", "-a", "--json"])
    assert status.exit_code == 0, status.output
    row = next(r for r in json.loads(status.stdout) if r["name"] == "run")
    assert row["interruptions"].get("stale") == 1, row
    report = runner.invoke(app, ["cost-report", "run", "--json"])
    assert report.exit_code == 0, report.output
    data = json.loads(report.stdout)[0]
    assert data["interruptions_by_cause"] == {"stale": 1} and data["preemptions"] == 0, data
    assert [a["end_reason"] for a in data["attempts"]] == ["stale", "complete"]
