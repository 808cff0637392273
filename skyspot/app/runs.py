"""The runs' use-cases after launch: `status`, `logs`, `cancel` and `resume`, for local runs and SkyPilot
managed jobs alike. Each asks the run's executor (executors.executor_for), which knows how; the CLI
parses the flags, asks the questions and prints what these return.

`status` caches a finished local run's row in the ledger, keyed by the signature of its events, so a
long list of finished runs is not re-read each time (SUMMARY_VERSION: a row cached by an older version
is recomputed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from skyspot.app.status import events_signature, latest_losses, run_events, setup_failure, summarize
from skyspot.errors import SkyspotError, UsageError
from skyspot.events import EventLog, gc_paused, oversized_note
from skyspot.executors import Executor, executor_for, refresh
from skyspot.ledger import Ledger, Run
from skyspot.statuses import RunStatus

SUMMARY_VERSION = 6
"""The version of the row `status` caches for a finished run; a new one here recomputes older rows."""
RECENT_FINISHED = 5
"""Finished runs `status` lists without --all, newest first, so a run that just ended is still seen."""


@dataclass
class StatusView:
    """What `status` shows: one summary row per run (app/status.py summarize), and what it noticed."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """An executor's records that could not be refreshed (SkyPilot not reachable), in its words."""
    malformed_events: int = 0
    damaged_ledger_rows: int = 0

    @property
    def failures(self) -> list[str]:
        """One line per failed run that knows why: 'NAME STATUS: CAUSE' (SkyPilot's failure statuses,
        every FAILED_* included)."""
        return [
            f"{r['name']} {r['status']}: {r['cause']}"
            for r in self.rows
            if r.get("cause") and (RunStatus.from_sky(r.get("status")) or RunStatus.PENDING).is_failed()
        ]


def status(*, all_runs: bool = False) -> StatusView:
    """Every run that has not ended and the newest finished ones (`all_runs`: every run), summarized."""
    view = StatusView()
    with Ledger() as ledger:
        runs = ledger.runs(include_finished=True)
        view.damaged_ledger_rows = ledger.skipped_rows
        if not all_runs:
            recent = [r for r in runs if r.terminal][:RECENT_FINISHED]
            runs = [r for r in runs if not r.terminal or r in recent]
        records, view.notes = refresh(runs)
        for run in runs:
            row, malformed = _row(ledger, run, records.get(run.name))
            view.rows.append(row)
            view.malformed_events += malformed
            note = oversized_note(row.get("oversized_event_files") or [])
            if note:
                view.notes.append(f"{row['name']}: {note}")
    return view


def _row(ledger: Ledger, run: Run, record: Optional[dict[str, Any]]) -> tuple[dict[str, Any], int]:
    """One run's status row and its malformed event lines: the cached row of a finished local run whose
    events have not changed, else summarized from its events (and cached when it has finished)."""
    executor = executor_for(run)
    cacheable = run.terminal and executor.local_events
    signature = f"{SUMMARY_VERSION}:{events_signature(run)}" if cacheable else None
    cached = run.info.get("summary") if cacheable else None
    if isinstance(cached, dict) and cached.get("status") == run.status and run.info.get("summary_of") == signature:
        return cached, int(cached.get("malformed_event_lines") or 0)
    with gc_paused():  # a run's events: millions of objects, no cycles (events.gc_paused)
        try:
            log = run_events(run, store_ok=not executor.local_events)
        except Exception:  # an unreachable store: still list the run, from the ledger alone
            log = EventLog()
        row = summarize(run, log, record)
    if row["status"] == "FAILED_SETUP" and not row.get("cause") and not executor.local_events:
        try:  # what setup said about the node it could not mend (node_env.record_failure)
            row["cause"] = setup_failure(run)
        except Exception:  # an unreachable store: the status alone
            pass
    if cacheable and signature is not None:  # the same: a signature is made for what is cacheable
        try:
            ledger.cache_summary(run.name, row, signature)
        except Exception:  # a read-only or busy ledger: the cache is only an optimisation
            pass
    return row, log.malformed


def find_run(name: Optional[str], *, live: bool = False) -> Run:
    """The run named `name`, or without one the newest run (`live`: the newest that has not ended), as
    `sky jobs logs` defaults to the latest job. UsageError when there is none."""
    with Ledger() as ledger:
        if name:
            return ledger.get(name)
        runs = [r for r in ledger.runs(include_finished=True) if not (live and r.terminal)]
    if not runs:
        raise UsageError(
            "no running run to cancel; `skyspot status -a` lists runs"
            if live
            else "no runs yet: `skyspot launch tiny --local` starts one"
        )
    return runs[0]


def logs(run: Run, *, follow: bool) -> int:
    """Copy the run's log to stdout (`follow`: across recoveries until it ends); the exit code to pass on."""
    return executor_for(run).logs(run, follow=follow)


def latest(run: Run) -> dict[str, Any]:
    """The newest train and eval loss in the run's events (app/status.py latest_losses); empty when its
    events cannot be read."""
    try:
        log = run_events(run, store_ok=not executor_for(run).local_events)
    except Exception:  # an unreachable store: the log was the point
        return {}
    return latest_losses(log)


def runs_to_cancel(name: Optional[str], *, all_runs: bool) -> list[Run]:
    """What `cancel` would stop: every run that has not ended (`all_runs`), the one named, or the newest
    one still going; a named run that already ended is returned as it is (the CLI says so)."""
    if all_runs and name:
        raise UsageError("give a run name or --all, not both")
    if all_runs:
        with Ledger() as ledger:
            return list(ledger.runs(include_finished=False))
    return [find_run(name, live=True)]


def cancel(runs: list[Run]) -> list[tuple[Run, SkyspotError]]:
    """Stop each run gracefully (emergency checkpoint, then stop) and mark it CANCELLED; the runs that could
    not be reached, with why (one of them must not stop the others). A single run's error is raised."""
    failed = []
    with Ledger() as ledger:
        for run in runs:
            try:
                executor_for(run).cancel(run, ledger)
            except SkyspotError as error:
                if len(runs) == 1:
                    raise
                failed.append((run, error))
    return failed


@dataclass
class PreparedResume:
    """A resume checked (prepare_resume): the run, its executor, the question it costs, and the
    SKYSPOT_* settings of this shell that it ignores (a resumed run keeps the ones it was launched with)."""

    run: Run
    executor: Executor
    question: Optional[str]
    ignored: list[str]


def prepare_resume(name: str) -> PreparedResume:
    from skyspot.recipe import is_override_variable  # here: the recipe module loads pydantic, which status avoids

    with Ledger() as ledger:
        run = ledger.get(name)
    if run.status == "SUCCEEDED":
        raise UsageError(f"run '{name}' finished (SUCCEEDED): nothing to resume")
    ignored = sorted(variable for variable in os.environ if is_override_variable(variable))
    executor = executor_for(run)
    return PreparedResume(run=run, executor=executor, question=executor.resume_question(run), ignored=ignored)


def resume(prepared: PreparedResume, *, detach: bool) -> int:
    """Continue the run under its own name from its newest durable checkpoint; the exit code to pass on."""
    return prepared.executor.resume(prepared.run, detach=detach)
