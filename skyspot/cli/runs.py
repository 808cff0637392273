"""`skyspot status`, `skyspot logs` and `skyspot cancel`: local runs and SkyPilot managed jobs together."""

from __future__ import annotations


import typer

from skyspot.cli.common import Column, confirm, display, handle_errors, in_place_text, loss_text, usd
from skyspot.cli.options import JsonOption, OptionalRunArgument, YesOption
from skyspot.console import err
from skyspot.errors import SkyspotError

# On a narrow terminal the columns with the highest `drop` are hidden first (docs: `status --json` has all).
STATUS_COLUMNS = [Column("name", "NAME"), Column("recipe", "RECIPE", 9), Column("executor", "EXECUTOR", 10),
                  Column("status", "STATUS"), Column("where", "WHERE", 5), Column("capacity", "CAPACITY", 6),
                  Column("progress", "STEP", 2, right=True), Column("recoveries", "#RECOVERIES", 3, right=True),
                  Column("last_checkpoint", "LAST CKPT", 7, right=True), Column("elapsed", "ELAPSED", 8, right=True),
                  Column("cost", "EST. COST", 4)]
# Shown when a listed run has a deadline (docs/deadline.md): its mode, projected finish and the deadline.
DEADLINE_COLUMN = Column("deadline_text", "DEADLINE", 6)
# Shown when a listed run was restarted in place (#26): on the same machines, apart from #RECOVERIES.
IN_PLACE_COLUMN = Column("in_place", "IN PLACE", 4, right=True)
# A finished run's status row is cached in the ledger; a new version here recomputes rows cached by an older one.
SUMMARY_VERSION = 6
SIM_NOTE = "(sim): a local run, priced as the cloud instance it stands for (estimates, not a bill)"


@handle_errors
def status_command(
    as_json: JsonOption = False,
    all_runs: bool = typer.Option(False, "-a", "--all", help="Include finished runs."),
) -> None:
    """Every run: status, where, spot or on-demand, step, #RECOVERIES, last checkpoint, elapsed, cost so far."""
    from skyspot.executors import executor_for, refresh
    from skyspot.ledger import Ledger
    from skyspot.app.status import events_signature, run_events, setup_failure, summarize

    with Ledger() as ledger:
        runs = ledger.runs(include_finished=True)
        damaged_rows = ledger.skipped_rows
        if not all_runs:
            # Finished runs are hidden, except the newest few, so a just-finished run is still seen.
            recent = [r for r in runs if r.terminal][:5]
            runs = [r for r in runs if not r.terminal or r in recent]
        records, notes = refresh(runs)
        rows, skipped = [], 0
        for run in runs:
            executor = executor_for(run)
            cacheable = run.terminal and executor.local_events
            signature = f"{SUMMARY_VERSION}:{events_signature(run)}" if cacheable else None
            cached = run.info.get("summary") if cacheable else None
            if (isinstance(cached, dict) and cached.get("status") == run.status
                    and run.info.get("summary_of") == signature):
                rows.append(cached)  # a finished local run whose events have not changed since
                skipped += int(cached.get("malformed_event_lines") or 0)
                continue
            try:
                log = run_events(run, store_ok=not executor.local_events)
            except Exception:  # an unreachable store: still list the run, from the ledger alone
                from skyspot.events import EventLog

                log = EventLog()
            row = summarize(run, log, records.get(run.name))
            if row["status"] == "FAILED_SETUP" and not row.get("cause") and not executor.local_events:
                try:  # what setup said about the node it could not mend (node_env.record_failure)
                    row["cause"] = setup_failure(run)
                except Exception:  # an unreachable store: the status alone
                    pass
            skipped += log.malformed
            rows.append(row)
            if cacheable:
                try:
                    ledger.update(run.name, info={**run.info, "summary": row, "summary_of": signature})
                except Exception:  # a read-only or busy ledger: the cache is only an optimisation
                    pass
    for row in rows:
        row["where"] = "/".join(x for x in (row["cloud"], row["region"]) if x) or "-"
        row["capacity"] = None if row["spot"] is None else ("spot" if row["spot"] else "on-demand")
        row["progress"] = f"{row['step']}/{row['total_steps'] or '?'}"
        row["cost"] = None if row["cost_so_far_usd"] is None else usd(row["cost_so_far_usd"]) + (
            " (sim)" if row["simulated"] else "")
        row["elapsed"] = _duration(row["elapsed_seconds"])
        row["deadline_text"] = _deadline_text(row.get("deadline"))
        row["in_place"] = in_place_text(row)
    columns = (STATUS_COLUMNS + ([IN_PLACE_COLUMN] if any(r.get("restarts_in_place") or r.get("hangs") for r in rows)
                                 else [])
               + ([DEADLINE_COLUMN] if any(r.get("deadline") for r in rows) else []))
    display(rows, columns, as_json=as_json, empty="no runs yet: `skyspot launch tiny --local` starts one",
            caption=SIM_NOTE if not as_json and any(r["simulated"] for r in rows) else None)
    if not as_json:
        for row in rows:
            if row.get("cause") and str(row["status"]).startswith("FAILED"):
                err.print(f"{row['name']} {row['status']}: {row['cause']}", markup=False, highlight=False)
    for note in notes:
        err.print(note)
    if skipped:
        err.print(f"skipped {skipped} malformed event line(s)")
    if damaged_rows:
        err.print(f"skipped {damaged_rows} damaged ledger row(s); `skyspot cost-report` skips them too")


