"""`skyspot cost-report` and `skyspot prices`: estimated cost, savings and recovery figures per run."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Optional

import typer

from skyspot.cli.common import Column, display, fabric_text, handle_errors, in_place_text, one_line, terminal_width, usd
from skyspot.cli.output import ForceOption, check_output, write_output
from skyspot.cli.options import JsonOption, OptionalRunArgument
from skyspot.console import err, out, printable
from skyspot.errors import UsageError

# Stable field names of the one-row-per-run report (JSON and CSV).
SUMMARY_FIELDS = [
    "name",
    "recipe",
    "executor",
    "status",
    "cost_usd",
    "on_demand_cost_usd",
    "savings_usd",
    "savings_pct",
    "sagemaker_savings_pct",
    "preemptions",
    "recoveries",
    "mttr_seconds",
    "lost_steps",
    "lost_seconds",
    "checkpoint_overhead_seconds",
    "goodput",
    "billed_node_hours",
    "price_source",
    "price_date",
    "simulated",
    "estimated",
    "egress_usd",
    "egress_bytes",
    "interruptions_by_cause",
    "interruptions",
    "restarts_in_place",
    "hangs",
    "mttr_reprovisioned_seconds",
    "mttr_in_place_seconds",
    "lost_steps_reprovisioned",
    "lost_steps_in_place",
    "eval_seconds",
    "final_eval_loss",
    "final_eval_perplexity",
    "final_eval_step",
]


@handle_errors
def cost_report_command(
    run_name: OptionalRunArgument = None,
    as_json: JsonOption = False,
    as_csv: bool = typer.Option(False, "--csv", help="Print CSV (stable field names)."),
    plot: Optional[Path] = typer.Option(
        None,
        "--plot",
        help="RUN only: write a timeline image (attempts, notices, checkpoints, restarts, train and eval loss, cost vs on-demand): FILE.png, .svg or .pdf.",
    ),
    force: ForceOption = False,
) -> None:
    """Estimated cost per run, the on-demand baseline, savings, preemptions, MTTR, lost work and goodput;
    with RUN, that run's breakdown."""
    if as_json and as_csv:
        raise UsageError("pick one of --json and --csv")
    if plot is not None and not run_name:
        raise UsageError("--plot draws one run: name it, e.g. `skyspot cost-report RUN --plot run.png`")
    from skyspot.app.report import check_plot, check_plot_run, cost_reports

    if plot is not None:  # a name that cannot be written, or a run too long to draw, before the report
        check_plot(plot)
        check_output(plot, force=force, flag="--plot")
        check_plot_run(run_name)

    reports = cost_reports(run_name)
    for note in reports.notes:
        err.print(one_line(note), markup=False)
    if run_name and reports.runs:
        _one(reports.runs[0], as_json=as_json, as_csv=as_csv, plot=plot, force=force)
        if reports.malformed and (as_json or as_csv):
            err.print(f"skipped {reports.malformed} malformed event line(s)")
        return
    if reports.malformed:
        err.print(f"skipped {reports.malformed} malformed event line(s)")
    rows = [r.data for r in reports.runs]
    if as_csv:
        _write_csv(rows, SUMMARY_FIELDS)
        return
    if as_json:
        display([{k: r.get(k) for k in SUMMARY_FIELDS} for r in rows], [], as_json=True)
        return
    for r in rows:
        _format(r)
    columns = (
        REPORT_COLUMNS
        + ([IN_PLACE_COLUMN] if any(r.get("restarts_in_place") or r.get("hangs") for r in rows) else [])
        + ([EVAL_COLUMN] if any(r.get("final_eval_loss") is not None for r in rows) else [])
    )
    display(
        rows,
        columns,
        as_json=False,
        title="Estimated cost per run (estimates from published list prices, not a bill)",
        empty="no runs yet: `skyspot launch tiny --local` starts one",
        caption=BASELINE_NOTE,
    )


