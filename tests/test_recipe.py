"""Recipes: loading, validation (every problem at once, with file and line), and the precedence rule."""

from __future__ import annotations

import os

import pytest

from skyspot.errors import RecipeError, UsageError
from skyspot.recipe import REGISTRY, load_recipe, parse_overrides, recipe_path


def write(tmp_path, text, name="r.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


GOOD = """\
name: mine
model: {hub_id: org/model}
data: {source: synthetic}
train: {steps: 10, micro_batch_size: 1, lr: 1.0e-4, seq_len: 64}
resources: {accelerators: ["H100:8"], num_nodes: 2}
"""


def test_every_registry_recipe_loads():
    for name in REGISTRY:
        recipe = load_recipe(name, environ={})
        assert recipe.name == name


def test_llama70b_is_what_the_product_promises():
    recipe = load_recipe("llama70b", environ={})
    assert recipe.model.hub_id == "meta-llama/Llama-3.1-70B" and recipe.model.gated
    assert recipe.resources.num_nodes == 4
    assert recipe.resources.accelerators == ["A100-80GB:8", "H100:8"]
    assert recipe.resources.clouds == ["aws", "gcp", "azure"]
    assert recipe.deepspeed.zero_stage == 3 and recipe.deepspeed.bf16 and recipe.deepspeed.gradient_checkpointing


def test_unknown_recipe_suggests_the_closest_name():
    with pytest.raises(UsageError, match=r"unknown recipe 'lama70b'; did you mean 'llama70b'\?"):
        load_recipe("lama70b", environ={})


def test_a_name_never_resolves_outside_the_registry(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").write_text("name: evil\n")
    assert recipe_path("tiny").parent.name == "recipes"
    with pytest.raises(UsageError, match="unknown recipe"):
        recipe_path("etc")


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "name: x\nmodel: [unclosed\ntrain: {}\n")
    with pytest.raises(RecipeError, match=r"r\.yaml:\d+: malformed YAML"):
        load_recipe(path, environ={})


def test_all_problems_are_reported_together_with_lines(tmp_path):
    text = GOOD.replace("steps: 10", "steps: ten").replace("num_nodes: 2", "num_nodes: 0, colour: red")
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, text), environ={})
    message = str(info.value)
    assert "train.steps (line 4)" in message
    assert "resources.num_nodes (line 5)" in message
    assert "resources.colour (line 5): unknown key" in message


def test_unknown_cloud_and_accelerator_are_rejected(tmp_path):
    text = GOOD.replace('["H100:8"]', '["H1OO:8"]') + "  clouds: [aws, oracle]\n"
    text = text.replace("num_nodes: 2}\n  clouds: [aws, oracle]", "num_nodes: 2, clouds: [aws, oracle]}")
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, text), environ={})
    assert "unknown accelerator 'H1OO'; did you mean 'H100'?" in str(info.value)
    assert "resources.clouds" in str(info.value) and "oracle" in str(info.value)


def test_bad_store_url_is_rejected(tmp_path):
    with pytest.raises(RecipeError, match="storage.store"):
        load_recipe(write(tmp_path, GOOD + "storage: {store: 'ftp://host/x'}\n"), environ={})


def test_override_of_a_key_that_does_not_exist_suggests_one(tmp_path):
    with pytest.raises(RecipeError, match=r"override 'train.step' names no recipe key; did you mean 'train.steps'\?"):
        load_recipe(write(tmp_path, GOOD), ["train.step=3"], environ={})


def test_malformed_override_is_a_usage_error():
    with pytest.raises(UsageError, match="section.key=value"):
        parse_overrides(["train.steps"])


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path):
    path = write(tmp_path, GOOD)
    # defaults
    assert load_recipe(path, environ={}).checkpoint.keep == 3
    # file beats default
    assert load_recipe(path, environ={}).train.steps == 10
    # env beats file
    env = {"SKYSPOT_TRAIN__STEPS": "20", "SKYSPOT_RESOURCES__CLOUDS": "gcp"}
    assert load_recipe(path, environ=env).train.steps == 20
    # CLI override beats env
    assert load_recipe(path, ["train.steps=30"], environ=env).train.steps == 30
    # flags beat everything
    recipe = load_recipe(path, ["resources.clouds=aws"], environ=env, flags={"resources.clouds": ["azure"]})
    assert recipe.resources.clouds == ["azure"]


def test_override_values_are_typed(tmp_path):
    recipe = load_recipe(
        write(tmp_path, GOOD),
        ["train.lr=3e-4", "resources.clouds=aws,gcp", "checkpoint.every_seconds=auto"],
        environ={},
    )
    assert recipe.train.lr == pytest.approx(3e-4)
    assert recipe.resources.clouds == ["aws", "gcp"]
    assert recipe.checkpoint.every_seconds == "auto"


def test_num_nodes_below_one_is_rejected(tmp_path):
    with pytest.raises(RecipeError, match=r"resources.num_nodes.*greater than or equal to 1"):
        load_recipe(write(tmp_path, GOOD), ["resources.num_nodes=0"], environ={})


