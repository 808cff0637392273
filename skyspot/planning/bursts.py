"""Preemptions come in bursts: what a recent preemption in a place adds to that place's expected cost.

    expected_usd_per_hour(4.54, recent=2, burst_s=1800, restart_s=900)    # 4.54 x (1 + 2/1800 x 900) = 9.08

Spot interruptions of one type in one zone fall within 3 minutes of each other in over 92 % of cases
(Spot-and-Scoot, 2026), and a type's capacity is often taken across a region's zones at once, so a
preemption predicts another there soon. The one rule every placement of a recovery uses, the local
executor's zoned traces (executors/local/zones.py) and a supervised cloud run's relaunch
(executors/sky/relaunch.py):

    expected $/h = spot $/h x (1 + rate x restart)

`rate` is the expected preemptions per second of an instance there now: each instance taken there in the
last `burst_s` (`resources.burst_minutes`) counts 1 / burst_s (a zoned trace counts one taken in the
region once and one in the zone itself again); `restart` is the seconds one preemption costs the run
(provisioning, setup and start-up to the first step). A recovery then leaves a place just preempted when
a place elsewhere is dearer by less than the restarts it expects to save, and stays when the others cost
more: always leaving cost more on independent zones (docs/benchmarks.md, "Placement"). With no recent
preemption it is the price order; with `burst_s` 0, always.
"""

from __future__ import annotations


def expected_usd_per_hour(spot_usd_per_hour: float, *, recent: int, burst_s: float, restart_s: float) -> float:
    """Expected $/h of training at a place with `recent` preemptions counted within `burst_s` (module docstring)."""
    if burst_s <= 0 or recent <= 0:
        return spot_usd_per_hour
    return spot_usd_per_hour * (1 + recent / burst_s * restart_s)