def _deadline_text(deadline: dict | None) -> str | None:
    """`spot, ETA 14:02:10 <= due 15:00:00`, `waiting for spot ...`, or `met (due ...)` once it ended."""
    if not deadline:
        return None
    from skyspot.planning.deadline import clock

    due = f"due {clock(deadline['at'])}"
    if deadline.get("met") is not None:
        return f"{'met' if deadline['met'] else 'MISSED'} ({due})"
    mode = {"idle": "waiting for spot"}.get(deadline.get("mode"), deadline.get("mode")) or "planning"
    if deadline.get("unreachable"):  # said as soon as the policy finds it (docs/deadline.md)
        mode = f"UNREACHABLE, {mode} to the end"
    eta = deadline.get("projected_finish")
    if eta is None:
        return f"{mode}, {due}"
    return f"{mode}, ETA {clock(eta)} {'<=' if eta <= deadline['at'] else '> LATE,'} {due}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")


def _latest(ledger, *, live: bool = False):
    """The newest run (`live`: the newest that has not ended), as `sky jobs logs` defaults to the latest job."""
    from skyspot.errors import UsageError

    runs = [r for r in ledger.runs(include_finished=True) if not (live and r.terminal)]
    if not runs:
        raise UsageError("no running run to cancel; `skyspot status -a` lists runs" if live
                         else "no runs yet: `skyspot launch tiny --local` starts one")
    return runs[0]


@handle_errors
def logs_command(
    run_name: OptionalRunArgument = None,
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep following the log across recoveries until the run ends."),
) -> None:
    """Show a run's log (the newest run's by default); -f follows it across recoveries."""
    from skyspot.executors import executor_for
    from skyspot.ledger import Ledger

    with Ledger() as ledger:
        run = ledger.get(run_name) if run_name else _latest(ledger)
        if run_name is None:
            err.print(f"logs of '{run.name}', the newest run", markup=False)
    executor = executor_for(run)
    code = executor.logs(run, follow=follow)
    losses = _latest_losses(run, executor)
    if losses:
        err.print(f"latest: {losses}", markup=False, highlight=False)
    raise typer.Exit(code)


def _latest_losses(run, executor) -> str:
    """The newest train and eval loss from the run's events, said after its log (#25); nothing when the
    events cannot be read: the log itself was shown."""
    from skyspot.app.status import latest_losses, run_events

    try:
        log = run_events(run, store_ok=not executor.local_events)
    except Exception:  # an unreachable store: the log was the point
        return ""
    return loss_text(latest_losses(log))


@handle_errors
def cancel_command(
    run_name: OptionalRunArgument = None,
    all_runs: bool = typer.Option(False, "-a", "--all", help="Cancel every run that has not ended."),
    yes: YesOption = False,
) -> None:
    """Stop a run gracefully (emergency checkpoint, then stop) and mark it CANCELLED; without RUN, the newest
    run still going."""
    from skyspot.errors import UsageError
    from skyspot.executors import executor_for
    from skyspot.ledger import Ledger

    if all_runs and run_name:
        raise UsageError("give a run name or --all, not both")
    with Ledger() as ledger:
        if all_runs:
            runs = [r for r in ledger.runs(include_finished=False)]
            if not runs:
                err.print("no run to cancel: every run has ended")
                return
            names = ", ".join(r.name for r in runs)
            if not confirm(f"Cancel {len(runs)} run(s): {names}?", yes):
                err.print("not cancelled")
                raise typer.Exit(1)
        else:
            run = ledger.get(run_name) if run_name else _latest(ledger, live=True)
            if run.terminal:
                err.print(f"run '{run.name}' already ended: {run.status}")
                return
            if not confirm(f"Cancel run '{run.name}'?", yes):
                err.print("not cancelled")
                raise typer.Exit(1)
            runs = [run]
        failed = 0
        for run in runs:
            try:
                executor_for(run).cancel(run, ledger)
            except SkyspotError as error:  # one run that cannot be reached must not stop the others
                if len(runs) == 1:
                    raise
                failed += 1
                err.print(f"run '{run.name}': not cancelled ({error})", markup=False)
        if failed:
            raise typer.Exit(1)
