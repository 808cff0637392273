"""The node's supervisor runs the notice watcher and delivers to the trainer's ranks (issue 19).

Against the real loopback metadata server (skyspot.executors.local.metadata_server) and the real supervisor process;
the command it runs is a small stand-in for the trainer's node leader that follows the notice file
exactly as loop.setup does (PreemptionWatch.follow, take() once per "step").
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from skyspot.executors.local.metadata_server import MetadataServer
from skyspot.trainer import loop
from skyspot.trainer.exit_codes import PREEMPTED, TOKEN_ENV
from skyspot.trainer.preemption import NOTICE_FILE_ENV, NOTICE_FILE_NAME, NoticeFile, PreemptionWatch
from tests.trainer.launch import REPO, trainer_env

CLUSTER = {"aws": "AWS", "gcp": "GCP", "azure": "Azure"}

# The node leader's side, as loop.py wires it: follow the supervisor's file, take() at each step
# boundary, and on an emergency record exit 75 with what it saw. It also says whether the metadata
# server had been asked before it started (the watcher runs before the command).
NODE_LEADER = r"""
import json, os, sys, time
from pathlib import Path
from skyspot.trainer import loop
from skyspot.trainer.exit_codes import write_exit_record
from skyspot.trainer.preemption import PreemptionWatch

run_dir = Path(sys.argv[1])
watch = PreemptionWatch()
watch.install()
assert loop._start_notice_watcher(watch) is None  # supervised: no watcher in the trainer
seen = []
(run_dir / "ready").write_text("ready")
end = time.time() + 60
while time.time() < end:
    pending = watch.take()
    seen.extend(pending.notices)
    if pending.emergency:
        (run_dir / "seen.json").write_text(json.dumps({"notices": seen, "deadline": pending.deadline,
                                                        "signaled": pending.signaled}))
        write_exit_record(run_dir, 75, reason="notice", attempt=1, step=1)
        sys.exit(1)
    time.sleep(0.05)
