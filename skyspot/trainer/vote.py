"""The step boundary's vote: what every rank saw since the last one, agreed in one all-gather.

Each rank sends a `Ballot` (a few float64 numbers, in the order of its fields); every rank reads all
of them back by field name and tallies the same `Vote`. A signal or notice seen on one rank reaches
them all here, so the emergency checkpoint is collective (docs/trainer.md).
"""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass, fields
from typing import TYPE_CHECKING, Optional

from skyspot.trainer.preemption import Pending
from skyspot.trainer.say import say

if TYPE_CHECKING:
    from skyspot.trainer.phases import Run


@dataclass(frozen=True)
class Ballot:
    """One rank's numbers at a step boundary, sent as one float64 each (0 where it has none)."""

    loss: float
    tokens: float
    emergency: float
    checkpoint: float
    time_due: float
    """Global rank 0's interval clock (the other ranks send 0)."""
    first_seen: float
    deadline: float
    signaled: float
    need_s: float
    clock: float
    """This rank's time.time() at the vote."""
    stale: float = 0.0
    """The newer epoch that holds the run's store, as this node leader's uploader learnt it (fence.py); 0: none."""

    @classmethod
    def of(cls, loss: float, tokens: int, pending: Pending, time_due: bool, need_s: float, stale: int = 0) -> Ballot:
        return cls(
            loss=loss,
            tokens=float(tokens),
            emergency=float(pending.emergency),
            checkpoint=float(pending.checkpoint),
            time_due=float(time_due),
            first_seen=pending.first_seen or 0.0,
            deadline=pending.deadline or 0.0,
            signaled=float(pending.signaled),
            need_s=need_s,
            clock=time.time(),
            stale=float(stale),
        )

    def encode(self) -> list[float]:
        return list(astuple(self))

    @classmethod
    def decode(cls, numbers: list[float]) -> Ballot:
        return cls(**dict(zip(BALLOT_FIELDS, numbers, strict=True)))


BALLOT_FIELDS = tuple(f.name for f in fields(Ballot))


@dataclass
class Vote:
    """What the ranks agreed at a step boundary (one all-gather of a few numbers per rank)."""

    loss: float
    tokens: int
    emergency: bool
    checkpoint: bool
    time_due: bool
    first_seen: Optional[float]
    deadline: Optional[float]
    seconds: float
    signaled: bool = False
    """A signal, not only a notice: save now."""
    need_s: float = 0.0
    """The slowest node leader's next step plus predicted save to safety (other ranks send 0); 0 when a
    leader sent -1 (nothing measured yet, or checkpoint.train_through_notice off)."""
    now: float = 0.0
    """Global rank 0's clock at the vote: every rank decides on the same number."""
    stale: int = 0
    """A newer attempt's epoch holds the run's store (some node's uploader was refused): stop, exit STALE."""


def tally(ballots: list[Ballot], seconds: float) -> Vote:
    """The same Vote on every rank, from every rank's ballot (global rank 0's first)."""
    seen = [b.first_seen for b in ballots if b.first_seen > 0]
    deadlines = [b.deadline for b in ballots if b.deadline > 0]
    return Vote(
        loss=sum(b.loss for b in ballots) / len(ballots),
        tokens=int(sum(b.tokens for b in ballots)),
        emergency=any(b.emergency > 0 for b in ballots),
        checkpoint=any(b.checkpoint > 0 for b in ballots),
        time_due=ballots[0].time_due > 0,
        first_seen=min(seen) if seen else None,
        deadline=min(deadlines) if deadlines else None,
        seconds=seconds,
        signaled=any(b.signaled > 0 for b in ballots),
        now=ballots[0].clock,
        need_s=0.0 if any(b.need_s < 0 for b in ballots) else max(b.need_s for b in ballots),
        stale=int(max(b.stale for b in ballots)),
    )


def cast(run: Run, ballot: Ballot) -> Vote:
    """Every rank: send this rank's ballot, read everyone's, tally."""
    # Lazy: torch loads after setup's GPU check, and this module is imported by the entry point (loop.py).
    import torch
    import torch.distributed as dist

    start = time.perf_counter()
    device, world = run.started.device, run.placement.world_size
    mine = torch.tensor(ballot.encode(), dtype=torch.float64, device=device)
    everyone = torch.empty(world * mine.numel(), dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(everyone, mine)
    rows = everyone.view(world, -1).cpu().tolist()
    return tally([Ballot.decode(row) for row in rows], time.perf_counter() - start)


def report_local(run: Run, pending: Pending) -> None:
    """Signals and notices are reported by the rank that saw them."""
    events = run.started.events
    for signum, name, ts in pending.signals:
        events.emit("signal", signum=signum, name=name, received=ts)
        say(f"rank {run.placement.rank}: {name}: emergency checkpoint at the next step boundary")
    for notice in pending.notices:
        # A warning (a rebalance recommendation, maintenance ahead of its deadline) ends nothing:
        # its own type, so the cost report's notices are only those that ended an attempt.
        events.emit(
            "shutdown_warning" if notice.get("warning") else "preemption_notice",
            source=notice["source"],
            deadline=notice["deadline"],
            action=notice["action"],
            received=notice["received"],
        )


def boundary(run: Run, loss: float = 0.0, tokens: int = 0, step_s: float = 0.0) -> Vote:
    """Every rank at a step boundary: report what it saw, then vote."""
    pending = run.started.watch.take()
    report_local(run, pending)
    time_due = run.placement.is_global_zero and run.trained.ckpt.interval_elapsed()
    uploader = run.started.uploader
    stale = uploader.stale.newer if uploader is not None and uploader.stale is not None else 0
    return cast(run, Ballot.of(loss, tokens, pending, time_due, need_seconds(run, step_s), stale))


def need_seconds(run: Run, step_s: float) -> float:
    """A node leader's time for one more step and a save that ends safe (its node's part durable, or
    committed without a store); -1 when it has measured none yet. Sent every step, since a notice seen
    on one node must be judged by every node's figure. Other ranks send 0: their part is written
    alongside, and the leader's figure (which waits for the whole node) covers it."""
    if not run.placement.is_node_leader:
        return 0.0
    built = run.trained
    predicted = built.predictor.predict() if built.predictor is not None else None
    if predicted is None or not built.recipe.checkpoint.train_through_notice:
        return -1.0
    if built.ckpt.writing:
        predicted *= 2  # an interval checkpoint still being written goes first
    return step_s + predicted
