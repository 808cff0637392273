"""A picture of one run: where its attempts ran, where they were interrupted, what the model learnt, and
money over time, on one time axis.

Top panel: one bar per attempt (spot and on-demand coloured apart) with checkpoints as ticks,
preemption notices, preemptions, in-place restarts and hangs marked. Middle panel (when the run logged a
loss): the train loss of every step run and the eval losses, so the steps a preemption or a restart made
the run do again show as a stretch of the curve drawn twice. Bottom panel: cumulative estimated cost
against the on-demand baseline (one start-up, each useful step once, one wind-down, at the baseline price:
docs/cost.md), accruing from the run's start, so the gap is the saving. The legend sits under the panels,
and each attempt's label inside the axes, so neither ever runs into the other.

matplotlib is imported only when a plot is drawn, and only through `Figure` (no pyplot, no
global backend), so this works headless and leaves the caller's matplotlib state alone. It returns the
image's bytes: the CLI writes them the way it writes every output file (cli/output.py).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Union

from skyspot.attempts import split
from skyspot.pricing.cost import EvalRun, RunCost, StepRun, baseline_evals, eval_runs, step_runs
from skyspot.errors import UsageError
from skyspot.events import EventLog
from skyspot.events import EventType as T

SPOT_COLOUR = "#2a9d8f"
ON_DEMAND_COLOUR = "#e76f51"
NOTICE_COLOUR = "#e9c46a"
PREEMPT_COLOUR = "#c1121f"
CHECKPOINT_COLOUR = "#264653"
BASELINE_COLOUR = "#6c757d"
RESTART_COLOUR = "#7b2cbf"
EVAL_COLOUR = "#f4a261"
NOTICE_OFFSET = 0.38  # notices sit below their attempt's bar (y grows downwards here)


LABELLED_ATTEMPTS = 40
"""Up to this many attempts, each has its row's label and tick; more are drawn as rows without them."""
TITLE_WIDTH = 125  # characters of a title line at its size that fit the figure's 11 inches

FORMATS = ("png", "svg", "pdf")
"""What `--plot` writes, by the file's extension: formats matplotlib draws without extra packages."""