REPORT_COLUMNS = [
    Column("name", "NAME"),
    Column("status", "STATUS", 2),
    Column("cost", "EST. COST"),
    Column("egress", "EGRESS", 7, right=True),
    Column("baseline", "ON-DEMAND", right=True),
    Column("saved", "SAVED", right=True),
    Column("preemptions", "PREEMPTIONS", 4, right=True),
    Column("mttr", "MTTR", 5, right=True),
    Column("lost_steps", "LOST STEPS", 6, right=True),
    Column("goodput_pct", "GOODPUT", 3, right=True),
    Column("source", "PRICES", 8),
    Column("interruptions", "INTERRUPTED BY", 6, wrap=True),
]
# Shown only when a listed run has them (#26 in-place restarts, #25 evaluations).
IN_PLACE_COLUMN = Column("in_place", "IN PLACE", 5, right=True)
EVAL_COLUMN = Column("eval_loss", "EVAL LOSS", 4, right=True)
BASELINE_NOTE = (
    "ON-DEMAND: the same run as one uninterrupted attempt on the cheapest on-demand candidate "
    "(one start-up, each useful step once, one wind-down); SAVED = ON-DEMAND - EST. COST. "
    "docs/cost.md defines every figure."
)


def _format(r: dict, places: Optional[int] = 2) -> None:
    r["cost"] = usd(r.get("cost_usd"), places) + (" (sim)" if r.get("simulated") else "")
    r["egress"] = usd(r.get("egress_usd"), 2)  # inside the cost; a store on another cloud than the GPUs
    r["baseline"] = usd(r.get("on_demand_cost_usd"), places)
    # savings_pct is None when there is no baseline yet (a run with no events): show the amount alone.
    r["saved"] = (
        "-"
        if r.get("savings_usd") is None
        else usd(r["savings_usd"], places) + ("" if r.get("savings_pct") is None else f" ({r['savings_pct']:.0f}%)")
    )
    r["mttr"] = _secs(r.get("mttr_seconds"))
    r["in_place"] = in_place_text(r)
    r["eval_loss"] = _loss(r.get("final_eval_loss"))
    r["goodput_pct"] = "-" if r.get("goodput") is None else f"{100 * r['goodput']:.0f}%"
    r["source"] = f"{r.get('price_source')} {r.get('price_date')}" if r.get("price_source") else "-"
    r["interruptions"] = r.get("interruptions") or "-"


def _write_csv(rows: list[dict], fields: list[str]) -> None:
    writer = csv.DictWriter(sys.stdout, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _csv_value(row.get(k)) for k in fields})


def _csv_value(value):
    """A mapping (interruptions_by_cause) as `spot-preemption=2;planned-maintenance=1`: one cell, parseable;
    text with its control characters escaped (console.printable), as every table shows it: a ledger row's
    or an event's ESC or BEL never reaches the terminal through --csv either."""
    if isinstance(value, dict):
        value = ";".join(f"{key}={count}" for key, count in value.items())
    return printable(value) if isinstance(value, str) else value


TABLE_ROWS = 50
"""Rows of a per-attempt table printed in full; a longer one shows its first and last TABLE_ROWS // 2 and a
line for the rest (issue 31: 20,000 attempts were 20,000 lines and seconds of layout; --json and --csv have all)."""


def _shown(rows: list, what: str) -> tuple[list, Optional[str]]:
    """The rows a table prints, and the line that says what it left out (None when nothing)."""
    if len(rows) <= TABLE_ROWS:
        return rows, None
    half = TABLE_ROWS // 2
    return rows[:half] + rows[-half:], (
        f"… {len(rows) - 2 * half:,} more {what} between these (the first and last {half} shown); --json or --csv for all"
    )


