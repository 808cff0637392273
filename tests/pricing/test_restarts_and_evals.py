"""In-place restarts, hangs and evaluations in the cost report's figures (#25, #26), on events built by hand
with the arithmetic done by hand below.

One local run, g5.48xlarge spot (simulated), T = the first attempt's start, steps of 2 s:

  attempt 0  attempt_start T; rank 0 starts T+10; steps 1-8 end T+22 ... T+36 (step 1 starts T+20);
             checkpoint step 6 (blocked 0.5 s) at T+32.5; rank 1 crashes at T+37 (its peer's exit: error)
    restart 1: new processes at T+40, resume step 6; steps 7-10 end T+47 ... T+53; eval of step 10 ends
             T+54.5 (1.5 s); steps 11-12 end T+56.5, T+58.5; checkpoint step 12 (blocked 0.5 s) at T+59;
             then no step: the watchdog's hang at T+70 (11.5 s without a step, bound 10 s)
    restart 2: new processes at T+72, resume step 12; steps 13-14 end T+76, T+78; eval of step 14 ends T+80
             (2 s); the executor's notice at T+80.5; attempt_end (preempted) at T+82, no emergency checkpoint
  attempt 1  attempt_start T+100; start T+105; resume step 12 at T+108; steps 13-16 end T+110 ... T+116;
             eval of step 16 ends T+118 (2 s, loss 1.1); exit T+119; attempt_end (complete) T+120
"""

from __future__ import annotations

import math

import pytest

from skyspot.attempts import split
from skyspot.events import EventLog
from skyspot.pricing import cost
from tests.builders import eval_event, event, hang_event, restart_event

T = 2_000_000.0
WHERE = {
    "cloud": "aws",
    "region": "us-east-1",
    "zone": "us-east-1a",
    "instance_type": "g5.48xlarge",
    "spot": True,
    "accelerators": None,
    "num_nodes": 1,
    "simulated": True,
}


@pytest.fixture(autouse=True)
def no_catalog_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SKY_RUNTIME_DIR", str(tmp_path / "sky-runtime"))


def step(ts, attempt, k, loss=None):
    return event(ts, "step", attempt, step=k, loss=2.0 - k / 20 if loss is None else loss, step_seconds=2.0)


def starts(ts, attempt):
    return [
        event(ts, "start", attempt, where=WHERE, world_size=2, pid=int(ts)),
        event(ts - 0.2, "start", attempt, rank=1, where=WHERE, world_size=2, pid=int(ts) + 1),
    ]


def restarted_run() -> EventLog:
    e = [event(T, "attempt_start", 0, rank=None, where=WHERE), *starts(T + 10, 0)]
    e += [step(T + 20 + 2 * k, 0, k) for k in range(1, 9)]
    e += [
        event(T + 32.5, "checkpoint_end", 0, step=6, kind="interval", blocked_seconds=0.5),
        event(T + 37.5, "exit", 0, code=1, reason="error", step=8),
    ]  # the crashed rank's peer
    e += [*starts(T + 40, 0), event(T + 42, "resume", 0, step=6, source="local", load_seconds=1.0)]
    e += [step(T + 47 + 2 * (k - 7), 0, k) for k in range(7, 11)]
    e += [
        restart_event(T + 47, 0, failed_at=T + 37, step=6, steps_redone=2),
        eval_event(T + 54.5, 0, step=10, loss=1.6, seconds=1.5),
        step(T + 56.5, 0, 11),
        step(T + 58.5, 0, 12),
        event(T + 59, "checkpoint_end", 0, step=12, kind="interval", blocked_seconds=0.5),
        hang_event(T + 70, 0, step=12, seconds_without_step=11.5, bound_seconds=10.0),
        hang_event(T + 70.3, 0, node_rank=1, step=12, seconds_without_step=11.8, bound_seconds=10.0),
    ]
    e += [
        *starts(T + 72, 0),
        event(T + 73, "resume", 0, step=12, source="local", load_seconds=1.0),
        step(T + 76, 0, 13),
        step(T + 78, 0, 14),
        restart_event(T + 76, 0, failed_at=T + 70, step=12, steps_redone=0, cause="hang", restart=2),
        eval_event(T + 80, 0, step=14, loss=1.4, seconds=2.0),
        event(T + 80.5, "preempt_notice_sent", 0, rank=None, deadline=T + 85),
        event(T + 82, "attempt_end", 0, rank=None, code=137, reason="preempted"),
    ]
    e += [
        event(T + 100, "attempt_start", 1, rank=None, where=WHERE),
        *starts(T + 105, 1),
        event(T + 108, "resume", 1, step=12, source="local", load_seconds=1.0),
    ]
    e += [step(T + 110 + 2 * (k - 13), 1, k) for k in range(13, 17)]
    e += [
        eval_event(T + 118, 1, step=16, loss=1.1, seconds=2.0),
        event(T + 119, "exit", 1, code=0, reason="complete", step=16),
        event(T + 120, "attempt_end", 1, rank=None, code=0, reason="complete"),
    ]
    return EventLog(events=sorted(e, key=lambda x: x["ts"]))


