"""Placement (issue 32): where recoveries go, by policy, on zoned spot traces. What each policy costs and
how much work it loses.

    python -m bench --only placement

A replay of the local controller's placement over each trace, not a run of the trainer: the same
`Placer` (skyspot/executors/local/zones.py) chooses each spot attempt's zone at the same moments, a zone's
losses after that choice end the attempt as the controller's `_should_preempt` ends it, and a run with no
spot zone available runs on-demand to the end, as `_provision` does. Each run needs WORK_S seconds of
training; each attempt spends RESTART_S before its first step (provisioning, setup, start, restore: about
what `tiny` takes on the local executor here); a preemption whose notice is at least SAVE_S loses nothing
(the emergency checkpoint), a shorter one loses the work since the last interval checkpoint. Seconds are
the traces' own (the local executor replays them as wall-clock); prices are the snapshot's g5.48xlarge
(the local executor's AWS stand-in) in each zone's region, so the costs are of 8-GPU nodes and scale with
the run's length. The replay takes well under a second: tests/executors/local/test_zones.py runs the real
controller over a zoned trace.

The policies:
- `expected_cost` (skyspot's default): the zone of least expected cost, a recent preemption counting against
  its zone and region for `resources.burst_minutes` (zones.py: spot $/h x (1 + rate x restart)); at 2 min
  (the random traces' burst length) and at the recipe's default 30 min (longer than these runs: a preemption
  counts until the end);
- `price` = SkyPilot 0.14.1's own recovery (`EAGER_NEXT_REGION`, its default strategy): the relaunch
  never blocks the region it meant to (sky/jobs/recovery_strategy.py, lines 1540-1558; skypilot #10021)
  and goes through the search space cheapest first, so back to the zone just preempted when it has
  capacity.

The traces: each shipped one (traces/*.yaml, one place) as the cheapest zone us-east-1a, beside
us-east-2a with the same trace shifted by SHIFT_S (independent of it, as far as a shift makes it); and two
with correlated preemptions: traces/bursts.yaml (one zone preempted three times in three minutes, its
sibling zone twice, another region calm) and traces/rolling.yaml (a burst that moves from region to region).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from bench.common import Figure, Results, Section, machine

ROOT = Path(__file__).resolve().parents[1]
WORK_S = 300.0
RESTART_S = 30.0
SAVE_S = 2.0
INTERVAL_S = 60.0
SHIFT_S = 35.0
INSTANCE = "g5.48xlarge"
POLICIES = (
    ("expected_cost, 2 min bursts", "expected_cost", 120.0),
    ("expected_cost, 30 min bursts", "expected_cost", 1800.0),
    ("price = SkyPilot 0.14.1", "price", 0.0),
)
START = "<!-- placement results: written by `python -m bench --only placement` -->"
END = "<!-- /placement results -->"


@dataclass
class Outcome:
    cost: float = 0.0
    preemptions: int = 0
    lost_s: float = 0.0
    """Billed seconds that did not become kept training: restarts, notices, training redone."""
    finished_s: float = 0.0
    zones: str = ""


def replay(zones, notice: float, policy: str, burst_s: float, prices: dict, on_demand: float) -> Outcome:
    from skyspot.executors.local.zones import Placer

    placer = Placer(zones, policy, prices, burst_s=burst_s, restart_s=RESTART_S)
    out, t, left, billed, visited = Outcome(), 0.0, WORK_S, 0.0, []
    while True:
        zone, _ = placer.choose(t)
        if zone is None:  # no spot anywhere: on-demand to the end (the controller's _provision)
            end = t + RESTART_S + left
            out.cost += (end - t) * on_demand / 3600
            billed += end - t
            visited.append("on-demand")
            break
        visited.append(zone.zone)
        start = t + RESTART_S
        end = start + left
        loss = next((x for x in zone.losses() if x >= t), math.inf)  # the placed zone's, from its placement on
        if end <= loss:
            out.cost += (end - t) * prices[zone.key] / 3600
            billed += end - t
            break
        gone = loss + notice
        trained = max(0.0, loss - start)
        left -= trained if notice >= SAVE_S else INTERVAL_S * math.floor(trained / INTERVAL_S)
        out.cost += (gone - t) * prices[zone.key] / 3600
        billed += gone - t
        out.preemptions += 1
        placer.lost(zone, loss)
        t = gone
    out.finished_s, out.lost_s = end, billed - WORK_S
    out.zones = " > ".join(_runs(visited))
    return out


def _runs(names: list[str]) -> list[str]:
    """["a", "a", "b"] -> ["a x2", "b"]."""
    out: list[str] = []
    for name in names:
        if out and out[-1].split(" x")[0] == name:
            head, _, count = out[-1].partition(" x")
            out[-1] = f"{head} x{int(count or 1) + 1}"
        else:
            out.append(name)
    return out


def traces() -> dict[str, tuple[list, float]]:
    """The zoned traces shipped in traces/ (a trace of one place leaves placement nothing to choose)."""
    from skyspot.executors.local.spot_trace import SpotTrace

    found = {}
    for path in sorted((ROOT / "traces").glob("*.yaml")):
        trace = SpotTrace.load(path)
        if trace.zones:
            found[path.stem] = (trace.zones, trace.notice if trace.notice is not None else 5.0)
    return found


PLACES = (
    ("us-east-1", "us-east-1a"),
    ("us-east-1", "us-east-1b"),
    ("us-east-2", "us-east-2a"),
    ("us-west-2", "us-west-2a"),
)
HORIZON_S = 3000.0


def random_trace(seed: int, bursty: bool) -> list:
    """Four zones in three regions. `bursty`: each region has bursts (Poisson, one per 600 s, 120 s long) in
    which each of its zones is preempted once per 40 s, and once per 900 s between bursts; else each zone is
    preempted once per 200 s, independently."""
    import random

    from skyspot.executors.local.spot_trace import Zone

    rng = random.Random(seed)

    def poisson(rate_s: float, start: float, end: float) -> list[float]:
        times, t = [], start
        while True:
            t += rng.expovariate(1.0 / rate_s)
            if t >= end:
                return times
            times.append(round(t, 1))

    bursts = {region: [] for region, _ in PLACES}
    if bursty:
        for region in bursts:
            bursts[region] = [(t, t + 120.0) for t in poisson(600.0, 0.0, HORIZON_S)]
    zones = []
    for region, zone in PLACES:
        if bursty:
            times = poisson(900.0, 0.0, HORIZON_S) + [x for a, b in bursts[region] for x in poisson(40.0, a, b)]
        else:
            times = poisson(200.0, 0.0, HORIZON_S)
        zones.append(Zone("aws", region, zone, tuple(sorted(times))))
    return zones


def run(results: Results, quick: bool) -> None:
    from skyspot.executors.local.zones import snapshot_prices
    from skyspot.pricing.prices import hourly_price

    on_demand = hourly_price("aws", instance_type=INSTANCE, region="us-east-1", spot=False, snapshot_only=True)
    rows: list[str] = []
    ratios: dict[tuple[str, str], list[float]] = {}
    for name, (zones, notice) in traces().items():
        prices = snapshot_prices(zones, INSTANCE)
        outcomes = {
            label: replay(zones, notice, policy, avoid, prices, on_demand.usd_per_hour)
            for label, policy, avoid in POLICIES
        }
        for label, o in outcomes.items():
            rows.append(
                f"| {name} | {label} | ${o.cost:.3f} | {o.preemptions} | {o.lost_s:.0f} | {o.finished_s:.0f} | {o.zones} |"
            )
        for label, _, _ in POLICIES[:2]:
            ratios[(name, label)] = [outcomes[label].cost / outcomes[POLICIES[2][0]].cost]
    seeds = range(50 if quick else 500)
    for bursty in (True, False):
        name = f"random, {'bursts per region' if bursty else 'independent zones'}"
        sums = {label: Outcome() for label, _, _ in POLICIES}
        ratio: dict[str, list[float]] = {label: [] for label, _, _ in POLICIES[:2]}
        for seed in seeds:
            zones = random_trace(seed, bursty)
            prices = snapshot_prices(zones, INSTANCE)
            got = {
                label: replay(zones, 5.0, policy, avoid, prices, on_demand.usd_per_hour)
                for label, policy, avoid in POLICIES
            }
            for label, o in got.items():
                total = sums[label]
                total.cost += o.cost / len(seeds)
                total.preemptions += o.preemptions
                total.lost_s += o.lost_s / len(seeds)
                total.finished_s += o.finished_s / len(seeds)
            for label in ratio:
                ratio[label].append(got[label].cost / got[POLICIES[2][0]].cost)
        for label, o in sums.items():
            rows.append(
                f"| {name} ({len(seeds)} traces, mean) | {label} | ${o.cost:.3f} | {o.preemptions / len(seeds):.2f} | "
                f"{o.lost_s:.0f} | {o.finished_s:.0f} | |"
            )
        for label, values in ratio.items():
            ratios[(name, label)] = values
    for (name, label), values in ratios.items():
        correlated = name in ("bursts", "random, bursts per region") and label == POLICIES[0][0]
        results.add(
            Figure(
                "placement",
                f"{name}: cost, {label} / SkyPilot 0.14.1's recovery",
                "x",
                values,
                goal="< 1" if correlated else None,
                met=statistics.fmean(values) < 1 if correlated else None,
                note=f"mean {statistics.fmean(values):.3f}" if len(values) > 1 else "",
            )
        )
    m = machine()
    table = (
        "| trace | policy | cost | preemptions | lost work (s) | finished (s) | zones in turn |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(rows)
    )
    block = (
        f"{START}\n\nLatest: `python -m bench --only placement`, {m['date']}. {WORK_S:.0f} s of training, "
        f"{RESTART_S:.0f} s per restart, g5.48xlarge at the snapshot's prices (spot: us-east-1 "
        f"${snapshot_prices(random_trace(0, False), INSTANCE)['aws/us-east-1/us-east-1a']:.2f}/h, us-east-2 "
        f"${snapshot_prices(random_trace(0, False), INSTANCE)['aws/us-east-2/us-east-2a']:.2f}/h, us-west-2 "
        f"${snapshot_prices(random_trace(0, False), INSTANCE)['aws/us-west-2/us-west-2a']:.2f}/h; "
        f"on-demand ${on_demand.usd_per_hour:.2f}/h). Lost work: billed seconds that did not become kept training (restarts, notices, training redone).\n\n"
        f"{table}\n\n{END}"
    )
    results.sections.append(Section(START, END, block))
