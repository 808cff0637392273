"""`skyspot keys` (every key a recipe takes) and `skyspot cp` (a recipe of your own to edit), through the CLI."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.recipe import Recipe, load_recipe

runner = CliRunner()


def _keys(*args: str) -> list[dict]:
    result = runner.invoke(app, ["keys", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_keys_lists_every_section_and_nested_key_once_with_a_description():
    rows = _keys()
    names = [r["key"] for r in rows]
    assert len(names) == len(set(names))
    assert {n.split(".")[0] for n in names} == set(Recipe.model_fields)
    assert {"train.steps", "train.lora", "train.lora.r", "storage.store", "checkpoint.every_seconds"} <= set(names)
    assert all(r["description"] for r in rows)
    steps = next(r for r in rows if r["key"] == "train.steps")
    assert steps["required"] is True and steps["type"] == "int"
    keep = next(r for r in rows if r["key"] == "checkpoint.keep")
    assert keep["required"] is False and keep["default"] == 3


def test_every_listed_leaf_key_is_an_override_the_recipe_accepts():
    """The list is the models, not a copy: each key with a plain default loads as `key=default` on tiny."""
    for row in _keys():
        if row["required"] or row["type"] in ("section or null",) or isinstance(row["default"], (dict, list)):
            continue
        if row["default"] is None or row["key"].startswith(("model.", "name", "train.lora.")):
            continue  # unset; tiny's model source; a LoRA key turns LoRA on, which tiny's inline model refuses
        value = str(row["default"]).lower() if isinstance(row["default"], bool) else str(row["default"])
        load_recipe("tiny", [f"{row['key']}={value}"], environ={})


def test_keys_with_a_recipe_shows_its_values():
    rows = {r["key"]: r for r in _keys("tiny")}
    tiny = load_recipe("tiny", environ={})
    assert rows["train.steps"]["value"] == tiny.train.steps
    assert rows["resources.local_only"]["value"] is True
    text = runner.invoke(app, ["keys", "tiny"]).stdout
    assert f"train.steps  int  = {tiny.train.steps}" in text


def test_keys_of_an_unknown_recipe_is_one_line_and_exit_2():
    result = runner.invoke(app, ["keys", "llama8x"])
    assert result.exit_code == 2 and "did you mean 'llama8b'" in result.output
    assert "Traceback" not in result.output


def test_cp_copies_a_recipe_that_then_launches_as_a_file_and_never_overwrites(tmp_path):
    target = tmp_path / "mine.yaml"
    result = runner.invoke(app, ["cp", "tiny", str(target)])
    assert result.exit_code == 0, result.output
    assert f"skyspot launch {target}" in result.output
    assert load_recipe(str(target), environ={}) == load_recipe("tiny", environ={})

    target.write_text("# my edits\n" + target.read_text())
    again = runner.invoke(app, ["cp", "llama8b", str(target)])
    assert again.exit_code == 2 and "already exists; nothing was overwritten" in again.output
    assert target.read_text().startswith("# my edits\n")

    into_dir = runner.invoke(app, ["cp", "llama8b", str(tmp_path)])
    assert into_dir.exit_code == 0 and (tmp_path / "llama8b.yaml").is_file()
    missing = runner.invoke(app, ["cp", "tiny", str(tmp_path / "nope" / "x.yaml")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