def plot_format(path: Union[str, Path]) -> str:
    """The format a `--plot` file name asks for; UsageError for any other name (matplotlib would
    otherwise refuse it with a traceback, or add `.png` and write a file the user did not name)."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        raise UsageError(
            f"--plot {path}: name a {', '.join('.' + f for f in FORMATS)} file "
            f"(the extension picks the format), e.g. --plot run.png"
        )
    return suffix


def plot_run(run_cost: RunCost, log: EventLog, fmt: str = "png") -> bytes:
    """Draw `run_cost` (computed from `log`) as an image in `fmt` (one of FORMATS); its bytes."""
    buffer = io.BytesIO()
    figure(run_cost, log).savefig(buffer, format=fmt, dpi=110)
    return buffer.getvalue()


def figure(run_cost: RunCost, log: EventLog):
    """The run's matplotlib `Figure` (plot_run saves it)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    attempts = run_cost.attempts
    t0 = attempts[0].start if attempts else min((e["ts"] for e in log.events), default=0.0)
    span = max([a.end for a in attempts] + [t0]) - t0
    unit, scale = ("hours", 3600.0) if span >= 2 * 3600 else ("minutes", 60.0)

    def x(ts: float) -> float:
        return (ts - t0) / scale

    # The runs and evaluations the report counted (issue 31: reckoning them again was a third of the plot's
    # time at 20,000 attempts); a RunCost built by hand without them has the log split here, once.
    runs, evals = run_cost.step_runs, run_cost.eval_runs
    if not runs and not evals and log.events:
        split_attempts = split(log.events)
        runs, evals = step_runs(log, split_attempts), eval_runs(log, split_attempts)
    losses = loss_series(log, runs, evals)
    has_loss = bool(losses["train"] or losses["eval"])
    fig = Figure(figsize=(11, 8.2 if has_loss else 6.6), layout="constrained")
    heights = (max(1.4, 0.55 * min(len(attempts), LABELLED_ATTEMPTS) + 0.8),) + ((2.0,) if has_loss else ()) + (2.2,)
    axes = fig.subplots(len(heights), 1, sharex=True, height_ratios=heights)
    timeline, money = axes[0], axes[-1]
    loss_axis = axes[1] if has_loss else None

    # --- attempts -------------------------------------------------------------------------
    # One artist per kind of mark, never one per attempt or event: 20,000 attempts drew 100,000 artists,
    # 120 s and 2.3 GB (issue 31, item 9). Each attempt's own label and tick only while they can be read.
    rows = {a.attempt: i for i, a in enumerate(attempts)}
    labelled = len(attempts) <= LABELLED_ATTEMPTS
    middle = x(t0 + span / 2)
    _bars(
        timeline,
        [(rows[a.attempt], x(a.start), x(a.end)) for a in attempts],
        facecolors=[SPOT_COLOUR if a.spot else ON_DEMAND_COLOUR for a in attempts],
        alpha=0.85,
        linewidths=0,
    )
    for a in attempts if labelled else ():
        y = rows[a.attempt]
        price = _usd(a.cost_usd) if a.cost_usd is not None else "no price"
        kind = "spot" if a.spot else "on-demand"
        ended = a.end_reason + (f": {a.cause}" if a.cause else "") + (f" ({a.cloud_cause})" if a.cloud_cause else "")
        label = f"{a.instance_type or '?'} x{a.nodes} {kind}  {a.region or ''}  {price}  ({ended})"
        # Inside the axes: from the start of a span in the left half, back from the end of one in the right
        # half, so a late attempt's label never runs off the axes (the legend is below them: never under it).
        left = x(a.start) <= middle
        timeline.text(
            x(a.start) if left else x(a.end),
            y - 0.3,
            label,
            fontsize=8,
            va="bottom",
            ha="left" if left else "right",
            clip_on=True,
            gid=f"attempt-label-{a.attempt}",
        )
    preempted = [a for a in attempts if a.end_reason == "preempted"]
    _marks(
        timeline,
        [(x(a.end), rows[a.attempt]) for a in preempted],
        marker="X",
        markersize=11,
        color=PREEMPT_COLOUR,
        zorder=4,
    )

    lost: dict[tuple, list] = {}  # per set of processes: one restart's redone stretch is not the next one's
    for r in runs:
        if r.recomputed and r.attempt in rows:
            lost.setdefault((r.attempt, r.generation), []).append(r)
    _bars(
        timeline,
        [
            (rows[attempt], x(min(r.ts - r.seconds for r in stretch)), x(max(r.ts for r in stretch)))
            for (attempt, _), stretch in lost.items()
        ],
        facecolors="none",
        hatch="///",
        edgecolors=PREEMPT_COLOUR,
        linewidths=0,
    )

    marks: dict[str, list[tuple[float, float]]] = {"checkpoint": [], "emergency": [], "notice": [], "hang": []}
    for e in log.events:
        y = rows.get(e.get("attempt"))
        if y is None:
            continue
        if e["type"] == T.CHECKPOINT_END and e.get("rank") in (0, None):
            marks["checkpoint"].append((x(e["ts"]), y))
        elif e["type"] == T.EMERGENCY_CHECKPOINT and e.get("rank") in (0, None):
            marks["emergency"].append((x(e["ts"]), y))
        elif e["type"] in (T.PREEMPTION_NOTICE, T.PREEMPT_NOTICE_SENT):
            # Below the bar, pointing at it: the emergency checkpoint a second later stays visible on the bar.
            marks["notice"].append((x(e["ts"]), y + NOTICE_OFFSET))
        elif e["type"] == T.HANG:  # below the bar like a notice: the restart's mark sits on the bar
            marks["hang"].append((x(e["ts"]), y + NOTICE_OFFSET))
    _marks(timeline, marks["checkpoint"], marker="|", markersize=16, mew=2, color=CHECKPOINT_COLOUR, zorder=3)
    _marks(timeline, marks["emergency"], marker="D", markersize=7, color=CHECKPOINT_COLOUR, zorder=6)
    _marks(timeline, marks["notice"], marker="^", markersize=9, color=NOTICE_COLOUR, markeredgecolor="black", zorder=5)
    _marks(timeline, marks["hang"], marker="s", markersize=8, color=RESTART_COLOUR, zorder=6)
    restarts = [r for r in run_cost.in_place_details if r.failed_at is not None and r.attempt in rows]
    _marks(
        timeline,
        [(x(r.failed_at), rows[r.attempt]) for r in restarts if r.failed_at is not None],
        marker="o",
        markersize=8,
        color="white",
        markeredgecolor=RESTART_COLOUR,
        mew=2,
        zorder=6,
    )
    _segments(
        timeline,
        [
            [(x(r.failed_at), rows[r.attempt]), (x(r.first_step_at), rows[r.attempt])]
            for r in restarts
            if r.failed_at is not None and r.first_step_at is not None
        ],
        color=RESTART_COLOUR,
        lw=3,
        zorder=5,
        solid_capstyle="butt",
    )

    gaps = _coalesced([(x(prev.end), x(nxt.start)) for prev, nxt in zip(attempts, attempts[1:])], x(t0 + span) / 2000)
    for axis in axes:
        _spans(axis, gaps, color=PREEMPT_COLOUR, alpha=0.07, lw=0)

    if labelled:
        timeline.set_yticks(range(len(attempts)), [f"attempt {a.attempt}" for a in attempts])
    else:
        timeline.set_ylabel(f"attempts (row: attempt; {len(attempts):,} of them)")
    timeline.set_ylim(len(attempts) - 0.5 + NOTICE_OFFSET, -0.9)
    timeline.grid(axis="x", alpha=0.3)
    handles = [
        Patch(color=SPOT_COLOUR, label="spot"),
        Patch(color=ON_DEMAND_COLOUR, label="on-demand"),
        Line2D([], [], ls="", marker="|", ms=12, mew=2, color=CHECKPOINT_COLOUR, label="checkpoint"),
        Line2D([], [], ls="", marker="D", color=CHECKPOINT_COLOUR, label="emergency checkpoint"),
        Line2D([], [], ls="", marker="^", ms=9, color=NOTICE_COLOUR, markeredgecolor="black", label="notice"),
        Line2D([], [], ls="", marker="X", ms=9, color=PREEMPT_COLOUR, label="preempted"),
        Patch(fill=False, hatch="///", edgecolor=PREEMPT_COLOUR, lw=0, label="steps run again later"),
        Patch(color=PREEMPT_COLOUR, alpha=0.15, label="between attempts"),
    ]
    if run_cost.in_place_details or run_cost.hangs:
        handles += [
            Line2D(
                [],
                [],
                marker="o",
                ms=8,
                color=RESTART_COLOUR,
                markerfacecolor="white",
                mew=2,
                lw=3,
                label="in-place restart (failure to next step)",
            ),
            Line2D([], [], ls="", marker="s", ms=8, color=RESTART_COLOUR, label="hang"),
        ]

    # --- loss -----------------------------------------------------------------------------
    if loss_axis is not None:
        for redone in (False, True):  # one line per style, its segments apart (NaN between them)
            _segments(
                loss_axis,
                [
                    [(x(ts), loss) for ts, _, loss, _ in segment]
                    for segment in losses["train"]
                    if segment[0][3] == redone
                ],
                color=PREEMPT_COLOUR if redone else CHECKPOINT_COLOUR,
                lw=1.0 if redone else 1.4,
                alpha=0.6 if redone else 1.0,
            )
        if losses["eval"]:
            loss_axis.plot(
                [x(ts) for ts, _, _ in losses["eval"]],
                [loss for _, _, loss in losses["eval"]],
                ls="",
                marker="o",
                ms=6,
                color=EVAL_COLOUR,
                markeredgecolor="black",
                zorder=4,
            )
        loss_axis.set_ylabel("loss")
        loss_axis.grid(alpha=0.3)
        handles += [
            Line2D([], [], color=CHECKPOINT_COLOUR, lw=1.4, label="train loss"),
            Line2D([], [], color=PREEMPT_COLOUR, lw=1.0, alpha=0.6, label="train loss of steps run again"),
        ]
        if losses["eval"]:
            handles.append(
                Line2D([], [], ls="", marker="o", ms=6, color=EVAL_COLOUR, markeredgecolor="black", label="eval loss")
            )

    # --- money ----------------------------------------------------------------------------
    # Spend rises while nodes are up (in the attempt's colour) and stays flat between attempts.
    total, last_x = 0.0, 0.0
    flat: list[list[tuple[float, float]]] = []
    rising: dict[bool, list[list[tuple[float, float]]]] = {True: [], False: []}
    for a in attempts:
        flat.append([(last_x, total), (x(a.start), total)])
        after = total + (a.cost_usd or 0.0)
        rising[a.spot].append([(x(a.start), total), (x(a.end), after)])
        total, last_x = after, x(a.end)
    _segments(money, flat, color=BASELINE_COLOUR, lw=1.2)
    for spot, segments in rising.items():
        _segments(money, segments, lw=2.4, color=SPOT_COLOUR if spot else ON_DEMAND_COLOUR)
    money.plot([], [], color=SPOT_COLOUR, lw=2.4, label=f"estimated cost  {_usd(total)}")

    if run_cost.baseline_usd_per_hour is not None:
        points = baseline_curve(run_cost, runs, t0, evals)
        # A plain line through the curve's points: it accrues over each interval, never in a jump.
        money.plot(
            [x(ts) for ts, _ in points],
            [value for _, value in points],
            color=BASELINE_COLOUR,
            lw=1.8,
            ls="--",
            gid="baseline",
            label=f"on-demand baseline  {_usd(points[-1][1])}  ({run_cost.baseline_instance}: one start-up, "
            "useful steps, one wind-down)",
        )
    money.set_ylabel("USD (cumulative)")
    money.set_xlabel(f"{unit} since the first attempt started")
    money.grid(alpha=0.3)
    money.legend(loc="upper left", fontsize=8, frameon=False)

    fig.suptitle(_title(run_cost), fontsize=11)
    timeline.set_title(_footnote(run_cost), fontsize=8, loc="left", color="#555555")
    fig.legend(handles=handles, loc="outside lower center", ncols=5, fontsize=8, frameon=False)
    return fig