def _one(run_report, *, as_json: bool, as_csv: bool, plot: Optional[Path], force: bool) -> None:
    data = run_report.data
    if plot is not None:
        from skyspot.app.report import plot as plot_image

        written = write_output(plot, plot_image(run_report, plot), force=force, flag="--plot")
        err.print(f"wrote {written}", markup=False)
    if as_json:
        display([data], [], as_json=True)
        return
    if as_csv:
        _write_csv(
            [
                a | {"name": data["name"], "busbw_gbps": (a.get("fabric") or {}).get("busbw_gbps")}
                for a in data["attempts"]
            ],
            [
                "name",
                "attempt",
                "cloud",
                "region",
                "zone",
                "instance_type",
                "nodes",
                "spot",
                "start",
                "end",
                "end_reason",
                "seconds",
                "billed_hours",
                "usd_per_hour",
                "cost_usd",
                "price_source",
                "compute_usd",
                "egress_upload_bytes",
                "egress_download_bytes",
                "egress_usd",
                "cause",
                "cloud_cause",
                "transport",
                "busbw_gbps",
            ],
        )
        return
    _format(data, places=None)
    attempts, more_attempts = _shown(data["attempts"], "attempts")
    display(
        [_attempt_row(a) for a in attempts],
        ATTEMPT_COLUMNS,
        as_json=False,
        title=f"{data['name']}: attempts",
        empty=f"run '{data['name']}' has no events yet",
        caption=more_attempts,
    )
    if data["recovery_details"]:
        recoveries, more_recoveries = _shown(data["recovery_details"], "recoveries")
        display(
            [_recovery_row(r) for r in recoveries],
            RECOVERY_COLUMNS,
            as_json=False,
            title="recoveries onto new machines (re-provisioned)",
            caption=more_recoveries,
        )
    if data.get("in_place_details"):
        display(
            [_in_place_row(r) for r in data["in_place_details"]],
            IN_PLACE_COLUMNS,
            as_json=False,
            title="in-place restarts (same machines, new processes)",
        )
    say = lambda text: _say(text, terminal_width())  # noqa: E731
    say(f"estimated cost {data['cost']} (egress {data['egress']}{_store_note(data)})")
    say(f"on-demand baseline {data['baseline']}{_baseline_note(data)}")
    say(f"saved {data['saved']}{_savings_note(data)}")
    say(f"what the money bought: {_bought(data)}")
    say(
        f"preemptions {data['preemptions']}   recoveries {_recoveries(data)}   MTTR {data['mttr']}   "
        f"lost steps {_lost(data)}   checkpoint overhead {data['checkpoint_overhead_seconds']:.1f}s   "
        f"SageMaker-style savings {_pct(data.get('sagemaker_savings_pct'))}"
    )
    say(f"goodput {data['goodput_pct']}{_goodput_note(data)}{_goodput_lines(data)}")
    if data.get("interruptions_by_cause"):
        say(f"interrupted by: {data['interruptions']}")
    from skyspot.app.report import node_lines

    for line in node_lines(data):
        say(line)
    sim = " (sim): a local run, priced as the cloud instance it stands for." if data.get("simulated") else ""
    say(f"prices: {data['source']} (estimates from published list prices, not a bill; docs/cost.md).{sim}")
    if data.get("deadline"):
        for line in _deadline_lines(data["deadline"]):
            say(line)
    plans = data.get("interval_plans") or []
    if plans:
        trail = " -> ".join(f"{p['every_seconds']:.0f}s" for p in plans[-4:])
        last = plans[-1]
        out.print(
            f"checkpoint interval (auto): {last['every_seconds']:.0f}s ({last.get('bound')}, MTBP "
            f"{_secs(last.get('mtbp_s'))}); {len(plans)} plan(s): {'... -> ' if len(plans) > 4 else ''}{trail}"
        )
    for warning in data.get("warnings") or []:
        err.print(f"note: {warning}")