def test_an_attempt_restarted_in_place_is_one_attempt_with_three_sets_of_processes():
    first, second = split(restarted_run().events)
    assert (first.process_starts, second.process_starts) == ([T + 10, T + 40, T + 72], [T + 105])
    assert (first.in_place_restarts, len(first.hangs), second.in_place_restarts) == (2, 1, 0)
    assert [first.generation(T + t) for t in (9, 36, 47, 70, 76)] == [0, 0, 1, 1, 2]
    # The crashed processes' `exit` (error) ends nothing: the attempt ended as its attempt_end says.
    assert (first.reason, first.end, first.cause) == ("preempted", T + 82, "spot-preemption")


def test_a_running_attempt_restarted_in_place_is_still_running():
    """Trainer events only (a SkyPilot run), after a crash and an in-place restart: the old processes'
    error exit must not end the attempt, or status and the cost so far would stop at it."""
    events = [e for e in restarted_run().events if e["attempt"] == 0 and e["rank"] is not None and e["ts"] < T + 60]
    [attempt] = split(events, now=T + 65)
    assert (attempt.reason, attempt.open, attempt.end, attempt.cause) == ("running", True, T + 65, None)


def test_in_place_restarts_are_counted_and_timed_apart_from_re_provisioned_recoveries():
    run = cost.run_cost(restarted_run())
    assert (run.restarts_in_place, run.hangs, run.recoveries, run.preemptions) == (2, 1, 1, 1)
    one, two = run.in_place_details
    assert (one.restart, one.cause, one.seconds_to_next_step, one.resumed_step, one.steps_redone) == (
        1,
        "crash",
        10.0,
        6,
        2,
    )
    assert (one.lost_steps, one.lost_seconds, one.hang) == (2, 4.0, None)  # steps 7 and 8 ran twice
    assert (two.restart, two.cause, two.seconds_to_next_step, two.lost_steps) == (2, "hang", 6.0, 0)
    assert two.hang["seconds_without_step"] == 11.5 and two.hang["bound_seconds"] == 10.0
    assert two.hang["stacks"] == "stacks/hang-1" and two.hang["ranks"][0]["top"] == "loop.py:700 train"
    # Re-provisioned: the notice T+80.5 -> the first step after the restore T+110.
    [recovery] = run.recovery_details
    assert recovery.total_seconds == pytest.approx(29.5) and recovery.lost_steps == 2  # steps 13, 14
    assert run.mttr_reprovisioned_seconds == pytest.approx(29.5)
    assert run.mttr_in_place_seconds == pytest.approx((10 + 6) / 2)
    assert run.mttr_seconds == pytest.approx((29.5 + 10 + 6) / 3)  # every recovery
    assert (run.lost_steps_in_place, run.lost_seconds_in_place) == (2, 4.0)
    assert (run.lost_steps_reprovisioned, run.lost_seconds_reprovisioned) == (2, 4.0)
    assert (run.lost_steps, run.lost_seconds) == (4, 8.0)
    assert (run.useful_steps, run.useful_seconds) == (16, 32.0)  # each of 16 steps once


def test_the_final_eval_is_the_newest_and_evaluating_counts_once_in_the_baseline():
    run = cost.run_cost(restarted_run())
    assert (run.final_eval_loss, run.final_eval_step, run.final_eval_at) == (1.1, 16, T + 118)
    assert run.final_eval_perplexity == pytest.approx(math.exp(1.1))
    assert (run.final_train_loss, run.final_train_step) == (pytest.approx(2.0 - 16 / 20), 16)
    assert (run.evals, run.eval_seconds) == (3, 5.5)
    # One start-up (T -> T+20) + 16 steps (32 s) + the evaluations before the last step (1.5 + 2) + the
    # wind-down (step 16 ends T+116 -> T+120, the final eval inside it).
    assert (run.startup_seconds, run.wind_down_seconds) == (20.0, 4.0)
    assert run.useful_eval_seconds == 3.5
    assert run.baseline_seconds == pytest.approx(20 + 32 + 3.5 + 4)


