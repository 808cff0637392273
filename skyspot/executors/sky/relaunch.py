"""A recovery that leaves the place that just failed, on SkyPilot: the candidates a relaunch may use.

    left = Left("aws", "us-east-1", "us-east-1a", until=now + 1800)
    task = avoiding(task, [left], now=now)     # the same task; aws candidates pinned to the other regions

Why skyspot relaunches at all (docs/planning.md, "Recoveries on a cloud"): SkyPilot 0.14.1's own recovery
cannot leave the region it was preempted in. `EagerFailoverStrategyExecutor.recover`
(sky/jobs/recovery_strategy.py 1522-1558) blocks the launched region only when
`requested_resources.region is None and requested_resources.zone is None`, with `requested_resources =
self._launched_resources`, whose region is always set once a cluster launched (skypilot #10021), and
FAILOVER, the default for multi-node jobs, retries the launched region first on purpose (`recover`,
1444-1494). So skyspot's controller job (executors/sky/deadline.py), which already runs a deadline's stages,
cancels a spot stage SkyPilot is recovering and launches the next stage with these candidates.

How the task is changed: every spot candidate on the cloud of a place left is pinned (`region:`) to each region
the price snapshot lists for it, cheapest spot price first (on-demand price for an on-demand candidate),
without the regions left; a spot candidate pinned to a region left already is dropped. Other clouds'
candidates and every on-demand candidate stay as they were (a spot preemption says nothing of on-demand
capacity). Regions, not zones: SkyPilot's `region:` is what a task can pin for every cloud, and a
zone's capacity is taken together with its region's often enough (Spot-and-Scoot 2026: interruptions of one
type in one zone fall within 3 minutes of each other in over 92 % of cases; its neighbours are the next
most likely). If nothing would be left, the task is unchanged: going back beats not running.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterable, Optional


@dataclass(frozen=True)
class Left:
    """A place a spot stage was preempted in, avoided until `until` (unix seconds)."""

    cloud: str
    region: str
    zone: Optional[str]
    until: float

    def as_dict(self) -> dict[str, Any]:
        return {"cloud": self.cloud, "region": self.region, "zone": self.zone, "until": self.until}

    @classmethod
    def from_dict(cls, data: Any) -> Optional["Left"]:
        if not isinstance(data, dict) or not data.get("cloud") or not data.get("region"):
            return None
        try:
            until = float(data.get("until") or 0.0)
        except (TypeError, ValueError):
            return None
        zone = data.get("zone")
        return cls(str(data["cloud"]).lower(), str(data["region"]), str(zone) if zone else None, until)


def regions_for(cloud: str, accelerators: Optional[str], *, spot: bool) -> list[str]:
    """The regions the price snapshot offers `accelerators` in on `cloud`, cheapest first (spot price for spot;
    zones an account must opt into left out, as the plan leaves them out)."""
    from skyspot.pricing.prices import snapshot_rows

    if not accelerators:
        return []
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
    return sorted(best, key=lambda r: (best[r], r))


def in_force(left: Iterable[Left], now: float) -> list[Left]:
    return [place for place in left if place.until > now]


def avoiding(task: dict[str, Any], left: Iterable[Left], *, now: float) -> dict[str, Any]:
    """The task whose candidates avoid every place in `left` still in force at `now` (module docstring)."""
    regions_left: dict[str, set[str]] = {}
    for place in in_force(left, now):
        regions_left.setdefault(place.cloud, set()).add(place.region)
    resources = task.get("resources") or {}
    if not regions_left:
        return task
    key = "ordered" if "ordered" in resources else ("any_of" if "any_of" in resources else None)
    if key is None:
        # One candidate written inline: SkyPilot applies the top-level fields to each `ordered` entry, so the
        # entries need only their region.
        pinned = _pinned(dict(resources), regions_left)
        if not pinned or pinned == [resources]:
            return task
        changed = copy.deepcopy(task)
        changed["resources"]["ordered"] = [{"region": c["region"]} for c in pinned]
        return changed
    out: list[dict[str, Any]] = []
    for candidate in resources[key]:
        out.extend(_pinned(candidate, regions_left))
    if not out:
        return task
    changed = copy.deepcopy(task)
    changed["resources"][key] = out
    return changed


def _pinned(candidate: dict[str, Any], regions_left: dict[str, set[str]]) -> list[dict[str, Any]]:
    """One candidate as the candidates that avoid the regions left: itself, none, or one per other region."""
    avoid = regions_left.get(str(candidate.get("cloud") or "").lower())
    if not avoid or not candidate.get("use_spot"):  # a spot preemption says nothing of on-demand capacity
        return [candidate]
    if candidate.get("region"):
        return [] if candidate["region"] in avoid else [candidate]
    regions = regions_for(str(candidate["cloud"]), candidate.get("accelerators"), spot=bool(candidate.get("use_spot")))
    return [{**candidate, "region": region} for region in regions if region not in avoid]


def describe(left: Iterable[Left], now: float) -> str:
    places = in_force(left, now)
    if not places:
        return "nothing"
    return ", ".join(
        f"{p.cloud}/{p.region}" + (f" (preempted in {p.zone})" if p.zone else "") + f" for {p.until - now:.0f}s"
        for p in places
    )
