"""A real model end to end: pretrained safetensors weights under ZeRO-3, a real BPE tokenizer, Alpaca
data with the prompt masked, preemptions, exact resume, LoRA, and a final/ that from_pretrained loads.

Everything runs with HF_HUB_OFFLINE=1: the model is a local directory (or planted in a Hugging Face
cache), so no test can reach the hub. The model's weights are large random ones (real_model.py), so a
run that silently started from any other initialisation could not pass the loss and weight checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tests.trainer.launch import events, finish, log_text, start

pytestmark = pytest.mark.slow
runner = CliRunner()
FAST = ["--notice", "4", "--grace", "60", "--provision-delay", "0.5"]


def safetensors_of(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    assert tensors, f"no safetensors in {directory}"
    return tensors


def assert_equal_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def steps(run_dir: Path) -> list[tuple]:
    """(step, loss, lr) of rank 0's step events, the last of each step (a resumed run repeats none)."""
    seen = {e["step"]: (e["step"], e["loss"], e["lr"]) for e in events(run_dir, "step") if e["rank"] == 0}
    return [seen[s] for s in sorted(seen)]


def evals(run_dir: Path) -> list[tuple]:
    """(step, loss, tokens) of every eval event, in order."""
    return [(e["step"], e["loss"], e["tokens"]) for e in events(run_dir, "eval")]


def tensor_bytes(step_dir: Path) -> tuple[int, int]:
    """(bytes of the tensors DeepSpeed's files hold, of which frozen-parameter fragments)."""
    total = frozen = 0

    def walk(obj, in_frozen=False):
        nonlocal total, frozen
        if isinstance(obj, torch.Tensor):
            size = obj.numel() * obj.element_size()
            total += size
            frozen += size if in_frozen else 0
        elif isinstance(obj, dict):
            for key, value in obj.items():
                walk(value, in_frozen or key == "frozen_param_fragments")
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value, in_frozen)

    for path in step_dir.glob("*_states.pt"):
        walk(torch.load(path, map_location="cpu", weights_only=False))
    return total, frozen


def launch_local(recipe: Path, *args: str):
    from skyspot.cli.main import app

    result = runner.invoke(app, ["launch", str(recipe), "--local", *FAST, *args], catch_exceptions=False)
    from skyspot.ledger import Ledger

    run = Ledger().runs()[0]
    return result, Path(run.run_dir)


def locate_on_a_new_node(recipe_path: Path, run_dir: Path, run_id: str):
    """Where a node with an empty run directory finds the base model's files (base.py, node leader's part)."""
    from skyspot.recipe import load_recipe
    from skyspot.trainer.base import BaseModel
    from skyspot.trainer.cluster import Placement
    from skyspot.trainer.durable import StoreTier

    recipe = load_recipe(str(recipe_path), environ={})
    placement = Placement(rank=0, world_size=1, local_rank=0, node_rank=0, num_nodes=1)
    tier = StoreTier(recipe.storage.store, run_id, placement)
    run_dir.mkdir(parents=True, exist_ok=True)
    return BaseModel(recipe, run_dir, placement, None, tier=tier)._locate(True)


