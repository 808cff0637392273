"""`cost-report`'s use-case: the runs of the ledger, their events, plans and prices -> the report's data.

    reports = cost_reports("run-1")       # or None: every run in the ledger
    for r in reports.runs: r.cost (pricing.cost.RunCost), r.log (events.EventLog), r.data (the JSON row)
    reports.notes                         # lines for stderr: the executors' notes, runs without an estimate

The CLI (cli/cost.py) only parses flags, calls this once and prints; the figures themselves are
pricing/cost.py's (docs/cost.md), the deadline comparison planning/deadline.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

if TYPE_CHECKING:
    from skyspot.events import EventLog
    from skyspot.ledger import Run
    from skyspot.pricing.cost import RunCost

from skyspot.errors import SkyspotError


@dataclass
class RunReport:
    """One run's report: the figures, the events they were computed from, and the row shown (JSON, table)."""

    cost: RunCost
    log: EventLog
    data: dict[str, Any]


@dataclass
class Reports:
    runs: list[RunReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """For stderr, in order: the executors' notes, runs that got no estimate, damaged ledger rows."""
    malformed: int = 0
    """Event lines skipped over every run."""


def cost_reports(run_name: Optional[str] = None) -> Reports:
    """Every run's report (or RUN's). A named run that cannot be estimated raises its error; in the listing
    of all runs, that run is a note and the others are still reported."""
    from skyspot.executors import refresh
    from skyspot.ledger import Ledger

    with Ledger() as ledger:
        runs = [ledger.get(run_name)] if run_name else ledger.runs()
        damaged_rows = ledger.skipped_rows
    records, notes = refresh(runs)  # one question to each executor for every run, not one per run
    reports = Reports(notes=list(notes))
    for run in runs:
        try:
            reports.runs.append(run_report(run, records.get(run.name)))
        except SkyspotError as error:  # e.g. an instance the price data does not know, a store out of reach
            if run_name:
                raise
            reports.notes.append(f"{run.name}: no estimate ({error})")
    if damaged_rows:
        reports.notes.append(f"skipped {damaged_rows} damaged ledger row(s)")
    reports.malformed = sum(r.log.malformed for r in reports.runs)
    return reports


def run_report(run: Run, queue_record: Optional[Mapping[str, Any]] = None) -> RunReport:
    """One run's figures from its events, its plan's candidates (the baseline) and the executor's record."""
    from skyspot.events import gc_paused

    with gc_paused():  # millions of objects, no cycles (events.gc_paused)
        return _run_report(run, queue_record)


def _run_report(run: Run, queue_record: Optional[Mapping[str, Any]]) -> RunReport:
    from skyspot.app.status import run_events
    from skyspot.node_kinds import node_kinds
    from skyspot.pricing.cost import run_cost

    log = run_events(run)
    candidates = run.info.get("candidates") or None
    if not (isinstance(candidates, list) and all(isinstance(c, dict) for c in candidates)):
        candidates = None  # a hand-edited or damaged ledger row: fall back to the attempts' own instances
    elif not any(c.get("instance_type") for c in candidates):
        candidates = None  # CPU candidates (tiny) have no price: the baseline is the attempts' own instances
    try:
        report = run_cost(log, name=run.name, candidates=candidates, queue_record=queue_record, store=run.store)
    except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as error:
        # Events passed the reader's checks yet still do not add up: say so for this run only.
        raise SkyspotError(f"the events of run '{run.name}' do not add up ({type(error).__name__}: {error})") from None
    data = report.to_dict()
    data.update(recipe=run.recipe, executor=run.executor, status=run.status, node_kinds=node_kinds(log.events))
    if log.malformed:
        data.setdefault("warnings", []).append(f"skipped {log.malformed} malformed event line(s)")
    from skyspot.events import oversized_note

    too_big = oversized_note(log.oversized)
    if too_big:
        data.setdefault("warnings", []).append(too_big)
    if log.unknown:
        data.setdefault("warnings", []).append(
            f"skipped {log.unknown} event(s) of types this skyspot does not know ({', '.join(sorted(log.unknown_types))})"
        )
    if run.info.get("deadline"):
        data["deadline"] = deadline_report(run, log, report)
    return RunReport(report, log, data)


def deadline_report(run: Run, log: EventLog, report: RunCost) -> Optional[dict[str, Any]]:
    """`cost-report`'s comparison for a run launched with a deadline: this run against all on-demand
    and greedy on the same trace (skyspot/planning/deadline.py `compare`), the trace as the run's executor
    knows it (executors/__init__.py `DeadlineInputs`: a local run replays its own spot trace, a
    SkyPilot run the spot it observed)."""
    from skyspot.planning import deadline as dl
    from skyspot.pricing import prices as pricing
    from skyspot.errors import UsageError
    from skyspot.executors import executor_for

    plan = run.info.get("deadline")
    if not isinstance(plan, dict) or not report.attempts:
        return None
    first = report.attempts[0]
    nodes = report.nodes or 1
    try:
        prices = [
            pricing.hourly_price(
                first.cloud or "", instance_type=first.instance_type, region=first.region, zone=first.zone, spot=spot
            ).usd_per_hour
            * nodes
            for spot in (True, False)
        ]
    except UsageError as error:
        return {"deadline": plan.get("at"), "note": f"no comparison: {error}"}
    events: list[dict[str, Any]] = [e for e in log.events if e.get("type") != dl.DECISION_EVENT]
    try:
        given = executor_for(run).deadline_inputs(run, plan, log.events)
    except UsageError as error:
        return {"deadline": plan.get("at"), "note": f"no comparison: {error}"}
    result = dl.compare(
        plan,
        events,
        given.trace,
        t0=given.t0,
        total_steps=run.total_steps or 1,
        spot_usd_per_hour=prices[0],
        on_demand_usd_per_hour=prices[1],
        provision_seconds=given.provision_seconds,
        restart_prior=given.restart_prior,
        cost_usd=report.cost_usd,
        on_demand_usd=report.on_demand_cost_usd,
        notice_seconds=given.notice_seconds,
    )
    result["trace"] = given.source
    return result


def check_plot(path: Union[str, Path]) -> str:
    """The image format `--plot PATH` asks for (png, svg, pdf), checked before the report is computed."""
    from skyspot.pricing.cost_plot import plot_format

    return plot_format(path)


MAX_PLOT_ATTEMPTS = 5_000
"""The most attempts `--plot` draws: the timeline is about 1,000 pixels wide, so past this each attempt is
narrower than a fifth of a pixel, and reading and drawing them would pass the 10 s a report may take
(issue 31, item 9: 20,000 attempts took 9-10.5 s here). Such a run is refused in one line, at once."""


def check_plot_run(run_name: str) -> None:
    """Refuse `--plot` for a run of more than MAX_PLOT_ATTEMPTS attempts, counted from its events files'
    names (a directory listing, before a line is read)."""
    from skyspot.app.status import event_names
    from skyspot.errors import UsageError
    from skyspot.events import attempt_numbers
    from skyspot.ledger import Ledger

    with Ledger() as ledger:
        run = ledger.get(run_name)
    attempts = len(attempt_numbers(event_names(run)))
    if attempts > MAX_PLOT_ATTEMPTS:
        raise UsageError(
            f"run '{run_name}' has {attempts:,} attempts; --plot draws at most {MAX_PLOT_ATTEMPTS:,} (more would "
            f"each be narrower than a pixel): `skyspot cost-report {run_name} --json` has every one"
        )


def plot(run_report: RunReport, path: Union[str, Path]) -> bytes:
    """One run's timeline image (pricing/cost_plot.py) in the format PATH's suffix names."""
    from skyspot.pricing.cost_plot import plot_format, plot_run

    from skyspot.events import gc_paused

    with gc_paused():  # a figure of 20,000 attempts: many objects, no cycles worth a collection's walk
        return plot_run(run_report.cost, run_report.log, plot_format(path))


def node_lines(data: Mapping[str, Any]) -> list[str]:
    """`nodes: ...` lines: the kinds of machine the run's nodes were (node_kinds.py), from its report row."""
    from skyspot.node_kinds import kind_lines

    return kind_lines(data.get("node_kinds") or [])


def when(ts: Optional[float]) -> str:
    """A deadline's time as the report says it (planning/deadline.py when)."""
    from skyspot.planning.deadline import when as deadline_when

    return deadline_when(ts)


@dataclass
class PriceRows:
    """`prices`: the snapshot's cheapest zone per instance type and region, and the snapshot's date."""

    rows: list[dict[str, Any]]
    snapshot_date: str


def price_rows(cloud: Optional[str] = None, instance: Optional[str] = None) -> PriceRows:
    """What the shipped price snapshot holds, one row per (cloud, instance type, region) at its cheapest
    zone; zones an account must opt into (AWS Local Zones) never price a plan, so they are left out."""
    from skyspot.errors import UsageError
    from skyspot.pricing.prices import SNAPSHOT_DATE, snapshot_rows

    rows = [r for r in snapshot_rows(cloud) if not r["opt_in_zone"]]
    if instance:
        rows = [r for r in rows if r["instance_type"] == instance]
        if not rows:
            raise UsageError(f"the snapshot has no instance type '{instance}'; `skyspot prices` lists them")
    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["cloud"], r["instance_type"], r["region"])
        if key not in best or (r["usd_per_hour"] or 1e18) < (best[key]["usd_per_hour"] or 1e18):
            best[key] = r
    return PriceRows(rows=list(best.values()), snapshot_date=SNAPSHOT_DATE)