def _bars(axis, spans: list[tuple[float, float, float]], **style) -> None:
    """Bars (row, begin, end), 0.5 high, as one collection."""
    from matplotlib.collections import PolyCollection

    if not spans:
        return
    verts = [[(b, y - 0.25), (e, y - 0.25), (e, y + 0.25), (b, y + 0.25)] for y, b, e in spans]
    axis.add_collection(PolyCollection(verts, **style))
    axis.autoscale_view()


def _coalesced(spans: list[tuple[float, float]], closer_than: float) -> list[tuple[float, float]]:
    """Bands (begin, end), oldest first, with those less than `closer_than` apart joined: the plot is 1,210
    pixels wide, so 1/2000 of its span apart is the same pixel; 20,000 gaps drawn on three axes cost a
    second (issue 31)."""
    out: list[tuple[float, float]] = []
    for begin, end in spans:
        if out and begin - out[-1][1] < closer_than:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((begin, end))
    return out


def _spans(axis, spans: list[tuple[float, float]], **style) -> None:
    """Vertical bands (begin, end) over the axis's whole height, as one collection (axvspan makes one each)."""
    from matplotlib.collections import PolyCollection

    if spans:
        verts = [[(b, 0.0), (e, 0.0), (e, 1.0), (b, 1.0)] for b, e in spans]
        axis.add_collection(PolyCollection(verts, transform=axis.get_xaxis_transform(), **style), autolim=False)


