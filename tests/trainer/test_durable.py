"""The store tier from the trainer's side, without torchrun: start-up probe, resume across tiers, deadlines.

The checkpoint manager runs here as a world of one (its collectives are the identity); checkpoints
are written in the real format (manifest.py) and go through the real uploader and store.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from skyspot.errors import CheckpointError, StoreError
from skyspot.recipe import load_recipe
from skyspot.storage import open_store
from skyspot.trainer import manifest as mf
from skyspot.trainer import rundir
from skyspot.trainer.checkpoint import CheckpointManager
from skyspot.trainer.cluster import Placement
from skyspot.trainer.durable import EXIT_MARGIN_S, StoreTier, emergency_deadline
from skyspot.trainer.remote import remote_checkpoints
from skyspot.trainer.uploader import Uploader

RUN = "run-1"
ONE = Placement(rank=0, world_size=1, local_rank=0, node_rank=0, num_nodes=1)
NO_RETRIES = dict(attempts=1, base_delay=0.01, max_delay=0.01)


class OneRank:
    """The Comm of a world of one."""

    def all_gather_object(self, obj):
        return [obj]

    io_gather = all_gather_object

    def barrier(self):
        pass


def write_checkpoint(root: Path, step: int) -> Path:
    """A committed checkpoint as the writer leaves it: files, manifest.json, COMMITTED last."""
    directory = root / mf.step_dir_name(step)
    directory.mkdir(parents=True)
    files = {}
    for name in ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "trainer_state_rank_0.pt"):
        data = os.urandom(4096)
        (directory / name).write_bytes(data)
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "rank": 0}
    sha = mf.write_manifest(directory, {"step": step, "files": files, "world_size": 1, "num_nodes": 1})
    mf.write_marker(directory, step, sha)
    return directory


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def bucket(tmp_path):
    """A store holding durable steps 4 and 8 of RUN, uploaded by the real uploader."""
    store = open_store(tmp_path / "bucket")
    uploader = Uploader(store, RUN, keep=None, retry_base_delay=0.01, retry_max_delay=0.05)
    for step in (4, 8):
        uploader.submit(step, write_checkpoint(tmp_path / "origin", step))
        assert uploader.wait(timeout=30)
    assert uploader.close()
    return store


def manager(run_dir: Path, store=None, tier=None) -> tuple[CheckpointManager, list[str]]:
    said: list[str] = []
    if store is not None:
        tier = StoreTier(store.uri, RUN, ONE, store=store)
        tier.adopt(tier.probe(retries=NO_RETRIES))
    ckpt = CheckpointManager(
        run_dir,
        ONE,
        load_recipe("tiny"),
        run_id=RUN,
        attempt=1,
        events=None,
        comm=OneRank(),
        warn=said.append,
        resume_source=tier,
    )
    return ckpt, said


def test_a_fresh_run_dir_resumes_from_the_newest_durable_checkpoint_in_the_store(bucket, tmp_path):
    ckpt, said = manager(tmp_path / "fresh", bucket)
    point = ckpt.find()
    assert (point.step, point.source) == (8, "store")
    assert mf.inspect(point.path).state == "valid"
    assert said == []


def test_a_newer_local_checkpoint_wins_and_is_not_downloaded(bucket, tmp_path):
    write_checkpoint(tmp_path / "run" / "checkpoints", 12)
    ckpt, _ = manager(tmp_path / "run", bucket)
    point = ckpt.find()
    assert (point.step, point.source) == (12, "local")
    assert not (tmp_path / "run" / "checkpoints" / "step_8").exists()


def test_a_corrupt_remote_shard_falls_back_to_the_previous_durable_checkpoint_with_one_line(bucket, tmp_path):
    key = f"{RUN}/checkpoints/step_8/trainer_state_rank_0.pt"
    flip_byte(Path(bucket.uri) / key)
    ckpt, said = manager(tmp_path / "fresh", bucket)
    point = ckpt.find()
    assert (point.step, point.source) == (4, "store")
    assert said == [
        f"node 0: checkpoint step_8 in {bucket.uri}: file 'trainer_state_rank_0.pt' is corrupt "
        "(sha256 does not match the manifest); falling back to an earlier checkpoint"
    ]
    assert not (tmp_path / "fresh" / "checkpoints" / "step_8").exists()  # nothing half-downloaded left


def test_a_corrupt_local_copy_is_replaced_by_the_stores(bucket, tmp_path):
    local = write_checkpoint(tmp_path / "run" / "checkpoints", 8)
    flip_byte(local / "trainer_state_rank_0.pt")
    ckpt, said = manager(tmp_path / "run", bucket)
    point = ckpt.find()
    assert (point.step, point.source) == (8, "store")
    assert mf.inspect(point.path).state == "valid"
    assert any("local step_8 corrupt" in line for line in said)


def test_every_checkpoint_unusable_in_both_tiers_refuses_to_start_over(bucket, tmp_path):
    for step in (4, 8):
        flip_byte(Path(bucket.uri) / RUN / "checkpoints" / f"step_{step}" / "trainer_state_rank_0.pt")
    ckpt, _ = manager(tmp_path / "fresh", bucket)
    with pytest.raises(CheckpointError, match="none is usable"):
        ckpt.find()


def test_unreachable_store_at_start_resumes_locally_or_refuses_to_start_over(s3_server, tmp_path, monkeypatch):
    from skyspot.storage import S3Store

    s3 = S3Store(s3_server.bucket()[5:], sdk_attempts=1)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    tier = StoreTier(s3.uri, RUN, ONE, store=s3)
    probe = tier.probe(retries=NO_RETRIES)
    assert probe.attempt is None and probe.remote_steps is None and probe.usage_error is None
    assert probe.warning.startswith(f"cannot reach the store {s3.uri}/{RUN}") and "resuming from local" in probe.warning

    write_checkpoint(tmp_path / "run" / "checkpoints", 4)
    for run_dir, expected in ((tmp_path / "run", 4), (tmp_path / "fresh", None)):
        tier.adopt(probe)
        ckpt, _ = manager(run_dir, tier=tier)
        if expected is None:
            with pytest.raises(StoreError, match="no node has a local checkpoint: nothing was started"):
                ckpt.find()
        else:
            assert ckpt.find().step == expected


def test_missing_credentials_are_a_usage_error_with_one_line(s3_server, tmp_path, monkeypatch):
    uri = s3_server.bucket()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    probe = StoreTier(uri, RUN, ONE).probe(retries=NO_RETRIES)
    assert probe.usage_error.startswith(f"store {uri}/{RUN}: cannot list")
    assert "no AWS credentials found" in probe.usage_error and "\n" not in probe.usage_error


def test_probe_counts_attempts_in_the_store_and_fresh_never_clobbers_it(bucket):
    tier = StoreTier(bucket.uri, RUN, ONE, store=bucket)
    assert [tier.probe(retries=NO_RETRIES).attempt for _ in range(2)] == [1, 2]
    assert tier.probe(retries=NO_RETRIES).remote_steps == [4, 8]
    refused = tier.probe(fresh=True, retries=NO_RETRIES)
    assert "--fresh cannot start 'run-1' over" in refused.usage_error and "steps 4, 8" in refused.usage_error
    assert remote_checkpoints(bucket, RUN) == [4, 8]
    assert StoreTier(bucket.uri, "other", ONE, store=bucket).probe(fresh=True, retries=NO_RETRIES).attempt == 1


def test_local_attempt_counter_ignores_the_executors_event_files(tmp_path):
    events = tmp_path / "events"
    events.mkdir()
    (events / "attempt-1.executor.jsonl").write_text("{}\n")
    assert rundir.next_attempt(tmp_path) == 1  # the first start is attempt 1, not 2
    (tmp_path / "attempts.json").unlink()
    (events / "attempt-3.node-0.rank-1.jsonl").write_text("{}\n")
    (events / "attempt-7.executor.jsonl").write_text("{}\n")
    assert rundir.next_attempt(tmp_path) == 4


def test_emergency_deadline_is_the_notices_or_the_clouds_window_capped_by_torchrun():
    assert emergency_deadline(1000.0, 990.0, "aws", {}) == 1000.0 - EXIT_MARGIN_S
    assert emergency_deadline(None, 990.0, "aws", {}) == 990.0 + 120 - EXIT_MARGIN_S
    assert emergency_deadline(None, 990.0, "gcp", {}) == 990.0 + 30 - EXIT_MARGIN_S
    assert emergency_deadline(None, 990.0, "unknown", {}) == 990.0 + 30 - EXIT_MARGIN_S
    assert (
        emergency_deadline(None, 990.0, "aws", {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60"}) == 990.0 + 60 - EXIT_MARGIN_S
    )


def test_a_nodes_part_is_split_among_its_ranks_by_bytes_the_same_everywhere():
    from skyspot.trainer.remote import shares

    files = {
        "optim_0.pt": {"size": 900},
        "optim_1.pt": {"size": 900},
        "model_0.pt": {"size": 100},
        "model_1.pt": {"size": 100},
        "trainer_state_rank_0.pt": {"size": 10},
    }
    split = shares(files, 2)
    assert sorted(sum(split, [])) == sorted(files)  # every file once
    assert [sum(files[f]["size"] for f in share) for share in split] == [1010, 1000]
    assert split == shares(dict(reversed(files.items())), 2)  # whatever order the manifest lists them in
    assert shares(files, 1) == [sorted(files, key=lambda f: (-files[f]["size"], f))]
    assert shares({}, 3) == [[], [], []]
