"""Shared by the end-to-end trainer tests: one uninterrupted reference run for the whole session."""

from __future__ import annotations

import pytest

from skyspot.events import EventWriter

from tests.trainer.launch import TINY, finish, log_text, start


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """`tiny` trained for TINY's 16 steps without interruption: what every resumed run must equal bitwise."""
    run_dir = tmp_path_factory.mktemp("e2e") / "reference"
    code = finish(start(run_dir, TINY))
    assert code == 0, log_text(run_dir)
    return run_dir


@pytest.fixture(scope="session")
def real_model(tmp_path_factory):
    """A small Llama saved with safetensors, its BPE tokenizer, Alpaca data (and a held-out file it is evaluated
    on) and a recipe file (real_model.py)."""
    from tests.trainer.real_model import build, recipe_file

    root = tmp_path_factory.mktemp("real-model")
    paths = build(root)
    paths["recipe"] = recipe_file(root / "recipe.yaml", paths["model"], paths["alpaca"], held_out=paths["held_out"])
    paths["lora_recipe"] = recipe_file(
        root / "lora.yaml", paths["model"], paths["alpaca"], lora=True, held_out=paths["held_out"]
    )
    return paths


def _trained(run_dir, recipe, overrides):
    code = finish(start(run_dir, overrides, recipe=str(recipe), HF_HUB_OFFLINE="1"))
    assert code == 0, log_text(run_dir)
    return run_dir


@pytest.fixture(scope="session")
def real_reference(real_model, tmp_path_factory):
    """The real model fine-tuned for the recipe's 12 steps on 2 ranks, uninterrupted (evaluated at 4, 8, 12)."""
    return _trained(tmp_path_factory.mktemp("real") / "reference", real_model["recipe"], [])


@pytest.fixture(scope="session")
def lora_reference(real_model, tmp_path_factory):
    """The same with LoRA (merged export on), uninterrupted."""
    return _trained(tmp_path_factory.mktemp("real") / "lora-reference", real_model["lora_recipe"], [])


# A store on each backend's own server (a directory, moto's S3, fake-gcs-server, Azurite), and a trainer's
# event writer: for the uploader's and the fence's tests.
@pytest.fixture(params=["local", "s3", "gs", "az"])
def store_uri(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "bucket")
    return request.getfixturevalue(
        {"s3": "s3_server", "gs": "gcs_server", "az": "azure_server"}[request.param]
    ).bucket()


@pytest.fixture
def events(tmp_path):
    writer = EventWriter(tmp_path / "run", "run-1", attempt=1, node_rank=0, rank=0)
    yield writer
    writer.close()
