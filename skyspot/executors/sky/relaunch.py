"""Where a supervised cloud run's next stage may go after a spot preemption: the candidates of a relaunch.

    loss = Loss("aws", "us-east-1", "us-east-1a", at=now)
    plan = relaunch_plan(task, [loss], now=now, burst_s=1800, restart_s=900)
    plan.task, plan.leaves, plan.why     # aws spot candidates pinned per region, by expected cost; whether it pays

Why skyspot relaunches at all (docs/planning.md, "Recoveries on a cloud"): SkyPilot 0.14.1's own recovery
cannot leave the region it was preempted in. `EagerFailoverStrategyExecutor.recover`
(sky/jobs/recovery_strategy.py 1522-1558) blocks the launched region only when
`requested_resources.region is None and requested_resources.zone is None`, with `requested_resources =
self._launched_resources`, whose region is always set once a cluster launched (skypilot #10021), and
FAILOVER, the default for multi-node jobs, retries the launched region first on purpose (`recover`,
1444-1494). So skyspot's controller job (executors/sky/deadline.py), which already runs a deadline's stages,
cancels a spot stage SkyPilot is recovering and launches the next stage with these candidates, when that pays.

How the task is changed: every spot candidate without a region, on a cloud with a preemption in the last
`burst_s`, becomes one candidate per region the price snapshot lists for it, ordered by expected cost
(planning/bursts.py): the region's spot price x (1 + rate x restart). A preemption counts twice against its
region (once as the region's, once as the zone's: pinned to the region, SkyPilot's optimizer picks its
cheapest zone again, usually the one just preempted). So the region just preempted stays a candidate, moved
back behind every region whose price is lower than its expected cost; when that moves it nowhere (it is
cheaper than the next region by more than the restarts it expects), the price order stands (`leaves`
False) and SkyPilot's own recovery is left to do it. Candidates the recipe
pinned to a region, on-demand candidates (a spot preemption says nothing of on-demand capacity) and other
clouds' candidates stay as rendered, in the rendered order. Regions, not zones: `region:` is what a task
pins on every cloud.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from skyspot.planning.bursts import expected_usd_per_hour


@dataclass(frozen=True)
class Loss:
    """A spot stage preempted: where (as SkyPilot's queue reported it) and when (unix seconds)."""

    cloud: str
    region: str
    zone: Optional[str]
    at: float

    def as_dict(self) -> dict[str, Any]:
        return {"cloud": self.cloud, "region": self.region, "zone": self.zone, "at": self.at}

    @classmethod
    def from_dict(cls, data: Any) -> Optional["Loss"]:
        if not isinstance(data, dict) or not data.get("cloud") or not data.get("region"):
            return None
        try:
            at = float(data.get("at") or 0.0)
        except (TypeError, ValueError):
            return None
        zone = data.get("zone")
        return cls(str(data["cloud"]).lower(), str(data["region"]), str(zone) if zone else None, at)


@dataclass(frozen=True)
class Relaunch:
    task: dict[str, Any]
    """The next stage's task (the one given, when nothing is recent)."""
    leaves: bool
    """Whether a region preempted moved back in some candidate's regions: a relaunch tries the others first,
    where SkyPilot's own recovery, in price order, would try it as before."""
    why: str


def regions_for(cloud: str, accelerators: Optional[str], *, spot: bool) -> dict[str, float]:
    """{region: cheapest $/h of a node there} for `accelerators` on `cloud` in the price snapshot (spot price
    for spot; zones an account must opt into left out, as the plan leaves them out), cheapest first."""
    from skyspot.pricing.prices import snapshot_rows

    if not accelerators:
        return {}
    name, _, count = accelerators.partition(":")
    best: dict[str, float] = {}
    for row in snapshot_rows(cloud):
        if row["opt_in_zone"] or str(row["accelerator"]).lower() != name.lower():
            continue
        if int(row["accelerator_count"]) != int(count or 1):
            continue
        price = row["spot_usd_per_hour"] if spot else row["usd_per_hour"]
        if price is None:
            continue
        region = str(row["region"])
        best[region] = min(price, best.get(region, price))
    return dict(sorted(best.items(), key=lambda item: (item[1], item[0])))


def recent(losses: Iterable[Loss], now: float, burst_s: float) -> list[Loss]:
    """The losses that still count at `now`."""
    return [loss for loss in losses if 0 <= now - loss.at < burst_s]


def relaunch_plan(
    task: dict[str, Any], losses: Iterable[Loss], *, now: float, burst_s: float, restart_s: float
) -> Relaunch:
    """The next stage's task after `losses` (module docstring), and whether it leaves a place SkyPilot would
    go back to."""
    counted = recent(losses, now, burst_s)
    per_region: dict[tuple[str, str], int] = {}
    for loss in counted:
        per_region[(loss.cloud, loss.region)] = per_region.get((loss.cloud, loss.region), 0) + 2
    clouds = {cloud for cloud, _ in per_region}
    resources = task.get("resources") or {}
    key = "ordered" if "ordered" in resources else ("any_of" if "any_of" in resources else None)
    if not clouds:
        return Relaunch(task, False, "no recent preemption")
    inline = key is None
    candidates = [resources] if inline else list(resources[key])
    out: list[dict[str, Any]] = []
    moved: list[str] = []
    for candidate in candidates:
        cloud = str(candidate.get("cloud") or "").lower()
        if cloud not in clouds or not candidate.get("use_spot") or candidate.get("region"):
            out.append(candidate)
            continue
        prices = regions_for(cloud, candidate.get("accelerators"), spot=True)
        if not prices:
            out.append(candidate)
            continue
        expected = {
            region: expected_usd_per_hour(
                price, recent=per_region.get((cloud, region), 0), burst_s=burst_s, restart_s=restart_s
            )
            for region, price in prices.items()
        }
        order = sorted(prices, key=lambda r: (expected[r], prices[r], r))
        by_price = list(prices)
        for region in by_price:
            if order.index(region) != by_price.index(region) and per_region.get((cloud, region)):
                moved.append(
                    f"{cloud} {candidate.get('accelerators')}: {region} from #{by_price.index(region) + 1} to "
                    f"#{order.index(region) + 1} of {len(order)} regions (spot ${prices[region]:.2f}/h, expected "
                    f"${expected[region]:.2f}/h after {per_region[(cloud, region)] // 2} preemption(s) in the last "
                    f"{burst_s / 60:g} min, {restart_s:.0f}s per restart)"
                )
        out.extend({**candidate, "region": region} for region in order)
    if not moved:
        return Relaunch(task, False, "staying pays: no region preempted moves back in the expected-cost order")
    changed = copy.deepcopy(task)
    if inline:
        # One candidate written inline: SkyPilot applies the top-level fields to each `ordered` entry.
        changed["resources"]["ordered"] = [{"region": c["region"]} for c in out]
    else:
        changed["resources"][key] = out
    return Relaunch(changed, True, "; ".join(moved))