ATTEMPT_COLUMNS = [
    Column("attempt", "ATTEMPT", right=True),
    Column("where", "WHERE", 4),
    Column("instance_type", "INSTANCE", 5),
    Column("nodes", "NODES", 6, right=True),
    Column("capacity", "CAPACITY"),
    Column("duration", "DURATION", right=True),
    Column("end_reason", "ENDED"),
    Column("cause", "CAUSE", 2),
    Column("fabric", "FABRIC", 3),
    Column("billed_hours", "NODE-HOURS", 7, right=True),
    Column("egress", "EGRESS", 3, right=True),
    Column("cost", "EST. COST", right=True),
]
RECOVERY_COLUMNS = [
    Column("n", "#", right=True),
    Column("cause", "CAUSE", 5),
    Column("notice_to_checkpoint", "NOTICE->CKPT", 3, right=True),
    Column("checkpoint_to_exit", "CKPT->EXIT", 4, right=True),
    Column("exit_to_start", "PROVISIONING", 1, right=True),
    Column("start_to_restore", "RESTORE", 1, right=True),
    Column("restore_to_first_step", "FIRST STEP", 1, right=True),
    Column("total", "RECOVERY", right=True),
    Column("lost_steps", "LOST STEPS", right=True),
]


IN_PLACE_COLUMNS = [
    Column("n", "#", right=True),
    Column("attempt", "ATTEMPT", 3, right=True),
    Column("cause", "CAUSE"),
    Column("resumed_step", "FROM STEP", 2, right=True),
    Column("to_next_step", "TO NEXT STEP", right=True),
    Column("steps_redone", "STEPS REDONE", 1, right=True),
    Column("hang", "HANG", 4, wrap=True),
]

# The goodput breakdown's lines in words (pricing/cost.py GOODPUT_LINES; docs/cost.md defines each).
GOODPUT_WORDS = {
    "useful": "useful steps",
    "evaluating": "evaluating",
    "redone_in_place": "steps redone in place",
    "redone_reprovisioned": "steps redone on new machines",
    "checkpoint_stalls": "checkpoint stalls",
    "first_start_up": "first start-up",
    "reprovisioned_start_ups": "start-ups on new machines",
    "in_place_restarts": "in-place restarts",
    "other": "other",
}


def _bought(data: dict) -> str:
    """The final eval loss beside the cost: what the run's money bought (#25)."""
    parts = []
    if data.get("final_eval_loss") is not None:
        ppl = data.get("final_eval_perplexity")
        parts.append(
            f"eval loss {_loss(data['final_eval_loss'])}"
            + ("" if ppl is None else f" (perplexity {ppl:,.2f})")
            + f" at step {data.get('final_eval_step')}"
        )
    else:
        parts.append("no evaluation (the recipe's `eval` section adds one)")
    if data.get("final_train_diverged"):
        parts.append(f"train loss not finite (NaN or inf: diverged) at step {data.get('final_train_step')}")
    elif data.get("final_train_loss") is not None:
        parts.append(f"train loss {_loss(data['final_train_loss'])} at step {data.get('final_train_step')}")
    return "; ".join(parts)


def _recoveries(data: dict) -> str:
    """`1 re-provisioned (MTTR 29.5s), 2 in place (MTTR 8.0s; 1 hang)`: the two kinds apart (#26)."""
    text = f"{data['recoveries']}"
    if not (data.get("restarts_in_place") or data.get("hangs")):
        return text
    hangs = data.get("hangs") or 0
    return (
        f"{text} re-provisioned (MTTR {_secs(data.get('mttr_reprovisioned_seconds'))}), "
        f"{data.get('restarts_in_place') or 0} in place (MTTR {_secs(data.get('mttr_in_place_seconds'))}"
        f"{f'; {hangs} hang' + ('s' if hangs != 1 else '') if hangs else ''})"
    )


def _lost(data: dict) -> str:
    text = f"{data['lost_steps']} ({data['lost_seconds']:.1f}s"
    if data.get("lost_steps_in_place"):
        text += f"; {data['lost_steps_in_place']} redone in place"
    return text + ")"