def test_the_goodput_lines_add_up_to_the_billed_time():
    run = cost.run_cost(restarted_run())
    lines = run.goodput_breakdown
    assert list(lines) == list(cost.GOODPUT_LINES)
    assert run.billed_seconds == 102.0  # 82 + 20
    assert lines == pytest.approx(
        {
            "useful": 32.0,
            "evaluating": 5.5,
            "redone_in_place": 4.0,
            "redone_reprovisioned": 4.0,
            "checkpoint_stalls": 1.0,
            "first_start_up": 20.0,
            "reprovisioned_start_ups": 8.0,  # T+100 -> step 13 starts T+108
            # restart 1: the old processes' last step T+36 -> step 7 starts T+45 (9 s); restart 2: step 12
            # ended T+58.5 -> step 13 starts T+74, less the checkpoint stall inside it (15 s).
            "in_place_restarts": 24.0,
            "other": 3.5,
        }
    )
    assert sum(lines.values()) == pytest.approx(run.billed_seconds)
    assert run.goodput == pytest.approx(lines["useful"] / run.billed_seconds)


def test_a_run_without_evaluations_or_restarts_reports_none_and_adds_up():
    log = EventLog(
        events=[
            e
            for e in restarted_run().events
            if e["type"] not in ("eval", "restart_in_place", "hang") and e["attempt"] == 1
        ]
    )
    run = cost.run_cost(log)
    assert (run.final_eval_loss, run.evals, run.eval_seconds, run.restarts_in_place, run.hangs) == (None, 0, 0.0, 0, 0)
    assert (run.mttr_in_place_seconds, run.in_place_details) == (None, [])
    assert sum(run.goodput_breakdown.values()) == pytest.approx(run.billed_seconds)


@pytest.mark.parametrize(
    "bad", [{"loss": "NaN-ish"}, {"loss": None}, {"seconds": "x"}, {"seconds": -4.0}, {"perplexity": True}]
)
def test_an_eval_event_with_junk_in_its_figures_counts_no_junk(bad):
    good = eval_event(T + 5, 0, step=3, loss=1.25, seconds=2.0)
    junk = {**eval_event(T + 9, 0, step=4, loss=1.0, seconds=1.0), **bad}
    runs = cost.eval_runs(EventLog(events=[event(T, "start", 0, where=WHERE), good, junk]))
    assert all(r.loss is None or math.isfinite(r.loss) for r in runs)
    assert all(r.seconds >= 0 for r in runs)
    run = cost.run_cost(EventLog(events=[event(T, "start", 0, where=WHERE), good, junk]))
    assert run.final_eval_loss in (1.0, 1.25)


# --- the plot (pricing/cost_plot.py): what it draws, checked on the figure's data and layout, not its pixels


def test_the_loss_panel_draws_every_step_run_and_each_evaluation():
    from skyspot.pricing.cost_plot import loss_series

    series = loss_series(restarted_run())
    # Steps 1-6, then 7-8 (run again after the crash), 7-12 by the restarted processes, 13-14 (lost with the
    # preemption), 13-16 on the new machines: the redone stretches show on the time axis.
    assert [([p[1] for p in seg][0], [p[1] for p in seg][-1], seg[0][3]) for seg in series["train"]] == [
        (1, 6, False),
        (7, 8, True),
        (7, 12, False),
        (13, 14, True),
        (13, 16, False),
    ]
    assert series["eval"] == [(T + 54.5, 10, 1.6), (T + 80, 14, 1.4), (T + 118, 16, 1.1)]


@pytest.mark.parametrize("scenario", ["restarted", "quickstart"])
def test_the_baseline_accrues_from_the_run_s_own_start_and_never_jumps(scenario):
    from skyspot.pricing.cost_plot import baseline_curve
    from tests.pricing.test_cost import scenario_quickstart

    log = restarted_run() if scenario == "restarted" else scenario_quickstart()
    run = cost.run_cost(log)
    t0 = run.attempts[0].start
    points = baseline_curve(run, cost.step_runs(log), t0, cost.eval_runs(log))
    rate = run.baseline_usd_per_hour * run.nodes / 3600
    assert points[0] == (t0, 0.0)
    assert points[1] == (pytest.approx(t0 + run.startup_seconds), pytest.approx(run.startup_seconds * rate))
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        assert x1 >= x0 and y1 >= y0
        assert y1 - y0 <= (x1 - x0) * rate * 1.001 + 1e-9, "the baseline rose faster than its price: a jump"
    assert points[-1][1] == pytest.approx(run.on_demand_cost_usd)


def _drawn(log):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from skyspot.pricing.cost_plot import figure

    fig = figure(cost.run_cost(log), log)
    FigureCanvasAgg(fig).draw()
    return fig, fig.canvas.get_renderer()


