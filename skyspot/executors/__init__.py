"""Executors run a rendered task: `sky` submits it as a SkyPilot managed job, `local` runs it on this machine.

Both stand behind one small surface, `Executor`: a launch asks `launch_executor("sky" | "local", flags, recipe)`
and `submit`s; every later command asks `executor_for(run)`; nothing outside executors/ tests which executor a
run has. Each executor module (executors/sky/executor.py, executors/local/executor.py) defines its `EXECUTOR` (and `executor(flags, recipe)`
for a launch); executors talk to the user through skyspot/console.py, never through the CLI.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol, Sequence, Union

if TYPE_CHECKING:
    from skyspot.executors.local.spot_trace import SpotTrace
    from skyspot.ledger import Ledger, Run
    from skyspot.recipe import Recipe
    from skyspot.task.render import RenderedTask

_MODULES = {"sky": "skyspot.executors.sky.executor", "local": "skyspot.executors.local.executor"}


class Executor(Protocol):
    """What the CLI asks of a run's executor."""

    name: str
    """The ledger's executor column: 'local' or 'sky'."""
    local_events: bool
    """The run's events are files on this machine: read there, never from the store, so a finished
    run's status row can be cached against their signature (skyspot/app/status.py events_signature)."""
    runs_here: bool
    """The run's nodes are this machine: preflight may read this machine's files for it (app/preflight.py)."""
    simulated: bool
    """The run's prices are what the instance it stands for would cost, not a bill (cost-report says so)."""
    installs_package: bool
    """The run's nodes install skyspot from the wheel built at launch (task/package.py): cloud VMs and a fresh
    local node; other local runs use the skyspot installed here."""
    start_seconds: float
    """What starting the run's nodes takes before the trainer runs, when this executor knows it (the local
    one's simulated provisioning); a deadline's feasibility counts it."""

    def launch_question(self, rendered: RenderedTask) -> Optional[str]:
        """The confirmation launching this costs (money), or None; asked after the plan is shown."""

    def check(self, rendered: RenderedTask) -> None:
        """Refuse what this executor cannot launch (no store, a missing secret, no enabled cloud),
        before anything is recorded."""

    def submit(self, rendered: RenderedTask, *, detach: bool, deadline: Optional[dict[str, Any]]) -> int:
        """Record the run under `rendered.run_name` and start it (a `deadline`: launch.plan_deadline's plan);
        returns the exit code to pass on (attached: the run's own)."""

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

    def deadline_inputs(self, run: Run, plan: dict[str, Any], events: Sequence[dict[str, Any]]) -> DeadlineInputs:
        """What cost-report's deadline comparison replays for this run; UsageError (one line) when it
        cannot be known."""


@dataclass
class DeadlineInputs:
    """The spot a deadline run met and the restart figures to replay it with (deadline.compare)."""

    trace: SpotTrace
    t0: float
    """When the trace's time 0 is (unix time)."""
    provision_seconds: float
    restart_prior: float
    notice_seconds: float
    source: str
    """How the trace is known, for the report: replayed from the run's spot trace, or as observed."""


def executor_for(run: Union[Run, str]) -> Executor:
    """The executor that runs `run` (a ledger row, or an executor's name; a row of an unknown executor is
    treated as local, as it always was), with its defaults."""
    name = run if isinstance(run, str) else run.executor
    if isinstance(run, str) and name not in _MODULES:
        raise ValueError(f"no executor named {name!r}")
    return importlib.import_module(_MODULES.get(name, _MODULES["local"])).EXECUTOR


def launch_executor(name: str, flags: Mapping[str, Any], recipe: Recipe) -> Executor:
    """A new run's executor ("sky" or "local"), which builds its own options from the launch's raw executor
    flags (by name, None for not given) and refuses, in one line, the ones it does not take or that do not
    fit the recipe, before anything is printed or started."""
    if name not in _MODULES:
        raise ValueError(f"no executor named {name!r}")
    return importlib.import_module(_MODULES[name]).executor(flags, recipe)


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