sys.exit(1)
"""


def supervise(run_dir: Path, cloud: str, metadata: MetadataServer) -> subprocess.Popen:
    env = trainer_env(
        SKYPILOT_CLUSTER_INFO=json.dumps({"cluster_name": "c1", "cloud": CLUSTER[cloud]}),
        SKYSPOT_NOTICE_POLL_SECONDS="0.3" if cloud == "azure" else "0.1",
        **metadata.env_for(cloud),
    )
    command = [
        sys.executable,
        "-m",
        "skyspot.trainer.supervise",
        "--run-dir",
        str(run_dir),
        "--",
        sys.executable,
        "-c",
        NODE_LEADER,
        str(run_dir),
    ]
    return subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < end, f"{path.name} never appeared"
        time.sleep(0.02)


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_supervisor_watches_and_the_node_leader_gets_the_notice_with_its_deadline(tmp_path, cloud):
    with MetadataServer() as metadata:
        (tmp_path / NOTICE_FILE_NAME).write_text(
            json.dumps(
                {
                    "token": "old",
                    "notices": [
                        {
                            "seq": 1,
                            "kind": "emergency",
                            "source": "aws",
                            "action": "terminate",
                            "deadline": 1,
                            "received": 1,
                        }
                    ],
                }
            )
        )
        proc = supervise(tmp_path, cloud, metadata)
        try:
            wait_for(tmp_path / "ready", proc)
            assert metadata.count() > 0  # the supervisor's watcher is asking, the command is not needed for it
            announced = time.time()
            deadline = int(announced) + 90
            metadata.announce_preemption(deadline)
            assert proc.wait(60) == PREEMPTED
        finally:
            if proc.poll() is None:
                proc.kill()
    seen = json.loads((tmp_path / "seen.json").read_text())
    [notice] = seen["notices"]  # the earlier start's file was not taken for this one's
    assert notice["source"] == cloud and not notice.get("warning")
    if cloud == "gcp":  # GCP sends no time: its 30 s window from when the watcher saw it
        assert announced + 29 < seen["deadline"] < announced + 33
    else:  # the cloud's deadline, as in-process
        assert seen["deadline"] == pytest.approx(deadline, abs=1.0)
    assert seen["signaled"] is False  # a notice, not a signal: training through the window stays possible
    if cloud == "azure":  # acted on and ours alone: approved once the command has exited
        assert metadata.start_requests and len(metadata.start_requests) == 1


def test_a_warning_is_an_early_checkpoint_not_an_emergency(tmp_path):
    watch = PreemptionWatch()
    notices = NoticeFile(tmp_path / NOTICE_FILE_NAME, "t1")
    watch.follow(NoticeFile(notices.path, "t1"))
    assert watch.take().notices == []  # no file yet
    notices.request_checkpoint("gcp", "maintenance", 1234.0)
    pending = watch.take()
    assert pending.checkpoint and not pending.emergency
    [warning] = pending.notices
    assert (warning["source"], warning["action"], warning["deadline"], warning["warning"]) == (
        "gcp",
        "maintenance",
        1234.0,
        True,
    )
    assert watch.take().notices == [] and not watch.take().checkpoint  # handed out once
    notices.request_emergency(2000.0, "gcp", "maintenance")
    pending = watch.take()
    assert pending.emergency and pending.deadline == 2000.0 and not pending.checkpoint
    assert [n["action"] for n in pending.notices] == ["maintenance"]


def test_notice_file_from_another_start_or_half_written_is_ignored(tmp_path):
    reader = NoticeFile(tmp_path / NOTICE_FILE_NAME, "mine")
    NoticeFile(reader.path, "other").request_emergency(1.0, "aws")
    assert reader.poll() == []
    reader.path.write_text('{"token": "mine", "notices": [{"seq": 1')  # never written so, but never fatal
    assert reader.poll() == []
    writer = NoticeFile(reader.path, "mine")
    writer.request_emergency(5.0, "aws", "terminate")
    assert [e["deadline"] for e in reader.poll()] == [5.0]
    assert not list(tmp_path.glob(".*.tmp"))  # replaced atomically, nothing left behind


def test_notice_file_survives_concurrent_writes_and_reads(tmp_path):
    """The watcher's threads write while the node leader reads: every entry arrives once, whole."""
    writer, reader = NoticeFile(tmp_path / NOTICE_FILE_NAME, "t"), NoticeFile(tmp_path / NOTICE_FILE_NAME, "t")
    threads = [
        threading.Thread(target=lambda i=i: [writer.request_checkpoint("aws", f"w{i}-{k}") for k in range(50)])
        for i in range(3)
    ]
    got = []
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        got.extend(reader.poll())
    got.extend(reader.poll())
    assert sorted(e["seq"] for e in got) == list(range(1, 151))


def test_unsupervised_trainer_runs_its_own_watcher(monkeypatch):
    """Without SKYSPOT_NOTICE_FILE (torchrun alone, tests/trainer/launch.py supervised=False) the node
    leader watches as before; with it, it starts nothing and follows the file."""
    with MetadataServer() as metadata:
        for key, value in metadata.env_for("aws").items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("SKYPILOT_CLUSTER_INFO", json.dumps({"cloud": "AWS"}))
        monkeypatch.setenv("SKYSPOT_NOTICE_POLL_SECONDS", "0.1")
        monkeypatch.delenv(NOTICE_FILE_ENV, raising=False)
        watch = PreemptionWatch()
        watcher = loop._start_notice_watcher(watch)
        try:
            assert watcher is not None and watcher.is_alive()
            metadata.announce_preemption(time.time() + 60)
            end = time.monotonic() + 10
            while not watch.emergency and time.monotonic() < end:
                time.sleep(0.02)
            assert watch.take().notices[0]["source"] == "aws"
        finally:
            watcher.stop()

        metadata.reset()
        monkeypatch.setenv(NOTICE_FILE_ENV, "/nonexistent/notices.json")
        monkeypatch.setenv(TOKEN_ENV, "t")
        before = metadata.count()
        assert loop._start_notice_watcher(PreemptionWatch()) is None
        time.sleep(0.3)
        assert metadata.count() == before  # no request from the trainer
