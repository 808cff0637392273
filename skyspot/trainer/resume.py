"""Resume: the recipe reconciled with the checkpoint, the data read where the ranks can, the held-out
set and what was already evaluated, the save predictor's history, and the LR schedule re-applied.

build (loop.py) calls these in order; each says which rank does what.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from skyspot.errors import UsageError
from skyspot.events import read_events_dir
from skyspot.recipe import ModelSection, Recipe
from skyspot.trainer.data import build_eval_split, local_source_path, rebatch, resolve_source, training_and_held_out
from skyspot.trainer.evaluate import build_evaluator, has_tokens
from skyspot.trainer.say import say

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from skyspot.trainer.data import Samples
    from skyspot.trainer.evaluate import Evaluator
    from skyspot.trainer.phases import Started
    from skyspot.trainer.preemption import SavePredictor

History = Callable[[], list[dict]]
"""Earlier attempts' events from the store, read at most once (store_history)."""


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: obj}


def reconcile_recipe(recipe: Recipe, saved: Optional[dict[str, Any]]) -> tuple[Recipe, list[str]]:
    """The recipe to continue with, and one line per difference from the checkpoint's.

    The architecture (model.*) comes from the checkpoint; everything else from the recipe.
    """
    if not saved:
        return recipe, []
    sections = ("model", "data", "train", "deepspeed", "checkpoint")
    now = _flatten({k: v for k, v in recipe.model_dump(mode="json").items() if k in sections})
    then = _flatten({k: v for k, v in saved.items() if k in sections})
    lines = []
    for key in sorted(set(now) | set(then)):
        if now.get(key) != then.get(key):
            winner = "the checkpoint's" if key.startswith("model.") else "the recipe's"
            lines.append(
                f"recipe differs from the checkpoint: {key} {then.get(key)!r} -> {now.get(key)!r} "
                f"({winner} value is used)"
            )
    if "model" in saved and saved["model"] != recipe.model.model_dump(mode="json"):
        recipe = recipe.model_copy(update={"model": ModelSection.model_validate(saved["model"])})
    return recipe, lines


def keep_global_batch(recipe: Recipe, manifest: dict[str, Any], world_size: int) -> tuple[Recipe, Optional[str]]:
    """The recipe with micro batch and accumulation re-split so `world_size` ranks keep the
    checkpoint's global batch (data.rebatch), and the line that says so."""
    train = recipe.train
    saved = int((manifest.get("data") or {}).get("global_batch") or 0)
    if saved <= 0:
        return recipe, None
    micro, accum, note = rebatch(saved, train.micro_batch_size, train.grad_accum, world_size)
    if (micro, accum) != (train.micro_batch_size, train.grad_accum):
        recipe = recipe.model_copy(
            update={"train": train.model_copy(update={"micro_batch_size": micro, "grad_accum": accum})}
        )
    return recipe, (f"world size {manifest.get('world_size')} -> {world_size}: {note}" if note else None)


def data_source(started: Started, recipe: Recipe, key: str = "source") -> str:
    """Where the ranks read data.source (or data.eval_split, a file source's held-out file): a bucket URI
    is downloaded into DIR/data/ by each node leader first (the task mounts bucket data on cloud nodes,
    so this is for a URI given directly)."""
    source, cache = getattr(recipe.data, key), started.run_dir / "data"
    error = None
    if started.placement.is_node_leader:
        try:
            resolve_source(source, cache, key=f"data.{key}")
        except UsageError as err:
            error = str(err)
    errors = [e for e in started.comm.io_gather(error) if e]  # a node leader's download
    if errors:
        raise UsageError(errors[0])
    return local_source_path(source, cache)


def store_history(started: Started) -> History:
    """Earlier attempts' events from the store, read at most once (a fresh node has none locally)."""
    cache: list = []

    def read() -> list[dict]:
        if not cache:
            cache.append(started.tier.read_events() if started.tier is not None else [])
        return cache[0]

    return read


