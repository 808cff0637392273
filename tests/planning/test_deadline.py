"""Deadlines: parsing, the policies rule by rule, the estimates from events, and the simulator on
every shipped trace (fast: no training, no executor)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from skyspot.planning.deadline import (
    ALL_ON_DEMAND,
    DEFAULT_POLICY,
    IDLE,
    ON_DEMAND,
    POLICIES,
    SPOT,
    DeadlineError,
    Estimates,
    Job,
    State,
    decide,
    feasibility,
    measure,
    parse_deadline,
    simulate,
)
from skyspot.executors.local.spot_trace import SpotTrace

TRACES = Path(__file__).resolve().parents[2] / "traces"
SHIPPED = ["calm", "outage", "flaky", "evening", "diurnal"]
# Where a smarter policy can win: spot comes back after greedy has committed to on-demand.
POLICY_MATTERS = ["evening", "diurnal"]
HOUR = 3600.0


def trace(name: str) -> SpotTrace:
    return SpotTrace.load(TRACES / f"{name}.yaml")


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "text, seconds",
    [("36h", 36 * HOUR), ("90m", 5400), ("2d", 172800), ("1h30m", 5400), ("45s", 45), ("1.5h", 5400), ("1h 30m", 5400)],
)
def test_a_duration_counts_from_now(text, seconds):
    assert parse_deadline(text, now=1000.0) == 1000.0 + seconds


def test_an_iso_time_with_an_offset_or_z_is_that_instant():
    expected = datetime(2030, 5, 1, 15, 0, tzinfo=timezone.utc).timestamp()
    assert parse_deadline("2030-05-01T17:00+02:00") == expected
    assert parse_deadline("2030-05-01T15:00Z") == expected


def test_an_iso_time_without_an_offset_is_local_time():
    assert parse_deadline("2030-05-01T17:00") == datetime(2030, 5, 1, 17, 0).timestamp()


@pytest.mark.parametrize("text", ["tomorrow", "36", "h", "-3h", "0h", "36h!", ""])
def test_an_unreadable_deadline_says_what_is_accepted(text):
    with pytest.raises(DeadlineError) as error:
        parse_deadline(text, now=0.0)
    assert "\n" not in str(error.value)


# --------------------------------------------------------------------------- the policies

EST = Estimates(step_seconds={SPOT: 1.0, ON_DEMAND: 1.0}, restart_seconds=10.0, restart_seconds_max=10.0)


def state(**kw) -> State:
    base = dict(now=0.0, start=0.0, deadline=1000.0, total_steps=500, done_steps=0, mode=IDLE)
    return State(**{**base, **kw})


def test_uniform_progress_starts_on_spot():
    assert decide("uniform-progress", state(), EST).mode == SPOT


def test_idle_behind_the_line_without_spot_goes_on_demand():
    d = decide("uniform-progress", state(now=400, done_steps=100, spot_available=False), EST)
    assert (d.mode, d.reason) == (ON_DEMAND, "behind")


def test_idle_ahead_of_the_line_without_spot_waits_for_it():
    d = decide("uniform-progress", state(now=100, done_steps=150, spot_available=False), EST)
    assert (d.mode, d.reason) == (IDLE, "wait")


def test_spot_is_taken_even_when_behind_and_kept_until_preempted():
    assert decide("uniform-progress", state(now=400, done_steps=100, spot_available=None), EST).mode == SPOT
    assert decide("uniform-progress", state(now=400, done_steps=100, mode=SPOT), EST).reason == "exploit"


def test_on_demand_holds_until_two_restarts_ahead_of_the_line():
    # ep(t + 2d) = (400 + 20) / 1000 = 0.42
    assert decide("uniform-progress", state(now=400, done_steps=205, mode=ON_DEMAND), EST).reason == "hysteresis"
    left = decide("uniform-progress", state(now=400, done_steps=215, mode=ON_DEMAND), EST)
    assert (left.mode, left.reason) == (SPOT, "ahead")


def test_the_safety_net_commits_to_on_demand_until_the_end():
    # slack = 1000 - 470 - 500 = 30 s: under 2 restarts (20 s) + 15 s between decisions + 5 % of 500 s
    d = decide("uniform-progress", state(now=470, done_steps=0, spot_available=False, margin=15), EST)
    assert (d.mode, d.reason, d.committed) == (ON_DEMAND, "safety-net", True)
    later = decide("uniform-progress", state(now=600, done_steps=400, mode=ON_DEMAND, committed=True), EST)
    assert (later.mode, later.reason) == (ON_DEMAND, "safety-net")


def test_on_spot_the_safety_net_keeps_one_restart_and_a_share_of_the_work():
    # 100 steps left: 100 s of work, of which 5 % (5 s) is kept on top of one restart (10 s).
    assert decide("greedy", state(now=880, done_steps=400, mode=SPOT), EST).mode == SPOT  # slack 20 > 15
    assert decide("greedy", state(now=890, done_steps=400, mode=SPOT), EST).mode == ON_DEMAND  # slack 10 < 15


def test_greedy_waits_for_spot_until_the_safety_net():
    assert decide("greedy", state(now=400, done_steps=100, spot_available=False), EST).mode == IDLE
    assert decide("greedy", state(now=790, done_steps=300, spot_available=False), EST).mode == ON_DEMAND


def test_adaptive_waits_like_greedy_while_the_slack_affords_few_restarts():
    behind = dict(done_steps=100, spot_available=False)
    roomy = Estimates(step_seconds={SPOT: 0.1, ON_DEMAND: 0.1}, restart_seconds=10.0, restart_seconds_max=10.0)
    assert decide("adaptive", state(now=400, **behind), roomy).mode == ON_DEMAND  # slack 560 s = 56 restarts
    tight = Estimates(step_seconds={SPOT: 1.0, ON_DEMAND: 1.0}, restart_seconds=20.0, restart_seconds_max=20.0)
    assert decide("adaptive", state(now=400, **behind), tight).mode == IDLE  # slack 200 s = 10 restarts


def test_nothing_left_is_idle_and_an_unknown_policy_is_refused():
    assert decide("uniform-progress", state(done_steps=500), EST).reason == "done"
    with pytest.raises(DeadlineError, match="unknown deadline policy"):
        decide("fastest", state(), EST)


def test_a_decision_projects_its_finish():
    on_demand = decide("uniform-progress", state(now=400, done_steps=100, spot_available=False), EST)
    assert on_demand.projected_finish == pytest.approx(400 + 10 + 400 * 1.0)


def test_a_changeover_under_way_counts_in_the_projection_and_can_make_the_deadline_unreachable():
    """A node still being prepared (or a trainer not at its first step) makes no progress: what is left of
    that changeover counts from now, so a deadline it loses is found then (issue 31, item 12)."""
    running = state(now=495, mode=SPOT, committed=True)  # 500 steps of 1 s left, 505 s to the deadline
    assert decide("adaptive", running, EST).reason == "safety-net"
    # 30 s of start-up still ahead on spot, a 10 s changeover to on-demand: neither finishes in time.
    preparing = decide("adaptive", state(now=495, mode=SPOT, committed=True, overhead_left=30.0), EST)
    assert (preparing.mode, preparing.reason) == (ON_DEMAND, "unreachable") and preparing.committed
    assert "cannot be met any more" in preparing.why
    spot = decide("adaptive", state(now=100, mode=SPOT, overhead_left=30.0), EST)
    assert spot.projected_finish == pytest.approx(100 + 30 + 500)  # the rest of the changeover, then the steps


# --------------------------------------------------------------------------- measuring


def _events():
    base = {"run_id": "r", "node_rank": 0}

    def ev(ts, attempt, type, rank=0, **kw):
        return {**base, "ts": ts, "attempt": attempt, "rank": rank, "type": type, **kw}

    events = [ev(0, 1, "attempt_start", None, where={"spot": True}), ev(1, 1, "start", where={"spot": True})]
    events += [ev(20 + i, 1, "step", step=i, step_seconds=1.0 if i > 1 else 5.0) for i in range(1, 11)]
    events += [ev(33, 1, "attempt_end", None, reason="preempted")]
    events += [ev(40, 2, "attempt_start", None, where={"spot": False}), ev(41, 2, "start", where={"spot": False})]
    events += [ev(55 + i, 2, "step", step=s, step_seconds=2.0) for i, s in enumerate(range(9, 20))]
    events += [ev(66, 2, "attempt_end", None, reason="complete")]
    return events


def test_estimates_come_from_the_events_per_placement():
    est = measure(_events(), provision_seconds=2.0)
    assert est.step_seconds == {SPOT: 1.0, ON_DEMAND: 2.0}
    # start-ups: attempt 1: 21 - 5 - 0 = 16, attempt 2: 55 - 2 - 40 = 13; wind-down 33 - 30 = 3;
    # recomputed: steps 9 and 10 again, 4 s.
    assert est.restart_seconds == pytest.approx(2.0 + 14.5 + 3.0 + 4.0)
    assert est.restart_seconds_max == pytest.approx(2.0 + 16.0 + 3.0 + 4.0)
    assert est.sources["step_seconds.spot"].startswith("measured")


def test_before_any_step_the_hint_and_the_prior_stand_in():
    est = measure([], provision_seconds=2.0, step_seconds_hint=3.0, restart_prior=600.0)
    assert est.step_seconds == {SPOT: 3.0, ON_DEMAND: 3.0} and est.restart_seconds == 600.0
    # Measured restarts set the line; the safety net never reserves less than the prior.
    measured = measure(_events(), provision_seconds=2.0, restart_prior=60.0)
    assert measured.restart_seconds == pytest.approx(23.5) and measured.restart_seconds_max == 60.0
    assert "hint" in est.sources["step_seconds"] and "prior" in est.sources["restart_seconds"]


# --------------------------------------------------------------------------- feasibility


def test_an_infeasible_deadline_is_refused_with_the_arithmetic():
    check = feasibility(now=0.0, deadline=3600.0, steps=2000, step_seconds_hint=12.0, restart_seconds=900.0)
    assert not check.ok and check.known
    assert "start-up 15m00s + 2,000 steps x 12s = 6h55m" in check.text and "1h00m" in check.text


def test_a_feasible_deadline_shows_its_slack_and_no_hint_checks_nothing():
    check = feasibility(now=0.0, deadline=10 * HOUR, steps=2000, step_seconds_hint=12.0, restart_seconds=900.0)
    assert check.ok and "slack 3h05m" in check.text
    unknown = feasibility(now=0.0, deadline=HOUR, steps=10, step_seconds_hint=None, restart_seconds=900.0)
    assert unknown.ok and not unknown.known and "step_seconds_hint" in unknown.text
    assert not feasibility(now=100.0, deadline=50.0, steps=1, step_seconds_hint=1.0, restart_seconds=1.0).ok


# --------------------------------------------------------------------------- the shipped traces


def test_at_least_five_traces_ship_with_the_scenarios_the_issue_names():
    for name in SHIPPED:
        trace(name)  # each loads
    assert not trace("calm").losses()
    assert trace("outage").unavailable[0][1] > 10_000  # gone for longer than any slack here
    gaps = [b - a for a, b in zip(trace("flaky").preemptions, trace("flaky").preemptions[1:])]
    assert len(gaps) > 10 and max(gaps) <= 70


LOCAL_JOB = dict(
    steps=300, deadline=260.0, spot_usd_per_hour=4.5408, on_demand_usd_per_hour=16.288, notice_seconds=5.0
)  # tiny as `python -m bench --only deadline` runs it, priced as g5.48xlarge


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("restart, step", [(20.0, 0.25), (32.0, 0.33), (45.0, 0.45)])
def test_local_scale_every_policy_meets_the_deadline_and_the_default_costs_at_most_on_demand(name, restart, step):
    job = Job(step_seconds=step, restart_seconds=restart, **LOCAL_JOB)
    on_demand = simulate(job, trace(name), ALL_ON_DEMAND, period=4)
    for policy in POLICIES:
        outcome = simulate(job, trace(name), policy, period=4)
        assert outcome.met, (policy, outcome.summary())
    default = simulate(job, trace(name), DEFAULT_POLICY, period=4)
    assert default.cost_usd <= on_demand.cost_usd * 1.0001, default.summary()


def cloud_job(fraction: float) -> Job:
    """Can't Be Late's setting (section 6.1): 48 h of work, a 0.2 h changeover, job fraction C/R."""
    return Job(
        steps=480,
        step_seconds=360.0,
        deadline=48 * HOUR / fraction,
        restart_seconds=0.2 * HOUR,
        spot_usd_per_hour=1.0,
        on_demand_usd_per_hour=3.59,
    )


def stretched(name: str, factor: float = 600.0) -> SpotTrace:
    """A shipped trace at cloud scale: 1 s of the trace = 10 min."""
    t = trace(name)
    return SpotTrace(
        preemptions=[p * factor for p in t.preemptions],
        unavailable=[(a * factor, b * factor) for a, b in t.unavailable],
    )


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("fraction", [0.75, 0.9])
def test_cloud_scale_deadlines_are_met_and_cost_stays_under_on_demand(name, fraction):
    job = cloud_job(fraction)
    on_demand = simulate(job, stretched(name), ALL_ON_DEMAND, tick=60, period=300)
    for policy in POLICIES:
        outcome = simulate(job, stretched(name), policy, tick=60, period=300)
        assert outcome.met and outcome.cost_usd <= on_demand.cost_usd, (policy, outcome.summary())


@pytest.mark.parametrize("name", POLICY_MATTERS)
@pytest.mark.parametrize("fraction", [0.75, 0.9])
def test_where_the_policy_matters_uniform_progress_beats_greedy(name, fraction):
    job = cloud_job(fraction)
    greedy = simulate(job, stretched(name), "greedy", tick=60, period=300)
    for policy in ("uniform-progress", "adaptive"):
        mine = simulate(job, stretched(name), policy, tick=60, period=300)
        assert mine.cost_usd < 0.9 * greedy.cost_usd, (policy, mine.summary(), greedy.summary())


def test_the_simulator_charges_a_changeover_and_bills_only_held_instances():
    job = Job(
        steps=100,
        step_seconds=1.0,
        deadline=1000.0,
        restart_seconds=10.0,
        spot_usd_per_hour=3600.0,
        on_demand_usd_per_hour=7200.0,
    )
    calm = simulate(job, SpotTrace(), "uniform-progress", tick=0.5, period=5)
    assert calm.finish == pytest.approx(110.0) and calm.cost_usd == pytest.approx(110.0)
    assert calm.segments == [(0.0, pytest.approx(110.0), SPOT)]
    # Spot goes at 50 s and never comes back: greedy waits (unbilled) and then pays on-demand.
    gone = simulate(job, SpotTrace(unavailable=[(50.0, 1e9)]), "greedy", tick=0.5, period=5)
    assert gone.met and gone.preemptions == 1 and gone.idle_seconds > 700
    assert gone.cost_usd == pytest.approx(50.0 + 2 * (10.0 + 60.0), rel=0.02)
