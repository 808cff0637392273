"""The way back to spot: whether moving the rest of a run from on-demand to spot pays.

    switch_pays(remaining_s=3600, on_demand_usd_h=16.29, spot_usd_h=4.54, provision_s=600, start_s=300)

A run that fell back to on-demand (a spot outage, capacity gone) goes back to spot, make-before-break, when
what the rest of the run saves on spot is more than what the switch costs:

    remaining x (on-demand $/h - spot $/h)  >  (provision + start) x spot $/h x (1 + rate x remaining)

`remaining` is the seconds of training left at the measured step time; `provision` the spot node's
provisioning, billed while on-demand still trains; `start` the spot node's start to a first step (a
restart costs it again); `rate` the preemptions per second of spot expected (each would cost another
provision and start). Both controllers ask it: the local executor's (executors/local/return_to_spot.py) and
a supervised cloud run's (executors/sky/deadline.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Payoff:
    pays: bool
    gain_usd: float
    cost_usd: float
    why: str


def switch_pays(
    *,
    remaining_s: float,
    on_demand_usd_h: float,
    spot_usd_h: float,
    provision_s: float,
    start_s: float,
    rate_per_s: float = 0.0,
) -> Payoff:
    """Whether moving the rest of a run from on-demand to spot pays (the module's formula), and why."""
    gain = remaining_s * (on_demand_usd_h - spot_usd_h) / 3600
    restart = (provision_s + start_s) * spot_usd_h / 3600
    cost = restart * (1 + rate_per_s * remaining_s)
    detail = (
        f"{remaining_s:.0f}s of training left x (${on_demand_usd_h:.2f} - ${spot_usd_h:.2f})/h = ${gain:.4f}, "
        f"against ${cost:.4f} for the spot node's {provision_s:.0f}s provisioning and {start_s:.0f}s start"
        + (f" and {rate_per_s * remaining_s:.2f} expected preemption(s)" if rate_per_s > 0 else "")
    )
    return Payoff(gain > cost, gain, cost, detail)