def _marks(axis, points: list[tuple[float, float]], **style) -> None:
    """Markers at (x, y) points, as one line without its line."""
    if points:
        axis.plot([p[0] for p in points], [p[1] for p in points], ls="", **style)


def _segments(axis, segments: list[list[tuple[float, float]]], **style) -> None:
    """Polylines as one line, a NaN between them so none joins the next."""
    xs: list[float] = []
    ys: list[float] = []
    for segment in segments:
        if xs:
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs += [p[0] for p in segment]
        ys += [p[1] for p in segment]
    if xs:
        axis.plot(xs, ys, **style)


def loss_series(
    log: EventLog, runs: list[StepRun] | None = None, evals: list[EvalRun] | None = None
) -> dict[str, list]:
    """What the loss panel draws. `train`: one segment per set of processes that trained (an attempt, or its
    processes after an in-place restart) and per stretch of steps that were later run again or not, each a
    list of (ts, step, loss, recomputed), oldest first; `eval`: (ts, step, loss) of every evaluation. `runs` and
    `evals`: the log's step_runs and eval_runs, when the caller has them."""
    runs = step_runs(log) if runs is None else runs
    segments: list[list[tuple]] = []
    key = None
    for r in sorted((r for r in runs if r.loss is not None), key=lambda r: r.ts):
        here = (r.attempt, r.generation, r.recomputed)
        if here != key:
            segments.append([])
            key = here
        segments[-1].append((r.ts, r.step, r.loss, r.recomputed))
    evals = [(e.ts, e.step, e.loss) for e in (eval_runs(log) if evals is None else evals) if e.loss is not None]
    return {"train": segments, "eval": evals}


