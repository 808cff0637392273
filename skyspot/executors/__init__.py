"""Executors run a rendered task: `sky` submits it as a SkyPilot managed job, `local` runs it on this machine.

Both stand behind one small surface, `Executor`: the CLI asks `executor_for(run)` and never which executor a
run has. Each executor module (executors/sky.py, executors/local.py) defines its `EXECUTOR`; executors talk
to the user through skyspot/console.py, never through the CLI.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    from skyspot.ledger import Ledger, Run

_MODULES = {"sky": "skyspot.executors.sky", "local": "skyspot.executors.local"}


class Executor(Protocol):
    """What the CLI asks of a run's executor."""

    name: str
    """The ledger's executor column: 'local' or 'sky'."""
    local_events: bool
    """The run's events are files on this machine: read there, never from the store, so a finished
    run's status row can be cached against their signature (skyspot/runs.py events_signature)."""

    def refresh(self, runs: list[Run]) -> tuple[dict[str, dict[str, Any]], Optional[str]]:
        """The executor's own records of these runs, by run name (kept in the ledger too), and a note
        when they could not be refreshed."""

    def logs(self, run: Run, *, follow: bool) -> int:
        """Copy the run's log to stdout (`follow`: until the run ends); returns the exit code to pass on."""

    def cancel(self, run: Run, ledger: Ledger) -> None:
        """Stop a run gracefully (emergency checkpoint, then stop) and mark it CANCELLED."""

    def resume_question(self, run: Run) -> Optional[str]:
        """The confirmation resuming this run needs (it costs money), or None."""

    def resume(self, run: Run, *, detach: bool) -> int:
        """Continue a stopped run under its own name from its newest durable checkpoint; returns the exit code."""


def executor_for(run: Run) -> Executor:
    """The executor that runs `run` (a row of an unknown executor is treated as local, as it always was)."""
    return importlib.import_module(_MODULES.get(run.executor, _MODULES["local"])).EXECUTOR


def refresh(runs: list[Run]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Every executor's records of these runs, by run name, and its notes (e.g. SkyPilot not reachable)."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(executor_for(run).name, []).append(run)
    records: dict[str, dict[str, Any]] = {}
    notes = []
    for group in groups.values():
        found, note = executor_for(group[0]).refresh(group)
        records.update(found)
        if note:
            notes.append(note)
    return records, notes
