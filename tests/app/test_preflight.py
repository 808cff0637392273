"""Preflight: every problem a run would meet at its start, told in one line before anything is paid for.

The hub here is tests/hub_server.py's fake on loopback (HF_ENDPOINT); "unreachable" is a closed port.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.errors import UsageError
from skyspot.app.preflight import preflight
from skyspot.recipe import load_recipe
from tests.hub_server import COMMIT, DENIED_TOKEN
from tests.trainer.real_model import alpaca_records, plant_in_hub_cache, recipe_file

runner = CliRunner()


def recipe(name: str, *overrides: str):
    return load_recipe(name, list(overrides), environ={})


def line_of(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A directory that looks like save_pretrained's output (the loader itself is tested end to end)."""
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (directory / "model.safetensors").write_bytes(b"")
    return directory


def test_a_gated_model_without_hf_token_is_one_line_before_any_request(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")  # never asked
    with pytest.raises(UsageError) as error:
        preflight(recipe("llama8b"), local=True)
    assert line_of(error).startswith("model.hub_id meta-llama/Llama-3.1-8B is gated: export HF_TOKEN=hf_...")


def test_a_token_without_access_to_a_gated_model_says_to_accept_the_licence(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", DENIED_TOKEN)
    with pytest.raises(UsageError, match="has no access: accept its licence at https://huggingface.co/meta-llama"):
        preflight(recipe("llama8b"), local=True)


def test_an_accessible_model_and_dataset_pass(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_ok")
    preflight(recipe("llama70b-lora"), local=False)
    preflight(recipe("smollm2-360m"), local=False)  # ungated: no token needed
    monkeypatch.delenv("HF_TOKEN")
    preflight(recipe("smollm2-360m"), local=False)


def test_an_unreachable_hub_fails_fast_with_one_line(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    started = time.monotonic()
    with pytest.raises(UsageError) as error:
        preflight(recipe("smollm2-360m"), local=False)
    assert time.monotonic() - started < 5
    assert line_of(error).startswith("cannot reach the Hugging Face hub at http://127.0.0.1:")
    assert "(connection refused)" in line_of(error) and "HF_HUB_OFFLINE=1" in line_of(error)


def test_hf_hub_offline_never_asks_the_hub_and_needs_the_cache(monkeypatch, tmp_path, model_dir):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")  # any request would fail loudly
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    smol = recipe("smollm2-360m", "data.source=/nonexistent.jsonl")
    with pytest.raises(
        UsageError,
        match=r"HF_HUB_OFFLINE is set and model.hub_id HuggingFaceTB/SmolLM2-360M is "
        r"not in the Hugging Face cache",
    ):
        preflight(smol, local=True)
    plant_in_hub_cache(model_dir, tmp_path / "hf" / "hub", "HuggingFaceTB/SmolLM2-360M")
    with pytest.raises(UsageError, match="data.source '/nonexistent.jsonl' is not 'synthetic'"):
        preflight(smol, local=True)  # the model is found in the cache; the next problem is the data


def test_unknown_models_revisions_and_weights_are_named(monkeypatch):
    with pytest.raises(UsageError, match="acme/nothing: no such model on http://127.0.0.1"):
        preflight(recipe("smollm2-360m", "model.hub_id=acme/nothing"), local=False)
    with pytest.raises(UsageError, match="model.revision 'v9' does not exist in HuggingFaceTB/SmolLM2-360M"):
        preflight(recipe("smollm2-360m", "model.revision=v9"), local=False)
    preflight(recipe("smollm2-360m", f"model.revision={COMMIT}"), local=False)
    with pytest.raises(UsageError, match="acme/bin-only has no safetensors weights"):
        preflight(recipe("smollm2-360m", "model.hub_id=acme/bin-only"), local=False)
    with pytest.raises(UsageError, match="data.source hf://acme/no-data: no such dataset"):
        preflight(recipe("smollm2-360m", "data.source=hf://acme/no-data"), local=False)


def test_local_directories_and_files(tmp_path, model_dir):
    data = tmp_path / "alpaca.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in alpaca_records(3)))
    path = recipe_file(tmp_path / "r.yaml", model_dir, data)
    preflight(load_recipe(str(path), environ={}), local=True)
    with pytest.raises(UsageError, match=f"model.hub_id {tmp_path}/gone is not a directory on this machine"):
        preflight(load_recipe(str(path), [f"model.hub_id={tmp_path}/gone"], environ={}), local=True)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(UsageError, match="has no \\*.safetensors weights"):
        preflight(load_recipe(str(path), environ={}), local=True)
    with pytest.raises(UsageError, match="is a directory on this machine, which a cloud node does not have"):
        preflight(load_recipe(str(path), environ={}), local=False)


def test_a_held_out_file_is_checked_as_the_source_is(tmp_path, model_dir):
    data, held = tmp_path / "alpaca.jsonl", tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in alpaca_records(3)))
    held.write_text(json.dumps({"prompt": "x"}) + "\n")
    path = recipe_file(tmp_path / "r.yaml", model_dir, data, held_out=held)
    with pytest.raises(UsageError) as error:
        preflight(load_recipe(str(path), environ={}), local=True)
    assert f"{held}:1: data.format=alpaca needs string fields" in line_of(error)
    with pytest.raises(UsageError, match=f"data.eval_split '{tmp_path}/gone.jsonl' is not an existing file"):
        preflight(load_recipe(str(path), [f"data.eval_split={tmp_path}/gone.jsonl"], environ={}), local=True)
    held.write_text(json.dumps(alpaca_records(1)[0]) + "\n")
    preflight(load_recipe(str(path), environ={}), local=True)


@pytest.mark.parametrize(
    "records, overrides, message",
    [
        (
            [{"prompt": "x", "completion": "y"}],
            ["data.format=alpaca"],
            "data.format=alpaca needs string fields instruction and output (and optionally input); this record has: "
            "completion, prompt",
        ),
        ([{"body": "x"}], ["data.format=text"], "needs a string field 'text' (fields: body); set data.text_field"),
        ([{"conversation": []}], ["data.format=chat", "model.tokenizer=/tok"], "needs a list field 'messages'"),
        (
            [{"messages": [{"role": "user", "content": "hi"}]}],
            ["data.format=chat", "model.tokenizer=/tok"],
            "without an assistant turn",
        ),
    ],
)
def test_a_data_set_without_the_fields_its_format_needs_is_one_line(tmp_path, model_dir, records, overrides, message):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    overrides = [o.replace("=/tok", f"={tok}") for o in overrides]
    path = recipe_file(tmp_path / "r.yaml", model_dir, data)
    with pytest.raises(UsageError) as error:
        preflight(load_recipe(str(path), overrides, environ={}), local=True)
    assert message in line_of(error) and f"{data}:1" in line_of(error)


def test_launch_local_refuses_with_one_line_and_records_nothing(tmp_path, model_dir):
    from skyspot.ledger import Ledger

    data = tmp_path / "alpaca.jsonl"
    data.write_text(json.dumps({"question": "?"}) + "\n")
    path = recipe_file(tmp_path / "r.yaml", model_dir, data)
    result = runner.invoke(app, ["launch", str(path), "--local", "-d"])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0 and "data.format=alpaca needs string fields" in result.stderr
    assert Ledger().runs() == []


def test_cloud_launch_asks_the_hub_after_the_cheap_checks(monkeypatch):
    """A cloud launch checks the hub only once SkyPilot's own refusals (store, secrets, clouds) passed."""
    from skyspot.executors.sky import sdk as sky_executor

    monkeypatch.setattr(sky_executor, "api_server_healthy", lambda: True)
    monkeypatch.setattr(sky_executor, "enabled_clouds", lambda: ["aws", "gcp"])
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    result = runner.invoke(app, ["launch", "smollm2-360m", "-y", "--store", "s3://my-ckpts/runs"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: cannot reach the Hugging Face hub")


def test_the_training_data_is_never_its_own_held_out_set(tmp_path, model_dir):
    """Issue 31, item 13: `data.eval_split` equal to `data.source`, or a copy of it, scored the training data."""
    import shutil

    from skyspot.errors import RecipeError

    data = tmp_path / "alpaca.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in alpaca_records(3)))
    path = recipe_file(tmp_path / "r.yaml", model_dir, data, held_out=data)
    with pytest.raises(RecipeError, match="data.eval_split is data.source itself"):
        load_recipe(str(path), environ={})
    copy = tmp_path / "copy.jsonl"
    shutil.copy(data, copy)
    with pytest.raises(UsageError, match="is a copy of data.source"):
        preflight(load_recipe(str(path), [f"data.eval_split={copy}"], environ={}), local=True)