def baseline_curve(run_cost: RunCost, runs, t0: float, evals=()) -> list[tuple[float, float]]:
    """(unix time, cumulative USD) of the on-demand baseline, drawn as a line through these points: its
    start-up accruing from t0 (the run's own start), then each useful step (and each evaluation it counts)
    accruing over the time it ran, flat in between, then the wind-down; the last point is
    `run_cost.on_demand_cost_usd`."""
    rate = run_cost.baseline_usd_per_hour * run_cost.nodes / 3600
    accrued = run_cost.startup_seconds * rate
    points = [(t0, 0.0), (t0 + run_cost.startup_seconds, accrued)]
    useful = [r for r in runs if not r.recomputed]
    work = sorted(
        [(r.ts, r.seconds) for r in useful]
        + [(e.ts, e.seconds) for e in baseline_evals(list(evals), list(runs), run_cost.wind_down_seconds)]
    )
    for ts, seconds in work:
        begin = max(points[-1][0], ts - seconds)
        if begin > points[-1][0]:
            points.append((begin, accrued))  # flat while the baseline does nothing this run paid for
        accrued += seconds * rate
        points.append((max(ts, begin), accrued))
    if run_cost.wind_down_seconds and useful:
        accrued += run_cost.wind_down_seconds * rate
        points.append((points[-1][0] + run_cost.wind_down_seconds, accrued))
    return points


def _title(run: RunCost) -> str:
    parts = [run.name or "run", f"est. {_usd(run.cost_usd)}"]
    if run.on_demand_cost_usd is not None and run.savings_pct is not None:
        parts.append(f"vs {_usd(run.on_demand_cost_usd)} on demand ({run.savings_pct:.0f}% saved)")
    parts.append(f"{run.preemptions} preemption{'s' * (run.preemptions != 1)}")
    if run.restarts_in_place or run.hangs:
        parts.append(
            f"{run.restarts_in_place} in-place restart{'s' * (run.restarts_in_place != 1)}"
            + (f" ({run.hangs} hang{'s' * (run.hangs != 1)})" if run.hangs else "")
        )
    if run.mttr_seconds is not None:
        parts.append(f"MTTR {run.mttr_seconds / 60:.1f} min")
    if run.lost_steps:
        parts.append(f"{run.lost_steps} steps recomputed")
    if run.goodput is not None:
        parts.append(f"goodput {run.goodput:.0%}")
    if run.final_eval_loss is not None:
        parts.append(f"eval loss {run.final_eval_loss:.4f} at step {run.final_eval_step}")
    lines = [parts[0]]
    for part in parts[1:]:  # two lines rather than a title wider than the figure
        if len(lines[-1]) + len(part) > TITLE_WIDTH:
            lines.append(part)
        else:
            lines[-1] += "  ·  " + part
    return "\n".join(lines)


def _usd(value: float) -> str:
    # A bare "$" starts mathtext in matplotlib; escaped, it prints as a dollar sign. The sign goes first.
    return ("-" if value < 0 and round(value, 2) else "") + rf"\${abs(value):,.2f}"


def _footnote(run: RunCost) -> str:
    note = f"Estimates from list prices ({run.price_source or 'no price'} {run.price_date or ''}), not a bill."
    if run.simulated:
        note += " Simulated: a local run priced as the cloud instance it stood in for."
    return note
