"""Where the local executor places each spot attempt of a zoned trace (spot_trace.py `zones`): the
recovery that leaves the place that just failed when that pays, emulated so it is tested and benchmarked here.

    placer = Placer(trace.zones, policy="expected_cost", prices={...}, burst_s=1800, restart_s=40)
    zone, why = placer.choose(t)          # the zone of the next spot attempt, t seconds after launch
    placer.lost(zone, t)                  # that attempt's spot instance was taken at t

The two policies are what `resources.placement` orders a cloud run's candidates by (docs/planning.md):

- `price`: the cheapest zone with spot capacity now, every time. This is also what SkyPilot 0.14.1's
  managed-job recovery does on a cloud: `EAGER_NEXT_REGION` (its default strategy) means to block the
  region just preempted, but `EagerFailoverStrategyExecutor.recover` (sky/jobs/recovery_strategy.py,
  lines 1540-1558) reads the launched resources, whose region is always set, so it blocks nothing and
  relaunches in the optimizer's order, cheapest first (skypilot-org/skypilot #10021).
- `expected_cost`: the zone whose expected cost per hour of training is least (planning/bursts.py, the rule a
  supervised cloud run's relaunch uses too: executors/sky/relaunch.py),

      expected $/h = spot $/h x (1 + rate x restart)

  where `restart` is the seconds a preemption costs (provisioning to the first step, as this run measured
  them) and `rate` the expected preemptions per second of an instance in that zone now: each spot instance
  taken in the zone's region in the last `burst_s` (`resources.burst_minutes`) counts 1 / burst_s, and one
  taken in the zone itself counts again. Spot interruptions come in bursts per type and region (AWS
  reclaims a type's capacity across a region's zones at once; Spot-and-Scoot 2026), so a preemption
  predicts another there soon; how soon is the one figure a user sets. A recovery then leaves the zone
  (and its region) just preempted when a zone elsewhere is dearer by less than the restarts it expects to
  save, and stays when the others cost more: always leaving costs more on independent zones
  (docs/benchmarks.md, "Placement"). With no recent preemption it is the price order.

Prices are the snapshot's spot price of the simulated instance in each zone's region (the cost report
prices the attempt the same way), so the order does not depend on this machine's SkyPilot cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from skyspot.executors.local.spot_trace import Zone
from skyspot.planning.bursts import expected_usd_per_hour

POLICIES = ("expected_cost", "price")


@dataclass
class Placer:
    zones: Sequence[Zone]
    policy: str = "expected_cost"
    prices: Mapping[str, float] = field(default_factory=dict)
    """Spot $/h per zone key; a zone without one sorts after every priced zone (then in trace order)."""
    burst_s: float = 1800.0
    """How long a preemption counts against its zone and region; 0: never (the price order)."""
    restart_s: float = 0.0
    """What a preemption costs, in seconds of the run (the controller keeps it measured)."""
    losses: list[tuple[Zone, float]] = field(default_factory=list)
    """Every spot instance taken so far: (its zone, seconds after launch)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"placement policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if not self.zones:
            raise ValueError("a placer needs at least one zone")

    def price(self, zone: Zone) -> float:
        return self.prices.get(zone.key, math.inf)

    def recent(self, zone: Zone, t: float) -> tuple[int, int]:
        """(instances taken in `zone`'s region, in `zone` itself) within the last burst_s before `t`."""
        near = [
            z
            for z, at in self.losses
            if 0 <= t - at < self.burst_s and (z.cloud, z.region) == (zone.cloud, zone.region)
        ]
        return len(near), sum(1 for z in near if z.key == zone.key)

    def expected(self, zone: Zone, t: float) -> float:
        """Expected $/h of training in `zone` at `t` (the module's formula, planning/bursts.py)."""
        return expected_usd_per_hour(
            self.price(zone), recent=sum(self.recent(zone, t)), burst_s=self.burst_s, restart_s=self.restart_s
        )

    def choose(self, t: float) -> tuple[Optional[Zone], str]:
        """The zone of a spot attempt placed `t` seconds after launch and why; (None, why) when no zone has
        spot capacity then."""
        up = [z for z in self.zones if z.available(t)]
        if not up:
            return None, "no zone has spot capacity"
        order = {z.key: i for i, z in enumerate(self.zones)}
        by_price = sorted(up, key=lambda z: (self.price(z), order[z.key]))
        if self.policy == "price":
            return by_price[0], f"the cheapest zone with spot capacity ({_dollars(self.price(by_price[0]))})"
        chosen = min(by_price, key=lambda z: (self.expected(z, t), self.price(z), order[z.key]))
        why = f"expected {self._why(chosen, t)}"
        passed = by_price[: by_price.index(chosen)]
        if passed:
            why += "; passed over " + "; ".join(f"{z.key}: expected {self._why(z, t)}" for z in passed)
        return chosen, why

    def _why(self, zone: Zone, t: float) -> str:
        region, own = self.recent(zone, t)
        text = f"{_dollars(self.expected(zone, t))} (spot {_dollars(self.price(zone))}"
        if region:
            text += (
                f"; {region} preemption(s) in its region and {own} in the zone in the last {self.burst_s:.0f}s, "
                f"{self.restart_s:.0f}s per restart"
            )
        return text + ")"

    def lost(self, zone: Zone, t: float) -> None:
        """A spot instance of an attempt in `zone` was taken `t` seconds after launch."""
        self.losses.append((zone, t))


def _dollars(price: float) -> str:
    return "no price" if math.isinf(price) else f"${price:.2f}/h"


def snapshot_prices(zones: Sequence[Zone], instance_type: str) -> dict[str, float]:
    """Each zone's spot $/h for `instance_type`, from the offline snapshot at the zone's region (zones
    whose region has no price are left out)."""
    from skyspot.errors import UsageError
    from skyspot.pricing.prices import hourly_price

    prices = {}
    for zone in zones:
        try:
            found = hourly_price(
                zone.cloud, instance_type=instance_type, region=zone.region, spot=True, snapshot_only=True
            )
        except UsageError:
            continue
        prices[zone.key] = found.usd_per_hour
    return prices
