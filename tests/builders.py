"""One event builder for the tests: an event as the trainer or the executor writes it, checked with the
readers' own rule (events.valid_event), so a test cannot feed the readers a line they would skip.

    event(12.0, "step", 0, step=3, loss=1.0)            # a trainer event of rank 0 on node 0
    event(10.0, "attempt_start", 1, rank=None, where=W)  # an executor event (no rank)
"""

from __future__ import annotations

from typing import Any, Optional

from skyspot.events import valid_event

RUN_ID = "run-1"


def event(
    ts: float,
    type: str,
    attempt: int = 0,
    *,
    rank: Optional[int] = 0,
    node_rank: int = 0,
    run_id: str = RUN_ID,
    **fields: Any,
) -> dict[str, Any]:
    built = {
        "ts": float(ts),
        "run_id": run_id,
        "attempt": attempt,
        "node_rank": node_rank,
        "rank": rank,
        "type": type,
        **fields,
    }
    assert valid_event(built), f"the readers would skip this event (events.valid_event): {built}"
    return built


# The events of #25 and #26, with the contract's fields (docs/events.md); a test names what it cares about.


def eval_event(
    ts: float,
    attempt: int = 0,
    *,
    step: int,
    loss: float,
    seconds: float = 1.0,
    perplexity: Optional[float] = None,
    tokens: int = 4096,
    batches: int = 4,
    **more: Any,
) -> dict[str, Any]:
    """An evaluation, written by global rank 0 when it ends (`seconds`: the time it took)."""
    import math

    return event(
        ts,
        "eval",
        attempt,
        step=step,
        loss=loss,
        perplexity=math.exp(loss) if perplexity is None else perplexity,
        tokens=tokens,
        batches=batches,
        seconds=seconds,
        **more,
    )


def restart_event(
    ts: float,
    attempt: int = 0,
    *,
    failed_at: float,
    step: int,
    steps_redone: int,
    cause: str = "crash",
    restart: int = 1,
    **more: Any,
) -> dict[str, Any]:
    """An in-place restart, written by the new processes' global rank 0 at their first step (`ts`)."""
    return event(
        ts,
        "restart_in_place",
        attempt,
        cause=cause,
        failed_at=failed_at,
        seconds_to_next_step=ts - failed_at,
        steps_redone=steps_redone,
        restart=restart,
        step=step,
        **more,
    )


def hang_event(
    ts: float,
    attempt: int = 0,
    *,
    step: int,
    seconds_without_step: float,
    bound_seconds: float,
    node_rank: int = 0,
    stacks: str = "stacks/hang-1",
    ranks: Optional[list] = None,
) -> dict[str, Any]:
    """The node supervisor's watchdog: no step for `seconds_without_step` (> `bound_seconds`)."""
    ranks = [{"rank": 0, "local_rank": 0, "pid": 100, "top": "loop.py:700 train"}] if ranks is None else ranks
    return event(
        ts,
        "hang",
        attempt,
        rank=None,
        node_rank=node_rank,
        step=step,
        seconds_without_step=seconds_without_step,
        bound_seconds=bound_seconds,
        ranks=ranks,
        stacks=stacks,
    )
