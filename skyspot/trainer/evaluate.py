"""Evaluation on the held-out set: loss and perplexity, distributed over the ranks, exact across resumes.

What is evaluated: the held-out set (data.py `training_and_held_out`: data.eval_split, or
eval.fraction of the training data), in one fixed order drawn from train.seed, `eval.batches`
micro-batches of train.micro_batch_size sequences per rank: rank r's batch b holds the sequences at
positions [(b*dp + r)*mb, ... + mb) of that order. A set smaller than batches x dp x mb is evaluated
once, whole: the positions past its end are filled with its own sequences with every label masked
(they count neither loss nor tokens), because under ZeRO-3 every rank must run every forward.

The figure: sum of the token losses over every rank's batches, divided by the number of tokens
(labels other than -100, shifted as the model's own loss shifts them): a token-weighted mean, not a
mean of per-batch means. Each rank's (sum, tokens) are gathered and added in rank order, so every
rank gets the same bits whatever the backend's reduction order. Perplexity is exp(loss).

Exact across resumes: the same batches every time, the engine in eval mode (no dropout) under
torch.no_grad, and the RNG states put back afterwards, so a run that evaluates at other steps than
another still trains bitwise the same; the weights at step N are bitwise those of the uninterrupted
run (resume is exact), so the eval at step N is too.

When (`due`): every eval.every_steps steps, and/or once eval.every_seconds of training have passed
since the last evaluation (measured on global rank 0's clock at the step-boundary vote, so every rank
decides on the same number), and always at the last step. Never twice for one step in a run: the
steps already evaluated in this run's history (`done_steps`, read at start) are skipped. A preemption
during an evaluation (`interrupted`, asked before each micro-batch, one tiny collective) abandons it:
nothing is emitted, the loop saves and exits, and the next start evaluates that step again (loop.py).
The `eval` event's `seconds` is the time the evaluation took, so the report can count it apart.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import numpy as np

from skyspot.trainer.data import IGNORE_INDEX, Samples
from skyspot.trainer.faults import fault_point
from skyspot.events import EventType as T

EVAL_ORDER_SALT = 0xE7A1_0DE5


def eval_positions(
    num_samples: int, batches: int, micro_batch: int, dp_rank: int, dp_size: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """([batches', micro_batch] sample indices of this rank, the same shape: which are real). batches'
    is eval.batches, or fewer when the set is smaller than one round of batches on every rank. Pure:
    the same on every start, different ranks disjoint."""
    per_round = micro_batch * dp_size
    rounds = min(batches, -(-num_samples // per_round))
    order = np.random.default_rng([seed, EVAL_ORDER_SALT]).permutation(num_samples)
    positions = np.arange(rounds * per_round).reshape(rounds, dp_size, micro_batch)[:, dp_rank, :]
    real = positions < num_samples
    return order[positions % num_samples], real


def token_loss_sum(logits, labels) -> tuple[Any, Any]:
    """(sum of the token cross-entropies, number of tokens) of a batch, in float64 and int64: labels
    shifted by one as the model's loss shifts them (transformers' ForCausalLMLoss), -100 left out."""
    import torch
    import torch.nn.functional as F

    shifted = labels[:, 1:].reshape(-1)
    flat = logits[:, :-1, :].reshape(-1, logits.shape[-1]).float()
    total = F.cross_entropy(flat, shifted, ignore_index=IGNORE_INDEX, reduction="sum")
    return total.double(), (shifted != IGNORE_INDEX).sum().to(torch.int64)


def combine(rows: Iterable[Iterable[float]]) -> tuple[Optional[float], int]:
    """(token-weighted mean loss, tokens) from every rank's (loss sum, tokens), added in rank order."""
    total, tokens = 0.0, 0
    for row in rows:
        values = list(row)
        total += values[0]
        tokens += int(values[1])
    return (total / tokens if tokens else None), tokens


def perplexity(loss: Optional[float]) -> Optional[float]:
    """exp(loss); None past what a float holds (a JSON event cannot carry inf)."""
    if loss is None or loss > 709.0:
        return None
    return math.exp(loss)


def done_steps(events: Iterable[dict], batches: int) -> dict[int, dict[str, Any]]:
    """The run's complete evaluations so far, by step, from its event history (every earlier start's
    events, in order): a start with --fresh forgets what came before it; an evaluation with another
    number of batches is not the same evaluation."""
    done: dict[int, dict[str, Any]] = {}
    for event in events:
        if event.get("type") == T.START and event.get("fresh"):
            done.clear()
        elif event.get("type") == T.EVAL and event.get("batches") == batches and isinstance(event.get("step"), int):
            done[event["step"]] = {k: event.get(k) for k in ("step", "loss", "perplexity", "tokens", "batches")}
    return done


@dataclass
class Evaluator:
    """One start's evaluations (every rank builds one; global rank 0 emits)."""

    samples: Samples
    positions: np.ndarray
    real: np.ndarray
    device: Any
    every_steps: Optional[int]
    every_seconds: Optional[float]
    emit: Callable[..., None]
    is_writer: bool
    done: dict[int, dict[str, Any]] = field(default_factory=dict)
    clock: Optional[float] = None
    """Global rank 0's time when the seconds since the last evaluation began (agreed by every rank)."""

    @property
    def batches(self) -> int:
        return len(self.positions)

    @property
    def last(self) -> Optional[dict[str, Any]]:
        """The newest complete evaluation of this run (final/ records it)."""
        return self.done[max(self.done)] if self.done else None

    def due(self, step: int, now: Optional[float], *, final: bool = False) -> bool:
        """Whether to evaluate at this step boundary: the same answer on every rank (`now` is the vote's)."""
        if now is not None and self.clock is None:
            self.clock = now
        if step in self.done:
            return False
        if final or (self.every_steps and step > 0 and step % self.every_steps == 0):
            return True
        return bool(self.every_seconds and now is not None and now - self.clock >= self.every_seconds)

    def evaluate(
        self, engine, step: int, interrupted: Callable[[], bool], now: Optional[float] = None
    ) -> Optional[dict[str, Any]]:
        """Every rank together. The evaluation's figures, or None when a preemption interrupted it
        (nothing is recorded: the step is evaluated again after the resume)."""
        import torch
        import torch.distributed as dist

        start = time.perf_counter()
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        engine.train(False)  # eval mode (DeepSpeed's eval() is exactly this): no dropout
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        try:
            with torch.no_grad():
                for indices, real in zip(self.positions, self.real):
                    fault_point("eval_batch", step)
                    if interrupted():
                        return None
                    ids = torch.from_numpy(self.samples.ids[indices]).to(self.device)
                    labels = self.samples.labels[indices].copy()
                    labels[~real] = IGNORE_INDEX  # filler under ZeRO-3: every rank runs every forward
                    labels = torch.from_numpy(labels).to(self.device)
                    logits = engine(input_ids=ids).logits
                    batch_sum, batch_tokens = token_loss_sum(logits, labels)
                    total += batch_sum
                    tokens += batch_tokens
        finally:
            engine.train()
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        seconds = time.perf_counter() - start
        mine = torch.tensor([total.item(), float(tokens.item()), seconds], dtype=torch.float64, device=self.device)
        world = dist.get_world_size()
        everyone = torch.empty(world * mine.numel(), dtype=torch.float64, device=self.device)
        dist.all_gather_into_tensor(everyone, mine)
        rows = everyone.view(world, -1).cpu().tolist()
        loss, count = combine(rows)
        seconds = max(r[2] for r in rows)  # the slowest rank's: what the step waited
        result = {"step": step, "loss": loss, "perplexity": perplexity(loss), "tokens": count, "batches": self.batches}
        self.done[step] = result
        if now is not None:
            self.clock = now + rows[0][2]  # rank 0's clock again: the seconds count training only
        self.emit("eval", **result, seconds=round(seconds, 6))
        if self.is_writer:
            shown = "n/a" if loss is None else f"{loss:.4f}"
            ppl = "n/a" if result["perplexity"] is None else f"{result['perplexity']:.2f}"
            print(f"eval step {step} | loss {shown} | ppl {ppl} | {count} tokens | {seconds:.2f} s", flush=True)
        return result


def build_evaluator(
    recipe,
    held_out: Optional[Samples],
    *,
    device,
    dp_rank: int,
    dp_size: int,
    emit: Callable[..., None],
    is_writer: bool,
    history: Iterable[dict] = (),
) -> Optional[Evaluator]:
    """The start's evaluator, or None when the recipe names no held-out set."""
    if held_out is None:
        return None
    micro = recipe.train.micro_batch_size
    positions, real = eval_positions(len(held_out), recipe.eval.batches, micro, dp_rank, dp_size, recipe.train.seed)
    evaluator = Evaluator(
        held_out, positions, real, device, recipe.eval.every_steps, recipe.eval.every_seconds, emit, is_writer
    )
    evaluator.done = done_steps(history, evaluator.batches)
    return evaluator


def any_rank(flag: bool, device) -> bool:
    """Whether any rank's flag is set (every rank calls it, at the same point)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def has_tokens(held_out: Samples) -> bool:
    """Whether the held-out set has a single token to evaluate (labels shifted as the loss does)."""
    return bool((held_out.labels[:, 1:] != IGNORE_INDEX).any())