def test_min_nodes_must_fit_under_num_nodes_and_a_smaller_resume_needs_a_store():
    recipe = load_recipe("tiny", ["resources.num_nodes=4", "resources.min_nodes=2", "storage.store=/tmp/x"])
    assert (recipe.resources.min_nodes, recipe.resources.fewest_nodes) == (2, 2)
    assert load_recipe("tiny", ["resources.num_nodes=4"]).resources.fewest_nodes == 4
    with pytest.raises(UsageError, match=r"min_nodes \(5\) is above resources.num_nodes \(4\)"):
        load_recipe("tiny", ["resources.num_nodes=4", "resources.min_nodes=5", "storage.store=/tmp/x"])
    with pytest.raises(UsageError, match="needs storage.store"):
        load_recipe("tiny", ["resources.num_nodes=4", "resources.min_nodes=2"])


# --------------------------------------------------------------------------- real models, formats, LoRA


def test_a_local_model_directory_is_an_absolute_path(tmp_path):
    path = write(tmp_path, GOOD)
    assert load_recipe(path, [f"model.hub_id={tmp_path}/m"], environ={}).model.is_local
    assert load_recipe(path, ["model.hub_id=~/models/m"], environ={}).model.hub_id.startswith("/")
    with pytest.raises(RecipeError, match="not a Hugging Face repo id \\(org/name\\) nor an absolute path"):
        load_recipe(path, ["model.hub_id=./models/m"], environ={})


def test_a_revision_pins_a_hub_model_only(tmp_path):
    path = write(tmp_path, GOOD)
    assert load_recipe(path, ["model.revision=0123abc"], environ={}).model.revision == "0123abc"
    with pytest.raises(RecipeError, match="model.revision applies to a hub model"):
        load_recipe(path, [f"model.hub_id={tmp_path}", "model.revision=main"], environ={})
    with pytest.raises(RecipeError, match="is not a hub revision"):
        load_recipe(path, ["model.revision=../x"], environ={})


def test_lora_is_a_typed_section_reachable_by_overrides(tmp_path):
    path = write(tmp_path, GOOD)
    assert load_recipe(path, environ={}).train.lora is None
    lora = load_recipe(path, ["train.lora.r=8"], environ={}).train.lora
    assert (lora.r, lora.alpha, lora.dropout) == (8, 32.0, 0.05) and "down_proj" in lora.target_modules
    assert load_recipe(path, ["train.lora={}"], environ={}).train.lora.r == 16
    with pytest.raises(RecipeError) as error:
        load_recipe(path, ["train.lora.rank=8", "train.lora.dropout=1.5"], environ={})
    assert "train.lora.rank" in str(error.value)
    with pytest.raises(RecipeError, match="export.merge needs train.lora"):
        load_recipe(path, ["export.merge=true"], environ={})


def test_formats_and_sources(tmp_path):
    path = write(tmp_path, GOOD)
    assert load_recipe(path, ["data.source=hf://yahma/alpaca-cleaned:test"], environ={}).data.source.endswith(":test")
    with pytest.raises(RecipeError, match="not a dataset split name"):
        load_recipe(path, ["data.source=hf://a/b:x y"], environ={})
    with pytest.raises(RecipeError, match="needs records; the synthetic source is token ids"):
        load_recipe(path, ["data.format=alpaca"], environ={})
    with pytest.raises(RecipeError, match="Input should be 'text', 'alpaca' or 'chat'"):
        load_recipe(path, ["data.format=sharegpt"], environ={})
    with pytest.raises(RecipeError, match="the byte tokenizer has none"):
        load_recipe("tiny", ["data.format=chat", "data.source=/x.jsonl"], environ={})
    assert load_recipe(path, ["train.lr=0"], environ={}).train.lr == 0


def test_the_held_out_set_is_validated_like_the_source(tmp_path):
    path = write(tmp_path, GOOD)
    hub = ["data.source=hf://yahma/alpaca-cleaned", "data.format=alpaca"]
    assert load_recipe(path, [*hub, "data.eval_split=validation"], environ={}).data.eval_split == "validation"
    with pytest.raises(RecipeError, match="data.eval_split 'a b' is not a dataset split name"):
        load_recipe(path, [*hub, "data.eval_split=a b"], environ={})
    files = ["data.source=/data/train.jsonl", "data.format=alpaca"]
    home = os.path.expanduser("~")
    assert (
        load_recipe(path, [*files, "data.eval_split=~/held.jsonl"], environ={}).data.eval_split == f"{home}/held.jsonl"
    )
    assert (
        load_recipe(path, [*files, "data.eval_split=S3://my-data/held.jsonl"], environ={}).data.eval_split
        == "s3://my-data/held.jsonl"
    )
    with pytest.raises(RecipeError, match="data.eval_split: unsupported data file scheme 'ftp://'"):
        load_recipe(path, [*files, "data.eval_split=ftp://host/held.jsonl"], environ={})
    with pytest.raises(RecipeError, match="not a hub dataset"):
        load_recipe(path, [*files, "data.eval_split=hf://org/other"], environ={})
    with pytest.raises(RecipeError, match="the synthetic set has neither: use eval.fraction"):
        load_recipe(path, ["data.eval_split=validation"], environ={})
    with pytest.raises(RecipeError, match="set one of data.eval_split and eval.fraction"):
        load_recipe(path, [*files, "data.eval_split=/data/held.jsonl", "eval.fraction=0.1"], environ={})


def test_the_llama_recipes_train_on_alpaca_formatting():
    for name in ("llama8b", "llama70b", "llama8b-lora", "llama70b-lora", "smollm2-360m"):
        data = load_recipe(name, environ={}).data
        assert (data.source, data.format) == ("hf://yahma/alpaca-cleaned", "alpaca")
    assert load_recipe("llama70b-lora", environ={}).train.lora.r == 16