def first_step_loss_by_plain_transformers(recipe_path: Path, model_dir: Path) -> float:
    """The step-1 loss the trainer must report: each rank's first micro-batch (data.DataOrder) through the
    source model with plain transformers, the mean over the ranks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from skyspot.recipe import load_recipe
    from skyspot.trainer.data import DataOrder, build_dataset

    recipe = load_recipe(str(recipe_path), environ={})
    samples = build_dataset(recipe, AutoTokenizer.from_pretrained(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    losses = []
    for rank in range(2):
        order = DataOrder(
            len(samples),
            recipe.train.seed,
            recipe.data.shuffle,
            rank,
            2,
            recipe.train.micro_batch_size,
            recipe.train.grad_accum,
        )
        [indices] = order.step_indices(0)
        labels = torch.from_numpy(samples.labels[indices])
        with torch.no_grad():
            loss = model(input_ids=torch.from_numpy(samples.ids[indices]), labels=labels).loss
        losses.append(0.0 if bool((labels[:, 1:] == -100).all()) else loss.item())
    return sum(losses) / len(losses)


def test_pretrained_weights_arrive_on_every_rank_and_the_first_loss_is_the_source_models(real_model, tmp_path):
    """lr=0: after two steps final/ (gathered from both ranks' ZeRO-3 shards) is the source, bit for bit;
    step 1's loss is what plain transformers computes on the source model for the same batch."""
    run_dir = tmp_path / "lr0"
    code = finish(start(run_dir, ["train.lr=0", "train.steps=2"], recipe=str(real_model["recipe"]), HF_HUB_OFFLINE="1"))
    assert code == 0, log_text(run_dir)
    assert_equal_tensors(safetensors_of(run_dir / "final"), safetensors_of(real_model["model"]))
    [first] = [e for e in events(run_dir, "step") if e["rank"] == 0 and e["step"] == 1]
    expected = first_step_loss_by_plain_transformers(real_model["recipe"], real_model["model"])
    assert first["loss"] == pytest.approx(expected, rel=1e-5)
    assert abs(expected - np.log(384)) > 0.5  # far from a uniform guess: a random init could not match it

    # final/ carries the tokenizer: from_pretrained + generate, with its chat template too
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Reverse: apple river"}], add_generation_prompt=True, return_tensors="pt"
    )
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    assert out.shape[1] == prompt.shape[1] + 6 and isinstance(tokenizer.decode(out[0]), str)


def test_a_real_model_preempted_twice_through_the_local_executor_ends_bitwise_equal(
    real_model, real_reference, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The controller sends each notice when it reads step 3's (7's) event; rank 0 then waits 4 s at the
    # end of the next step, before the ranks vote, so the notice is read by then however loaded the
    # machine, and each attempt saves at a known step (otherwise a fast run passed step 7 before the
    # first notice was read, and the second notice came after the run had finished).
    monkeypatch.setenv("SKYSPOT_FAULT", "step_end@4/0:pause=4,step_end@8/0:pause=4")
    result, run_dir = launch_local(real_model["recipe"], "--preempt-at-steps", "3,7")
    assert result.exit_code == 0, result.output + log_text(run_dir)
    assert len(events(run_dir, "resume")) == 2
    assert_equal_tensors(safetensors_of(run_dir / "final"), safetensors_of(real_reference / "final"))
    assert steps(run_dir) == steps(real_reference)
    # Each preemption came at an eval step (4, 8) before its eval: the next start evaluated it, bitwise
    # as the uninterrupted run did, and no step was evaluated twice.
    assert evals(run_dir) == evals(real_reference)
    # A resumed full fine-tune builds the model from its config and loads the checkpoint: no weights read.
    loads = [(e["attempt"], e["weights"]) for e in events(run_dir, "base_model")]
    assert [w for a, w in loads if a > 1] == [False, False] and (1, True) in loads


def test_the_eval_loss_on_the_held_out_file_goes_down_and_final_records_the_last(real_reference):
    held_out = evals(real_reference)
    assert [step for step, _, _ in held_out] == [4, 8, 12]
    losses = [loss for _, loss, _ in held_out]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.1, losses
    metadata = json.loads((real_reference / "final" / "skyspot.json").read_text())
    assert metadata["step"] == 12 and (metadata["eval"]["step"], metadata["eval"]["loss"]) == (12, losses[-1])


