"""One event builder for the tests: an event as the trainer or the executor writes it, checked with the
readers' own rule (events.valid_event), so a test cannot feed the readers a line they would skip.

    event(12.0, "step", 0, step=3, loss=1.0)            # a trainer event of rank 0 on node 0
    event(10.0, "attempt_start", 1, rank=None, where=W)  # an executor event (no rank)
"""

from __future__ import annotations

from typing import Any, Optional

from skyspot.events import valid_event

RUN_ID = "run-1"


def event(ts: float, type: str, attempt: int = 0, *, rank: Optional[int] = 0, node_rank: int = 0,
          run_id: str = RUN_ID, **fields: Any) -> dict[str, Any]:
    built = {"ts": float(ts), "run_id": run_id, "attempt": attempt, "node_rank": node_rank, "rank": rank,
             "type": type, **fields}
    assert valid_event(built), f"the readers would skip this event (events.valid_event): {built}"
    return built