@pytest.mark.parametrize("scenario", ["restarted", "quickstart"])
def test_attempt_labels_stay_inside_their_axes_and_off_the_legend(scenario):
    from tests.pricing.test_cost import scenario_quickstart

    fig, renderer = _drawn(restarted_run() if scenario == "restarted" else scenario_quickstart())
    timeline = fig.axes[0]
    frame = timeline.get_window_extent(renderer)
    [legend] = fig.legends
    legend_box = legend.get_window_extent(renderer)
    labels = [t for t in timeline.texts if (t.get_gid() or "").startswith("attempt-label-")]
    assert labels
    for label in labels:
        box = label.get_window_extent(renderer)
        assert frame.x0 - 1 <= box.x0 and box.x1 <= frame.x1 + 1, label.get_text()
        assert not box.overlaps(legend_box), label.get_text()
    title = fig.get_suptitle() and fig._suptitle.get_window_extent(renderer)
    assert title.x0 >= 0 and title.x1 <= fig.bbox.x1, "the title is wider than the figure"
    [baseline] = [line for line in fig.axes[-1].lines if line.get_gid() == "baseline"]
    assert baseline.get_drawstyle() == "default"  # a line through the points, not steps that jump


def test_a_run_without_losses_has_no_loss_panel():
    from tests.pricing.test_cost import scenario_no_preemption

    log = scenario_no_preemption()
    log = EventLog(events=[{k: v for k, v in e.items() if k != "loss"} for e in log.events])
    fig, _ = _drawn(log)
    assert len(fig.axes) == 2
    assert len(_drawn(restarted_run())[0].axes) == 3


JUNK = [None, "x", -1, 0, 1e308, True, [], {}, [{"rank": "a", "top": 3}, 7], {"a": 1}]


@pytest.mark.parametrize(
    "type, fields",
    [
        ("eval", ("loss", "perplexity", "tokens", "batches", "seconds")),
        ("restart_in_place", ("cause", "failed_at", "seconds_to_next_step", "steps_redone", "restart")),
        ("hang", ("seconds_without_step", "bound_seconds", "ranks", "stacks")),
    ],
)
def test_junk_in_the_new_events_fields_never_breaks_a_figure_or_the_plot(type, fields):
    """valid_event checks only the fields every reader shares: these events' own fields may hold anything."""
    from skyspot.app.status import latest_losses
    from skyspot.executors.local.follow import RunView
    from skyspot.pricing.cost_plot import loss_series, plot_run

    for junk in JUNK:
        events = [dict(e) for e in restarted_run().events]
        for e in events:
            if e["type"] == type:
                e.update({name: junk for name in fields})
        log = EventLog(events=events)
        run = cost.run_cost(log)
        assert sum(run.goodput_breakdown.values()) == pytest.approx(run.billed_seconds)
        assert run.final_eval_loss is None or math.isfinite(run.final_eval_loss)
        loss_series(log)
        latest_losses(log)
        view = RunView(16)
        for e in events:
            view.apply(e)
    assert plot_run(run, log, "svg").startswith(b"<?xml")


def test_a_re_provisioned_recovery_ends_at_the_new_attempt_s_first_step_not_after_its_restarts():
    """An attempt preempted at T-90 and recovered onto the restarted attempt (renumbered 1, moved on 0 s):
    the recovery runs from the notice to the new attempt's first step after its first resume (T+22), not
    to the step after a resume of its in-place restarts."""
    earlier = [
        event(T - 200, "attempt_start", 0, rank=None, where=WHERE),
        *starts(T - 190, 0),
        event(T - 180, "step", 0, step=1, loss=2.0, step_seconds=2.0),
        event(T - 90, "preempt_notice_sent", 0, rank=None, deadline=T - 80),
        event(T - 85, "attempt_end", 0, rank=None, code=137, reason="preempted"),
    ]
    later = [{**e, "attempt": 1} for e in restarted_run().events if e["attempt"] == 0]
    later.append(event(T + 15, "resume", 1, step=1, source="local", load_seconds=1.0))
    run = cost.run_cost(EventLog(events=sorted(earlier + later, key=lambda e: e["ts"])))
    [recovery] = run.recovery_details
    assert (recovery.restored_at, recovery.first_step_at) == (T + 15, T + 22)
    assert recovery.total_seconds == pytest.approx(112.0)
    assert run.restarts_in_place == 2


def test_each_evaluation_counts_once_whoever_and_however_often_it_is_recorded():
    base = [event(T, "start", 0, where=WHERE)]
    every_rank = [eval_event(T + 10 + rank * 0.01, 0, rank=rank, step=5, loss=1.5, seconds=2.0) for rank in range(4)]
    periodic_then_final = [
        eval_event(T + 20, 0, step=8, loss=1.4, seconds=2.0),
        eval_event(T + 23, 0, step=8, loss=1.4, seconds=2.0),
    ]
    copy = dict(periodic_then_final[0])  # the same line read from the run dir and from the store
    runs = cost.eval_runs(EventLog(events=base + every_rank + periodic_then_final + [copy]))
    assert [(r.step, r.ts) for r in runs] == [(5, T + 10), (8, T + 20), (8, T + 23)]
    assert [r.redone for r in runs] == [False, True, False]
