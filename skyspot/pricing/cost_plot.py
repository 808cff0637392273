"""A picture of one run: where its attempts ran, where they were interrupted, and money over time.

Top panel: one bar per attempt (spot and on-demand coloured apart) with checkpoints as ticks,
preemption notices and preemptions marked. Bottom panel: cumulative estimated cost against
the on-demand baseline (one start-up, each useful step once, one wind-down, at the baseline
price: docs/cost.md), so the gap is the saving.

matplotlib is imported only when a plot is drawn, and only through `Figure` (no pyplot, no
global backend), so this works headless and leaves the caller's matplotlib state alone. It returns the
image's bytes: the CLI writes them the way it writes every output file (cli/output.py).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Union

from skyspot.pricing.cost import RunCost, step_runs
from skyspot.errors import UsageError
from skyspot.events import EventLog

SPOT_COLOUR = "#2a9d8f"
ON_DEMAND_COLOUR = "#e76f51"
NOTICE_COLOUR = "#e9c46a"
PREEMPT_COLOUR = "#c1121f"
CHECKPOINT_COLOUR = "#264653"
BASELINE_COLOUR = "#6c757d"
NOTICE_OFFSET = 0.38  # notices sit below their attempt's bar (y grows downwards here)


FORMATS = ("png", "svg", "pdf")
"""What `--plot` writes, by the file's extension: formats matplotlib draws without extra packages."""


def plot_format(path: Union[str, Path]) -> str:
    """The format a `--plot` file name asks for; UsageError for any other name (matplotlib would
    otherwise refuse it with a traceback, or add `.png` and write a file the user did not name)."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        raise UsageError(f"--plot {path}: name a {', '.join('.' + f for f in FORMATS)} file "
                         f"(the extension picks the format), e.g. --plot run.png")
    return suffix


def plot_run(run_cost: RunCost, log: EventLog, fmt: str = "png") -> bytes:
    """Draw `run_cost` (computed from `log`) as an image in `fmt` (one of FORMATS); its bytes."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    attempts = run_cost.attempts
    t0 = attempts[0].start if attempts else min((e["ts"] for e in log.events), default=0.0)
    span = max([a.end for a in attempts] + [t0]) - t0
    unit, scale = ("hours", 3600.0) if span >= 2 * 3600 else ("minutes", 60.0)

    def x(ts: float) -> float:
        return (ts - t0) / scale

    fig = Figure(figsize=(11, 6.2), layout="constrained")
    timeline, money = fig.subplots(2, 1, sharex=True, height_ratios=(max(1.4, 0.55 * len(attempts) + 0.8), 2.2))

    # --- attempts -------------------------------------------------------------------------
    rows = {a.attempt: i for i, a in enumerate(attempts)}
    for a in attempts:
        y = rows[a.attempt]
        colour = SPOT_COLOUR if a.spot else ON_DEMAND_COLOUR
        timeline.barh(y, x(a.end) - x(a.start), left=x(a.start), height=0.5, color=colour, alpha=0.85)
        price = _usd(a.cost_usd) if a.cost_usd is not None else "no price"
        kind = "spot" if a.spot else "on-demand"
        ended = a.end_reason + (f": {a.cause}" if a.cause else "") + (f" ({a.cloud_cause})" if a.cloud_cause else "")
        label = f"{a.instance_type or '?'} x{a.nodes} {kind}  {a.region or ''}  {price}  ({ended})"
        timeline.text(x(a.start), y - 0.3, label, fontsize=8, va="bottom")
        if a.end_reason == "preempted":
            timeline.plot(x(a.end), y, marker="X", markersize=11, color=PREEMPT_COLOUR, zorder=4)

    runs = step_runs(log)
    for a in attempts:
        lost = [r for r in runs if r.attempt == a.attempt and r.recomputed]
        if lost:
            begin, end = min(r.ts - r.seconds for r in lost), max(r.ts for r in lost)
            timeline.barh(rows[a.attempt], x(end) - x(begin), left=x(begin), height=0.5, fill=False,
                          hatch="///", edgecolor=PREEMPT_COLOUR, lw=0)

    for e in log.events:
        y = rows.get(e.get("attempt"))
        if y is None:
            continue
        if e["type"] == "checkpoint_end" and e.get("rank") in (0, None):
            timeline.plot(x(e["ts"]), y, marker="|", markersize=16, mew=2, color=CHECKPOINT_COLOUR, zorder=3)
        elif e["type"] == "emergency_checkpoint" and e.get("rank") in (0, None):
            timeline.plot(x(e["ts"]), y, marker="D", markersize=7, color=CHECKPOINT_COLOUR, zorder=6)
        elif e["type"] in ("preemption_notice", "preempt_notice_sent"):
            # Below the bar, pointing at it: the emergency checkpoint a second later stays visible on the bar.
            timeline.plot(x(e["ts"]), y + NOTICE_OFFSET, marker="^", markersize=9, color=NOTICE_COLOUR,
                          markeredgecolor="black", zorder=5)

    for prev, nxt in zip(attempts, attempts[1:]):
        for axis in (timeline, money):
            axis.axvspan(x(prev.end), x(nxt.start), color=PREEMPT_COLOUR, alpha=0.07, lw=0)

    timeline.set_yticks(range(len(attempts)), [f"attempt {a.attempt}" for a in attempts])
    timeline.set_ylim(len(attempts) - 0.5 + NOTICE_OFFSET, -0.9)
    timeline.grid(axis="x", alpha=0.3)
    timeline.legend(handles=[
        Patch(color=SPOT_COLOUR, label="spot"), Patch(color=ON_DEMAND_COLOUR, label="on-demand"),
        Line2D([], [], ls="", marker="|", ms=12, mew=2, color=CHECKPOINT_COLOUR, label="checkpoint"),
        Line2D([], [], ls="", marker="D", color=CHECKPOINT_COLOUR, label="emergency checkpoint"),
        Line2D([], [], ls="", marker="^", ms=9, color=NOTICE_COLOUR, markeredgecolor="black", label="notice"),
        Line2D([], [], ls="", marker="X", ms=9, color=PREEMPT_COLOUR, label="preempted"),
        Patch(fill=False, hatch="///", edgecolor=PREEMPT_COLOUR, lw=0, label="steps run again later"),
        Patch(color=PREEMPT_COLOUR, alpha=0.15, label="between attempts"),
    ], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)

    # --- money ----------------------------------------------------------------------------
    # Spend rises while nodes are up (in the attempt's colour) and stays flat between attempts.
    total, last_x = 0.0, 0.0
    for a in attempts:
        money.plot([last_x, x(a.start)], [total, total], color=BASELINE_COLOUR, lw=1.2)
        after = total + (a.cost_usd or 0.0)
        money.plot([x(a.start), x(a.end)], [total, after], lw=2.4,
                   color=SPOT_COLOUR if a.spot else ON_DEMAND_COLOUR)
        total, last_x = after, x(a.end)
    money.plot([], [], color=SPOT_COLOUR, lw=2.4, label=f"estimated cost  {_usd(total)}")

    if run_cost.baseline_usd_per_hour is not None:
        points = baseline_curve(run_cost, runs, t0)
        bx, by = [x(ts) for ts, _ in points], [usd for _, usd in points]
        accrued = by[-1]
        money.plot(bx, by, color=BASELINE_COLOUR, lw=1.8, ls="--", drawstyle="steps-post",
                   label=f"on-demand baseline  {_usd(accrued)}  ({run_cost.baseline_instance}: one start-up, "
                         "useful steps, one wind-down)")
    money.set_ylabel("USD (cumulative)")
    money.set_xlabel(f"{unit} since the first attempt started")
    money.grid(alpha=0.3)
    money.legend(loc="upper left", fontsize=8, frameon=False)

    fig.suptitle(_title(run_cost), fontsize=11)
    timeline.set_title(_footnote(run_cost), fontsize=8, loc="left", color="#555555")
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=110)
    return buffer.getvalue()