def _goodput_lines(data: dict) -> str:
    """`: of 102.0s billed: useful steps 32.0s, evaluating 5.5s, ...`, the lines that add up to it."""
    lines = data.get("goodput_breakdown") or {}
    shown = [
        f"{GOODPUT_WORDS.get(key, key)} {seconds:.1f}s"
        for key, seconds in lines.items()
        if key == "useful" or abs(seconds) >= 0.05
    ]
    return f"; of {data.get('billed_seconds', 0.0):.1f}s billed: " + ", ".join(shown) if lines else ""


def _loss(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def _in_place_row(r: dict) -> dict:
    hang = r.get("hang") or {}
    where = ", ".join(f"rank {x.get('rank')}: {x.get('top')}" for x in hang.get("ranks") or [] if x.get("top"))
    return {
        "n": r.get("restart"),
        "attempt": r.get("attempt"),
        "cause": r.get("cause") or "-",
        "resumed_step": r.get("resumed_step"),
        "to_next_step": _secs(r.get("seconds_to_next_step")),
        "steps_redone": r.get("steps_redone") if r.get("steps_redone") is not None else r.get("lost_steps"),
        "hang": (
            f"no step for {_secs(hang.get('seconds_without_step'))} (bound {_secs(hang.get('bound_seconds'))})"
            + (f"; {where}" if where else "")
            + (f"; stacks {hang['stacks']}" if hang.get("stacks") else "")
        )
        if hang
        else "-",
    }


def _deadline_lines(d: dict) -> list[str]:
    """A deadline run against all on-demand and greedy on the same trace (docs/deadline.md)."""
    from skyspot.app.report import when

    met = {True: "met", False: "MISSED", None: "not finished"}[d.get("met")]
    lines = [
        f"deadline {when(d.get('deadline'))}: {met}"
        + (f" (finished {when(d['finished_at'])})" if d.get("finished_at") else "")
        + f"; policy {d.get('policy')}"
    ]
    if d.get("note"):
        return lines + [d["note"]]

    def versus(label: str, usd_value, pct) -> str:
        if usd_value is None:
            return f"{label} -"
        saved = "" if pct is None else f" (this run {'saved' if pct >= 0 else 'cost'} {abs(pct):.0f}%)"
        return f"{label} {usd(usd_value, 4)}{saved}"

    lines.append(
        f"this run {usd(d.get('cost_usd'), 4)}; "
        + versus("all on-demand", d.get("all_on_demand_usd"), d.get("vs_all_on_demand_pct"))
        + "; "
        + versus("greedy", d.get("greedy_usd"), d.get("vs_greedy_pct"))
        + f" ({'met' if d.get('greedy_met') else 'would MISS'} the deadline; replayed on the same trace, "
        f"{d.get('trace', 'same trace')}; the policy replayed: {usd(d.get('policy_replayed_usd'), 4)})"
    )
    return lines


def _baseline_note(data: dict) -> str:
    """How the baseline was made, in the report itself, so a reader can check it against docs/cost.md."""
    rate = data.get("baseline_usd_per_hour")
    if rate is None:
        return " (no on-demand price for any candidate: no baseline)"
    nodes = data.get("nodes") or 1
    return (
        f": this run as one uninterrupted attempt on {data.get('baseline_instance')} on demand at "
        f"{usd(rate, 2)}/h x {nodes} node{'s' if nodes != 1 else ''}: start-up {_secs(data.get('startup_seconds'))}"
        f" + {data.get('useful_steps')} useful steps {_secs(data.get('useful_seconds'))}"
        + (f" + evaluations {_secs(data['useful_eval_seconds'])}" if data.get("useful_eval_seconds") else "")
        + " + wind-down "
        f"{_secs(data.get('wind_down_seconds'))} = {_secs(data.get('baseline_seconds'))}"
    )


def _savings_note(data: dict) -> str:
    if data.get("savings_usd") is None or data["savings_usd"] >= 0:
        return ""
    extra = (data.get("billed_seconds") or 0) - (data.get("baseline_seconds") or 0)
    return (
        f": spot cost more here; it was billed {_secs(data.get('billed_seconds'))} against the baseline's "
        f"{_secs(data.get('baseline_seconds'))} ({_secs(extra)} of recoveries, recomputed steps and checkpoint "
        f"stalls{', and egress' if data.get('egress_usd') else ''})"
    )


def _say(text: str, width: int) -> None:
    """One figure line on stdout, wrapped to the terminal, continuation lines indented."""
    import textwrap

    lines = textwrap.wrap(one_line(text), width=max(40, width), subsequent_indent="  ", break_on_hyphens=False)
    sys.stdout.write("\n".join(lines) + "\n")


def _goodput_note(data: dict) -> str:
    """Goodput is useful step time over billed time; a short run's one start-up can dominate it."""
    startup, useful = data.get("startup_seconds") or 0.0, data.get("useful_seconds") or 0.0
    return f" (the first start-up alone took {startup:.1f}s)" if startup > useful else ""


def _store_note(data: dict) -> str:
    cloud = data.get("store_cloud")
    return f", store on {cloud}" if cloud else ", no cloud store"


def _pct(value) -> str:
    return "-" if value is None else f"{value:.0f}%"


def _secs(value) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _attempt_row(a: dict) -> dict:
    return {
        **a,
        "where": "/".join(x for x in (a.get("cloud"), a.get("region")) if x),
        "capacity": "spot" if a.get("spot") else "on-demand",
        "duration": _secs(a.get("seconds")),
        "egress": usd(a.get("egress_usd") or 0.0, 4),
        "cost": usd(a.get("cost_usd"), 4),
        "cause": _cause(a.get("cause"), a.get("cloud_cause")),
        "fabric": fabric_text(a.get("fabric"), a.get("transport")),
    }


def _cause(cause, cloud_cause) -> str:
    """`spot-preemption (terminate)`: our word, then the cloud's own name for it when there is one."""
    if not cause:
        return "-"
    return f"{cause} ({cloud_cause})" if cloud_cause else cause


def _recovery_row(r: dict) -> dict:
    return {
        "n": r.get("to_attempt"),
        "cause": _cause(r.get("interruption_cause"), r.get("cloud_cause"))
        if r.get("interruption_cause")
        else r.get("cause"),
        "notice_to_checkpoint": _secs(r.get("notice_to_checkpoint_seconds")),
        "checkpoint_to_exit": _secs(r.get("checkpoint_to_exit_seconds")),
        "exit_to_start": _secs(r.get("exit_to_start_seconds")),
        "start_to_restore": _secs(r.get("start_to_restore_seconds")),
        "restore_to_first_step": _secs(r.get("restore_to_first_step_seconds")),
        "total": _secs(r.get("total_seconds")),
        "lost_steps": r.get("lost_steps"),
    }


@handle_errors
def prices_command(
    cloud: Optional[str] = typer.Option(None, "--cloud", help="Only this cloud: aws, gcp or azure."),
    instance: Optional[str] = typer.Option(None, "--instance", help="Only this instance type."),
    as_json: JsonOption = False,
) -> None:
    """What the shipped price snapshot holds (cheapest zone per instance type and region)."""
    from skyspot.app.report import price_rows

    prices = price_rows(cloud, instance)
    display(
        prices.rows,
        [
            Column("cloud", "CLOUD"),
            Column("instance_type", "INSTANCE"),
            Column("accelerator", "GPU", 2),
            Column("accelerator_count", "#", 3, right=True),
            Column("region", "REGION"),
            Column("usd_per_hour", "ON-DEMAND", right=True),
            Column("spot_usd_per_hour", "SPOT", right=True),
        ],
        as_json=as_json,
        title=f"Price snapshot {prices.snapshot_date}, $ per instance-hour (SkyPilot catalog; see "
        "skyspot/pricing/pricing_data/SOURCE.md)",
    )
