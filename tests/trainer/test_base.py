"""Where a node finds the base model's files: a local directory, its own earlier fetch, the run's copy in
the store (through the mount, or downloaded), or the hub; and the copy the first start leaves in the store.

The node leader's part (`_locate`) and the copy (`_copy`) run here without torch.distributed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skyspot.errors import UsageError
from skyspot.recipe import load_recipe
from skyspot.trainer.base import BASE_DIR, COMPLETE, BaseModel
from skyspot.trainer.cluster import Placement
from skyspot.trainer.durable import StoreTier
from tests.trainer.real_model import HUB_ID, plant_in_hub_cache, recipe_file

PLACEMENT = Placement(rank=0, world_size=1, local_rank=0, node_rank=0, num_nodes=1)
FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"w" * 100, "tokenizer.json": b"{}"}


@pytest.fixture
def model_dir(tmp_path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    for name, data in FILES.items():
        (directory / name).write_bytes(data)
    return directory


@pytest.fixture
def offline_cache(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return plant_in_hub_cache(model_dir, tmp_path / "hf" / "hub")


def base(tmp_path, store, run_dir="run", model=HUB_ID, environ=None):
    recipe = load_recipe(str(recipe_file(tmp_path / "r.yaml", model, tmp_path / "d.jsonl", store=store)), environ={})
    tier = StoreTier(str(store), "run-1", PLACEMENT) if store else None
    (tmp_path / run_dir).mkdir(exist_ok=True)
    import os

    return BaseModel(
        recipe,
        tmp_path / run_dir,
        PLACEMENT,
        None,
        tier=tier,
        say=lambda line: None,
        environ=environ if environ is not None else os.environ,
    )


def test_the_first_start_fetches_from_the_hub_pins_the_commit_and_copies_into_the_store(tmp_path, offline_cache):
    store = tmp_path / "store"
    first = base(tmp_path, store)
    path, source, commit = first._locate(True)
    assert (path, source, commit) == (offline_cache, "hub", "0" * 40)
    first.path, first.source, first.commit, first.weights = path, source, commit, True
    first._copy()
    record = json.loads((store / "run-1" / BASE_DIR / COMPLETE).read_text())
    assert record["commit"] == "0" * 40 and record["files"] == {n: len(d) for n, d in FILES.items()}
    # the same disk again: its own fetch, pinned in DIR/base.json
    assert base(tmp_path, store)._locate(True)[1] == "cache"


def test_a_new_node_reads_the_stores_copy_through_the_mount_without_the_hub(tmp_path, offline_cache, model_dir):
    store = tmp_path / "store"
    first = base(tmp_path, store)
    first.path, first.source, first.commit, first.weights = offline_cache, "hub", "0" * 40, True
    first._copy()
    import shutil

    shutil.rmtree(tmp_path / "hf")  # no cache on the new machine, and HF_HUB_OFFLINE: the hub is out of reach
    path, source, commit = base(tmp_path, store, run_dir="new-node")._locate(True)
    assert (path, source, commit) == (store / "run-1" / BASE_DIR, "store mount", "0" * 40)


def test_without_a_mount_the_copy_is_downloaded_and_only_what_is_needed(tmp_path, s3_server, model_dir):
    bucket = s3_server.bucket()
    store = f"{bucket}/runs"
    from skyspot.storage import open_store

    remote = open_store(store)
    remote.upload_dir(model_dir, f"run-1/{BASE_DIR}", list(FILES))
    remote.put_bytes(
        f"run-1/{BASE_DIR}/{COMPLETE}",
        json.dumps(
            {"repo": HUB_ID, "revision": None, "commit": "c" * 40, "files": {n: len(d) for n, d in FILES.items()}}
        ).encode(),
    )
    node = base(tmp_path, store, environ={})
    path, source, _ = node._locate(False)  # config and tokenizer only
    assert (path, source) == (tmp_path / "run" / BASE_DIR, "store")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "tokenizer.json"]
    assert node._locate(True) == (path, "store", "c" * 40)  # the weights, when needed, join them
    assert (path / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    # the task's bucket mount, when there is one, is read in place for the config and tokenizer
    mount = tmp_path / "mount"
    (mount / "run-1").mkdir(parents=True)
    (mount / "run-1" / BASE_DIR).symlink_to(model_dir)
    mounted = base(tmp_path, store, run_dir="mounted", environ={"SKYSPOT_STORE_MOUNT": str(mount)})
    assert mounted._locate(False)[:2] == (mount / "run-1" / BASE_DIR, "store mount")


def test_the_weights_are_copied_to_the_local_disk_never_mmapped_through_the_mount(tmp_path, s3_server, model_dir):
    """LoRA's frozen base (and a fresh start on a new node): rank 0 would otherwise page 141 GB in through
    the FUSE mount while every other rank waits; the SDK downloads it into DIR/base/ first, in parallel."""
    store = f"{s3_server.bucket()}/runs"
    from skyspot.storage import open_store

    remote = open_store(store)
    remote.upload_dir(model_dir, f"run-1/{BASE_DIR}", list(FILES))
    remote.put_bytes(
        f"run-1/{BASE_DIR}/{COMPLETE}",
        json.dumps(
            {"repo": HUB_ID, "revision": None, "commit": "c" * 40, "files": {n: len(d) for n, d in FILES.items()}}
        ).encode(),
    )
    mount = tmp_path / "mount"
    (mount / "run-1").mkdir(parents=True)
    (mount / "run-1" / BASE_DIR).symlink_to(model_dir)
    node = base(tmp_path, store, run_dir="lora", environ={"SKYSPOT_STORE_MOUNT": str(mount)})
    node.path, node.source = node._locate(False)[:2]  # prepare(weights=False) keeps what it found
    assert node.source == "store mount"
    path, source, commit = node._locate(True)
    assert (path, source, commit) == (tmp_path / "lora" / BASE_DIR, "store", "c" * 40)
    assert (path / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    # a pin left by an earlier start that read the mount is not taken for the weights either
    node._pin(mount / "run-1" / BASE_DIR, "c" * 40)
    node.path = None
    assert node._locate(True)[:2] == (tmp_path / "lora" / BASE_DIR, "store")


def test_an_incomplete_copy_is_not_used(tmp_path, offline_cache):
    store = tmp_path / "store"
    (store / "run-1" / BASE_DIR).mkdir(parents=True)
    (store / "run-1" / BASE_DIR / "config.json").write_text("{}")  # no BASE.json: a copy cut short
    assert base(tmp_path, store)._locate(True)[1] == "hub"


def test_a_gated_hub_model_without_a_token_fails_before_any_download(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    node = base(tmp_path, None, model="meta-llama/Llama-3.1-8B")
    node.section = node.section.model_copy(update={"gated": True})
    with pytest.raises(UsageError, match="is gated: export HF_TOKEN"):
        node._locate(True)
    assert not (tmp_path / "hf").exists()


def test_a_local_directory_is_read_in_place(tmp_path, model_dir):
    assert base(tmp_path, tmp_path / "store", model=model_dir)._locate(True) == (model_dir, "local", None)
