"""`skyspot status`, `skyspot logs` and `skyspot cancel`: local runs and SkyPilot managed jobs together."""

from __future__ import annotations


import typer

from skyspot.cli.common import (
    FABRIC_MARK,
    Column,
    confirm,
    display,
    fabric_text,
    handle_errors,
    in_place_text,
    loss_text,
    usd,
)
from skyspot.cli.options import JsonOption, OptionalRunArgument, YesOption
from skyspot.console import err

# On a narrow terminal the columns with the highest `drop` are hidden first (docs: `status --json` has all).
STATUS_COLUMNS = [
    Column("name", "NAME"),
    Column("recipe", "RECIPE", 9),
    Column("executor", "EXECUTOR", 10),
    Column("status", "STATUS"),
    Column("where", "WHERE", 5),
    Column("capacity", "CAPACITY", 6),
    Column("progress", "STEP", 2, right=True),
    Column("recoveries", "#RECOVERIES", 3, right=True),
    Column("last_checkpoint", "LAST CKPT", 7, right=True),
    Column("elapsed", "ELAPSED", 8, right=True),
    Column("cost", "EST. COST", 4),
]
# Shown when a listed run has a deadline (docs/deadline.md): its mode, projected finish and the deadline.
DEADLINE_COLUMN = Column("deadline_text", "DEADLINE", 6)
# Shown when a listed run was restarted in place (#26): on the same machines, apart from #RECOVERIES.
IN_PLACE_COLUMN = Column("in_place", "IN PLACE", 4, right=True)
# Shown when a listed run's newest attempt probed its fabric: transport and bus bandwidth, marked when short.
FABRIC_COLUMN = Column("fabric_text", "FABRIC", 5)
SIM_NOTE = "(sim): a local run, priced as the cloud instance it stands for (estimates, not a bill)"


@handle_errors
def status_command(
    as_json: JsonOption = False,
    all_runs: bool = typer.Option(False, "-a", "--all", help="Include finished runs."),
) -> None:
    """Every run: status, where, spot or on-demand, step, #RECOVERIES, last checkpoint, elapsed, cost so far."""
    from skyspot.app.runs import status
    from skyspot.app.status import deadline_text

    view = status(all_runs=all_runs)
    rows = view.rows
    for row in rows:
        row["where"] = "/".join(x for x in (row["cloud"], row["region"]) if x) or "-"
        row["capacity"] = None if row["spot"] is None else ("spot" if row["spot"] else "on-demand")
        row["progress"] = f"{row['step']}/{row['total_steps'] or '?'}"
        row["cost"] = (
            None
            if row["cost_so_far_usd"] is None
            else usd(row["cost_so_far_usd"]) + (" (sim)" if row["simulated"] else "")
        )
        row["elapsed"] = _duration(row["elapsed_seconds"])
        row["deadline_text"] = deadline_text(row.get("deadline"))
        row["in_place"] = in_place_text(row)
        row["fabric_text"] = fabric_text(row.get("fabric"))
    columns = (
        STATUS_COLUMNS
        + ([IN_PLACE_COLUMN] if any(r.get("restarts_in_place") or r.get("hangs") for r in rows) else [])
        + ([DEADLINE_COLUMN] if any(r.get("deadline") for r in rows) else [])
        + ([FABRIC_COLUMN] if any(r.get("fabric") for r in rows) else [])
    )
    display(
        rows,
        columns,
        as_json=as_json,
        empty="no runs yet: `skyspot launch tiny --local` starts one",
        caption=SIM_NOTE if not as_json and any(r["simulated"] for r in rows) else None,
    )
    if not as_json:
        for line in view.failures:
            err.print(line, markup=False, highlight=False)
        for row in rows:
            if (row.get("fabric") or {}).get("warning"):
                err.print(
                    f"{row['name']} fabric {FABRIC_MARK}: {row['fabric']['warning']}", markup=False, highlight=False
                )
    for note in view.notes:
        err.print(note)
    if view.malformed_events:
        err.print(f"skipped {view.malformed_events} malformed event line(s)")
    if view.damaged_ledger_rows:
        err.print(f"skipped {view.damaged_ledger_rows} damaged ledger row(s); `skyspot cost-report` skips them too")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")


@handle_errors
def logs_command(
    run_name: OptionalRunArgument = None,
    follow: bool = typer.Option(
        False, "-f", "--follow", help="Keep following the log across recoveries until the run ends."
    ),
) -> None:
    """Show a run's log (the newest run's by default); -f follows it across recoveries."""
    from skyspot.app.runs import find_run, latest, logs

    run = find_run(run_name)
    if run_name is None:
        err.print(f"logs of '{run.name}', the newest run", markup=False)
    code = logs(run, follow=follow)
    losses = loss_text(latest(run))  # the newest train and eval loss, said after the log (#25)
    if losses:
        err.print(f"latest: {losses}", markup=False, highlight=False)
    raise typer.Exit(code)


@handle_errors
def cancel_command(
    run_name: OptionalRunArgument = None,
    all_runs: bool = typer.Option(False, "-a", "--all", help="Cancel every run that has not ended."),
    yes: YesOption = False,
) -> None:
    """Stop a run gracefully (emergency checkpoint, then stop) and mark it CANCELLED; without RUN, the newest
    run still going."""
    from skyspot.app.runs import cancel, runs_to_cancel

    runs = runs_to_cancel(run_name, all_runs=all_runs)
    if all_runs:
        if not runs:
            err.print("no run to cancel: every run has ended")
            return
        question = f"Cancel {len(runs)} run(s): {', '.join(r.name for r in runs)}?"
    else:
        if runs[0].terminal:
            err.print(f"run '{runs[0].name}' already ended: {runs[0].status}")
            return
        question = f"Cancel run '{runs[0].name}'?"
    if not confirm(question, yes):
        err.print("not cancelled")
        raise typer.Exit(1)
    failed = cancel(runs)
    for run, error in failed:
        err.print(f"run '{run.name}': not cancelled ({error})", markup=False)
    if failed:
        raise typer.Exit(1)