def test_lora_checkpoints_hold_only_adapters_resume_exactly_and_the_base_comes_from_the_store(
    real_model, real_reference, lora_reference, tmp_path, monkeypatch
):
    """The model as a hub id (planted in an offline Hugging Face cache) and a store: the first attempt
    copies the base into the store, the attempt after the preemption reads it there."""
    from tests.trainer.real_model import HUB_ID, plant_in_hub_cache, recipe_file

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    plant_in_hub_cache(real_model["model"], tmp_path / "hf" / "hub")
    recipe = recipe_file(tmp_path / "lora-hub.yaml", HUB_ID, real_model["alpaca"], lora=True, store=tmp_path / "store")
    result, run_dir = launch_local(recipe, "--preempt-at-steps", "6")
    assert result.exit_code == 0, result.output + log_text(run_dir)

    # exact resume: the adapters and every step's loss and lr equal the uninterrupted run's (which evaluated
    # every 4 steps with LoRA's dropout in the model, and this run never: evaluating changes no training)
    assert_equal_tensors(safetensors_of(run_dir / "final"), safetensors_of(lora_reference / "final"))
    assert steps(run_dir) == steps(lora_reference)
    # The first attempt fetched the base "from the hub" (the offline cache) and copied it into the store; the
    # next one on the same disk used the same files. A new machine (no DIR/base.json, no Hugging Face cache)
    # finds the copy through the store's mount, without the hub.
    sources = [(e["attempt"], e["source"], e["weights"]) for e in events(run_dir, "base_model")]
    assert sources == [(1, "hub", False), (1, "hub", True), (2, "cache", False), (2, "cache", True)]
    assert [e["error"] for e in events(run_dir, "base_copy")] == [None]
    import shutil

    shutil.rmtree(tmp_path / "hf")
    located = locate_on_a_new_node(recipe, tmp_path / "new-node", run_dir.name)
    assert located[1] == "store mount" and located[0] == tmp_path / "store" / run_dir.name / "base"
    assert_equal_tensors(safetensors_of(located[0]), safetensors_of(real_model["model"]))

    # the checkpoint holds the trainable state only: 12 bytes (fp32 master, Adam's m and v) per adapter
    # parameter, nothing of the frozen base, against 12 bytes per parameter for the full fine-tune
    config = json.loads((real_model["model"] / "config.json").read_text())
    hidden, inter, layers, kv = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"], 16
    adapters = layers * 4 * (2 * (hidden + hidden) + 2 * (hidden + kv) + 3 * (hidden + inter))
    total = sum(t.numel() for t in safetensors_of(real_model["model"]).values())
    lora_bytes, lora_frozen = tensor_bytes(lora_reference / "checkpoints" / "step_12")
    full_bytes, _ = tensor_bytes(real_reference / "checkpoints" / "step_12")
    assert lora_frozen == 0
    assert lora_bytes == pytest.approx(12 * adapters, abs=64) and full_bytes == pytest.approx(12 * total, abs=64)

    # final/ holds the adapter (loads on the base through peft) and the merged model (loads without it)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(lora_reference / "final")
    ids = tokenizer("### Instruction:\nReverse the order", return_tensors="pt").input_ids
    with torch.no_grad():
        adapted = AutoModelForCausalLM.from_pretrained(lora_reference / "final")(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(lora_reference / "final" / "merged")(ids).logits
        base = AutoModelForCausalLM.from_pretrained(real_model["model"])(ids).logits
    assert torch.allclose(adapted, merged, atol=1e-4) and not torch.allclose(adapted, base, atol=1e-3)


def test_a_missing_model_directory_stops_the_trainer_with_one_line_and_exit_2(real_model, tmp_path):
    run_dir = tmp_path / "missing"
    code = finish(
        start(run_dir, [f"model.hub_id={tmp_path}/gone"], recipe=str(real_model["recipe"]), HF_HUB_OFFLINE="1")
    )
    assert code == 2
    errors = [line for line in log_text(run_dir).splitlines() if line.startswith("[skyspot]")]
    assert errors == [
        f"[skyspot] model.hub_id {tmp_path}/gone is not a directory on this machine; a local model "
        "is a directory that save_pretrained wrote (config.json and *.safetensors)"
    ]
    # no traceback of ours (torchrun prints its own report of a failed worker)
    assert not [
        line for line in log_text(run_dir).splitlines() if line.strip().startswith('File "') and "/skyspot/" in line
    ]