def baseline_curve(run_cost: RunCost, runs, t0: float) -> list[tuple[float, float]]:
    """(unix time, cumulative USD) of the on-demand baseline: its start-up from t0, then each useful
    step as it ran, then the wind-down; the last point is `run_cost.on_demand_cost_usd`."""
    rate = run_cost.baseline_usd_per_hour * run_cost.nodes / 3600
    accrued = run_cost.startup_seconds * rate
    points = [(t0, 0.0), (t0 + run_cost.startup_seconds, accrued)]
    useful = sorted((r for r in runs if not r.recomputed), key=lambda r: r.ts)
    for r in useful:
        accrued += r.seconds * rate
        points.append((r.ts, accrued))
    if run_cost.wind_down_seconds and useful:
        accrued += run_cost.wind_down_seconds * rate
        points.append((useful[-1].ts + run_cost.wind_down_seconds, accrued))
    return points


def _title(run: RunCost) -> str:
    parts = [run.name or "run", f"est. {_usd(run.cost_usd)}"]
    if run.on_demand_cost_usd is not None and run.savings_pct is not None:
        parts.append(f"vs {_usd(run.on_demand_cost_usd)} on demand ({run.savings_pct:.0f}% saved)")
    parts.append(f"{run.preemptions} preemption{'s' * (run.preemptions != 1)}")
    if run.mttr_seconds is not None:
        parts.append(f"MTTR {run.mttr_seconds / 60:.1f} min")
    if run.lost_steps:
        parts.append(f"{run.lost_steps} steps recomputed")
    if run.goodput is not None:
        parts.append(f"goodput {run.goodput:.0%}")
    return "  ·  ".join(parts)


def _usd(value: float) -> str:
    # A bare "$" starts mathtext in matplotlib; escaped, it prints as a dollar sign. The sign goes first.
    return ("-" if value < 0 and round(value, 2) else "") + rf"\${abs(value):,.2f}"


def _footnote(run: RunCost) -> str:
    note = f"Estimates from list prices ({run.price_source or 'no price'} {run.price_date or ''}), not a bill."
    if run.simulated:
        note += " Simulated: a local run priced as the cloud instance it stood in for."
    return note
