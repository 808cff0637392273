"""The held-out set and the evaluation's arithmetic, without torchrun (one 2-rank gloo test of the reduction)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from skyspot.recipe import load_recipe
from skyspot.trainer.data import (
    IGNORE_INDEX,
    DataOrder,
    Samples,
    build_dataset,
    build_eval_split,
    hold_out,
    training_and_held_out,
)
from skyspot.trainer.evaluate import Evaluator, combine, done_steps, eval_positions, perplexity, token_loss_sum
from skyspot.trainer.model import ByteTokenizer


def _tiny(*overrides):
    return load_recipe("tiny", ["data.num_samples=200", *overrides], environ={})


# --------------------------------------------------------------------------- the held-out set


def test_the_fraction_held_out_is_deterministic_disjoint_and_never_trained_on_at_any_world_size():
    train_idx, held = hold_out(200, 0.1, seed=1234)
    again_train, again_held = hold_out(200, 0.1, seed=1234)
    assert np.array_equal(held, again_held) and np.array_equal(train_idx, again_train)  # every start, every rank
    assert len(held) == 20 and not set(held) & set(train_idx) and sorted([*held, *train_idx]) == list(range(200))
    assert not np.array_equal(hold_out(200, 0.1, seed=1)[1], held)  # drawn from train.seed
    assert list(train_idx) == sorted(train_idx)  # training keeps its samples in their order

    recipe = _tiny("eval.fraction=0.1")
    samples = build_dataset(recipe, ByteTokenizer())
    training, held_out = training_and_held_out(recipe, samples)
    assert np.array_equal(held_out.ids, samples.ids[held]) and np.array_equal(training.ids, samples.ids[train_idx])
    for world in (1, 2, 4):  # the held-out samples do not depend on the world size, and no rank reaches them
        trained = set()
        for rank in range(world):
            order = DataOrder(len(training), 1234, True, rank, world, 4, 1)
            for step in range(len(training) // order.global_batch + 2):  # past an epoch boundary
                trained |= set(train_idx[order.step_indices(step * order.global_batch).ravel()].tolist())
        assert trained == set(train_idx.tolist())


def test_a_tiny_set_keeps_a_sample_on_each_side():
    assert [len(x) for x in hold_out(2, 0.01, 0)] == [1, 1]
    from skyspot.errors import UsageError

    with pytest.raises(UsageError, match="at least 2 samples"):
        hold_out(1, 0.2, 0)


def test_no_held_out_set_without_an_eval_section():
    samples = Samples(np.zeros((4, 8), dtype=np.int64), np.zeros((4, 8), dtype=np.int64))
    assert training_and_held_out(_tiny(), samples) == (samples, None)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from tests.trainer.real_model import alpaca_records, build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"), [" ".join(r.values()) for r in alpaca_records()])


def _alpaca_recipe(tmp_path, source, *overrides):
    from tests.trainer.real_model import recipe_file

    return load_recipe(str(recipe_file(tmp_path / "r.yaml", tmp_path, source)), list(overrides), environ={})


@pytest.mark.parametrize("packing", ["true", "false"])
def test_an_eval_file_is_masked_and_packed_exactly_as_training_data(tmp_path, bpe, packing):
    from tests.trainer.real_model import alpaca_records

    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in alpaca_records(24, seed=1)))
    held.write_text("".join(json.dumps(r) + "\n" for r in alpaca_records(12, seed=2)))
    recipe = _alpaca_recipe(tmp_path, train, f"data.eval_split={held}", f"data.packing={packing}")
    evaluated = build_eval_split(recipe, bpe)
    as_training = build_dataset(_alpaca_recipe(tmp_path, held, f"data.packing={packing}"), bpe)
    assert np.array_equal(evaluated.ids, as_training.ids) and np.array_equal(evaluated.labels, as_training.labels)
    # the prompt carries no loss: the Alpaca template's words are never a label
    assert (evaluated.labels == IGNORE_INDEX).any()
    trained = bpe.decode([t for t in evaluated.labels.ravel() if t != IGNORE_INDEX])
    assert "### Instruction" not in trained and "Below is an instruction" not in trained
    if packing == "false":
        pad = evaluated.ids == bpe.pad_token_id
        assert pad.any() and (evaluated.labels[pad] == IGNORE_INDEX).all()
    # and the training set is the training file's alone
    training, held_out = training_and_held_out(recipe, build_dataset(recipe, bpe), evaluated)
    assert held_out is evaluated and np.array_equal(
        training.ids, build_dataset(_alpaca_recipe(tmp_path, train, f"data.packing={packing}"), bpe).ids
    )


def test_a_missing_eval_file_says_so(tmp_path, bpe):
    from skyspot.errors import UsageError
    from tests.trainer.real_model import alpaca_records

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in alpaca_records(4)))
    recipe = _alpaca_recipe(tmp_path, train, f"data.eval_split={tmp_path}/gone.jsonl")
    with pytest.raises(UsageError, match="data.eval_split '.*gone.jsonl' is not an existing file"):
        build_eval_split(recipe, bpe)


# --------------------------------------------------------------------------- which batches


def test_eval_batches_are_fixed_disjoint_across_ranks_and_cover_a_small_set_once():
    big = [eval_positions(100, 3, 4, rank, 2, seed=5) for rank in range(2)]
    assert all(p.shape == (3, 4) and r.all() for p, r in big)
    assert np.array_equal(big[0][0], eval_positions(100, 3, 4, 0, 2, seed=5)[0])  # the same every time
    seen = np.concatenate([p.ravel() for p, _ in big])
    assert len(set(seen.tolist())) == 24
    # 10 sequences, 2 ranks x 4: two rounds, the last part filler (real=False), every sequence once
    small = [eval_positions(10, 8, 4, rank, 2, seed=5) for rank in range(2)]
    assert all(p.shape == (2, 4) for p, _ in small)
    real = np.concatenate([p[r] for p, r in small])
    assert sorted(real.tolist()) == list(range(10)) and sum(int((~r).sum()) for _, r in small) == 6


# --------------------------------------------------------------------------- the figure


def test_the_token_loss_sum_is_the_models_own_loss_times_its_tokens():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).eval()
    ids = torch.randint(0, 50, (3, 12))
    labels = ids.clone()
    labels[:, :5] = IGNORE_INDEX  # a prompt
    labels[2, 9:] = IGNORE_INDEX  # padding
    with torch.no_grad():
        total, tokens = token_loss_sum(model(input_ids=ids).logits, labels)
        expected = model(input_ids=ids, labels=labels).loss  # what training takes the gradient of
    assert int(tokens) == 7 + 7 + 4 and total.dtype == torch.float64  # labels 5.. of 12; row 2 to 8
    assert float(total) / int(tokens) == pytest.approx(float(expected), rel=1e-6)


def test_ranks_combine_token_weighted_not_as_a_mean_of_means():
    rows = [[30.0, 10], [2.0, 1]]  # rank 0: 10 tokens at mean 3; rank 1: one token at 2
    loss, tokens = combine(rows)
    assert (loss, tokens) == (32.0 / 11, 11) and loss != (3.0 + 2.0) / 2
    assert combine([[0.0, 0]]) == (None, 0) and perplexity(None) is None and perplexity(800.0) is None
    assert perplexity(1.0) == pytest.approx(np.e)


def _gloo_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    samples, engine = _eval_fixture()
    positions, real = eval_positions(len(samples), 2, 2, rank, world, seed=3)
    events = []
    evaluator = Evaluator(
        samples, positions, real, torch.device("cpu"), 2, None, lambda type, **f: events.append(f), is_writer=False
    )
    result = evaluator.evaluate(engine, 2, interrupted=lambda: False)
    torch.save({"result": result, "events": events, "mode": engine.modes}, f"{out}.{rank}")
    dist.destroy_process_group()


class _Engine:
    """Stands in for the DeepSpeed engine at its narrowest seam (train(mode), forward -> logits): a
    fixed linear model, so the expected figure can be computed without the ranks."""

    def __init__(self) -> None:
        torch.manual_seed(1)
        self.embed = torch.nn.Embedding(20, 20)
        self.modes = []

    def train(self, mode=True):
        self.modes.append("train" if mode else "eval")

    def __call__(self, input_ids):
        return SimpleNamespace(logits=self.embed(input_ids))


def _eval_fixture() -> tuple[Samples, _Engine]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 20, size=(7, 6))
    labels = ids.copy()
    labels[:3, :4] = IGNORE_INDEX  # uneven tokens per sequence, so per-rank means are weighted unequally
    return Samples(ids, labels), _Engine()


def test_two_gloo_ranks_agree_on_the_token_weighted_loss_over_every_rank(tmp_path):
    import torch.multiprocessing as mp

    from skyspot.ports import free_port

    out = str(tmp_path / "res")
    mp.start_processes(_gloo_worker, args=(2, free_port(), out), nprocs=2, start_method="spawn")
    results = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    assert results[0]["result"] == results[1]["result"]  # the same bits on every rank
    assert all(r["mode"] == ["eval", "train"] for r in results)  # back to training mode after
    samples, engine = _eval_fixture()
    # 7 sequences, 2 ranks x 2 per batch: every sequence once (one filler), token-weighted over all of them
    with torch.no_grad():
        logits = engine(torch.from_numpy(samples.ids)).logits
        total, tokens = token_loss_sum(logits, torch.from_numpy(samples.labels))
    result = results[0]["result"]
    assert result["tokens"] == int(tokens) == 7 * 5 - 3 * 3
    assert result["loss"] == pytest.approx(float(total) / int(tokens), rel=1e-6)  # float32 logits, batched otherwise
    assert result["batches"] == 2 and result["perplexity"] == pytest.approx(np.exp(result["loss"]))


def test_an_interrupted_evaluation_records_nothing_and_restores_training_mode():
    samples, engine = _eval_fixture()
    positions, real = eval_positions(len(samples), 2, 2, 0, 1, seed=3)
    events = []
    evaluator = Evaluator(
        samples, positions, real, torch.device("cpu"), 2, None, lambda type, **f: events.append(f), is_writer=False
    )
    asked = []
    assert evaluator.evaluate(engine, 4, interrupted=lambda: asked.append(1) or len(asked) > 1) is None
    assert events == [] and evaluator.done == {} and engine.modes == ["eval", "train"]
    assert evaluator.due(4, None)  # so it runs again


# --------------------------------------------------------------------------- when


def _evaluator(every_steps=None, every_seconds=None, done=None) -> Evaluator:
    samples, _ = _eval_fixture()
    return Evaluator(
        samples,
        np.zeros((1, 1), dtype=np.int64),
        np.ones((1, 1), dtype=bool),
        None,
        every_steps,
        every_seconds,
        lambda *a, **k: None,
        False,
        done=dict(done or {}),
    )


def test_evals_are_due_every_n_steps_every_t_seconds_and_at_the_end_never_twice_for_a_step():
    by_steps = _evaluator(every_steps=4, done={8: {}})
    assert [s for s in range(13) if by_steps.due(s, 100.0)] == [4, 12]  # 8: evaluated by an earlier start
    assert _evaluator().due(7, None, final=True) and not _evaluator(done={7: {}}).due(7, None, final=True)
    by_time = _evaluator(every_seconds=60)
    assert not by_time.due(1, 1000.0) and not by_time.due(2, 1059.0) and by_time.due(3, 1060.0)


def test_the_history_names_the_steps_already_evaluated_since_the_last_fresh_start():
    def ev(attempt, type, **fields):
        return {"attempt": attempt, "type": type, **fields}

    history = [
        ev(1, "start", fresh=False),
        ev(1, "eval", step=4, loss=1.0, batches=2),
        ev(2, "start", fresh=True),
        ev(2, "eval", step=8, loss=0.5, batches=2),
        ev(3, "start", fresh=False),
        ev(3, "eval", step=12, loss=0.4, batches=3),
    ]
    done = done_steps(history, batches=2)
    assert list(done) == [8] and done[8]["loss"] == 0.5  # 4 is from before --fresh; 12 had other batches