def held_out(
    started: Started, recipe: Recipe, tokenizer, samples: Samples, history: History
) -> tuple[Samples, Optional[Evaluator]]:
    """The training set without the held-out part, and the evaluator (None without an eval section).
    Global rank 0 reads which steps this run has already evaluated (its event history: the run
    directory's, else the store's) so no step is evaluated twice; every rank gets its answer."""
    p = started.placement
    split = (
        build_eval_split(recipe, tokenizer, data_source(started, recipe, "eval_split"))
        if recipe.data.eval_split
        else None
    )
    samples, kept_out = training_and_held_out(recipe, samples, split)
    if kept_out is None:
        return samples, None
    if not has_tokens(kept_out):
        raise UsageError("the held-out set has no token to evaluate (every label is a prompt or padding)")
    earlier = None
    if p.is_global_zero and not started.fresh:
        earlier = read_events_dir(started.run_dir / "events").events  # this attempt's too (a restart in place)
        if started.tier is not None and all(e.get("attempt") == started.attempt for e in earlier):  # a new machine
            try:
                earlier = history() + earlier
            except Exception as err:  # noqa: BLE001 - without it a step may be evaluated once more
                say(f"the store's event history is unreadable ({err}); evaluations already done may run again")
        earlier = [e for e in earlier if e.get("type") in ("start", "eval")]
        earlier.sort(key=lambda e: (e.get("attempt") or 0, e.get("ts") or 0))
    earlier = started.comm.io_gather(earlier)[0] or []
    evaluator = build_evaluator(
        recipe,
        kept_out,
        device=started.device,
        dp_rank=p.rank,
        dp_size=p.world_size,
        emit=started.emit,
        is_writer=p.is_global_zero,
        history=earlier,
    )
    if p.is_global_zero:
        say(
            f"eval: {len(kept_out)} held-out sequences ({'data.eval_split' if split is not None else 'eval.fraction'}), "
            f"{evaluator.batches} micro-batch{'es' if evaluator.batches != 1 else ''} per rank"
            + (
                f"; {len(evaluator.done)} steps already evaluated, the last {max(evaluator.done)}"
                if evaluator.done
                else ""
            )
        )
    return samples, evaluator


def seed_predictor(started: Started, recipe: Recipe, predictor: SavePredictor, history: History) -> None:
    """The save-time predictor behind training through a notice window (preemption.py), seeded from
    earlier attempts: the run directory's events, else (global rank 0, a fresh node) the store's."""
    p = started.placement
    if started.uploader is not None:
        started.uploader.on_uploaded.append(predictor.observe_durable)
    if not recipe.checkpoint.train_through_notice or not p.is_node_leader:
        return
    earlier = [e for e in read_events_dir(started.run_dir / "events").events if e.get("attempt") != started.attempt]
    if not earlier and p.is_global_zero and started.tier is not None:
        try:
            earlier = history()
        except Exception as err:  # advice only: without history the first notice saves at once
            say(f"the store's event history is unreadable ({err}); a notice before the first checkpoint saves at once")
            earlier = []
    predictor.seed(earlier)  # every node's figures: the slowest node decides anyway


def apply_schedule(engine: DeepSpeedEngine, recipe: Recipe) -> None:
    """The LR schedule comes from the recipe, the step count from the checkpoint.

    For an unchanged recipe this recomputes exactly the value that was restored (same formula,
    same inputs), so resume stays bitwise; a changed lr or train.steps takes effect at once.
    """
    # Lazy: engine.py imports torch, which loads after setup's GPU check (loop.setup).
    from skyspot.trainer.engine import lr_factor

    scheduler = engine.lr_scheduler
    train = recipe.train
    factor = lr_factor(train.warmup_steps, train.steps, train.min_lr_ratio)
    base_lrs = [train.lr for _ in scheduler.base_lrs]
    lrs = [base * factor(scheduler.last_epoch) for base in base_lrs]
    for group, lr in zip(engine.optimizer.param_groups, lrs):
        group["lr"] = lr
    # Through the scheduler's public state (the form a checkpoint saves and load_state_dict reads back), so
    # get_last_lr() and the next checkpoint's scheduler state say the recomputed values.
    state = scheduler.state_dict()
    state.update(base_lrs=base_lrs, _last_lr=lrs)
    scheduler.load_state_dict(state)
