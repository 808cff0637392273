"""A rehearsal's task: the real run's task, with the store round trip before the trainer and no retries.

app/rehearse.py renders a rehearsal recipe (the real one with the model swapped for the bundled tiny model
and a few steps) exactly as a real launch renders (app/launch.py build), so setup, mounts, secrets and the
trainer's command line are the real run's. Two things differ, both here:

- `run` does the store round trip (trainer/round_trip.py) on every node right before the supervisor starts
  the trainer, with the node's own interpreter and credentials;
- `job_recovery.max_restarts_on_errors` is 0: a rehearsal reports what failed the first time, where the real
  run would retry (a failed setup is FAILED_SETUP and retried under that budget: docs/architecture.md).
"""

from __future__ import annotations

import copy
import shlex
from typing import Any, Optional

SUPERVISOR_LINE = 'exec "$PY" -m skyspot.trainer.supervise'
"""The line of task/render.py's run script that starts the trainer; the round trip goes right before it."""


def round_trip_line(store: Optional[str]) -> str:
    """The run script's round trip: the run's root in its store, or the node's run directory without one."""
    root = f'{shlex.quote(store.rstrip("/"))}/"$SKYSPOT_RUN_NAME"' if store else '"$RUN_DIR"'
    return f'"$PY" -m skyspot.trainer.round_trip {root} "$SKYPILOT_NODE_RANK"'


def rehearsal_task(task: dict[str, Any], store: Optional[str]) -> dict[str, Any]:
    """A copy of `task` as a rehearsal runs it (module docstring)."""
    rehearsal = copy.deepcopy(task)
    lines = rehearsal["run"].splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith(SUPERVISOR_LINE)), None)
    if at is None:  # task/render.py changed how it starts the trainer: say so rather than skip the round trip
        raise ValueError(f"the task's run script has no line starting {SUPERVISOR_LINE!r}")
    lines.insert(at, round_trip_line(store))
    rehearsal["run"] = "\n".join(lines) + "\n"
    rehearsal["resources"]["job_recovery"]["max_restarts_on_errors"] = 0
    return rehearsal
