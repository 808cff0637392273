"""`spot-risk`'s use-case: each spot placement's preemption rate and where it comes from.

    found = spot_risk_rows(cloud="aws", instance="p5.48xlarge")   # UsageError for an unknown cloud or type
    found.rows     # one dict per (cloud, region or any, instance type, spot): prior, published, observed, rate

The placements are the price snapshot's (app/report.py `price_rows`, the same rows as `skyspot prices`),
each instance type also with no region ("any": what a plan without `resources.regions` asks SkyPilot
for). The figures are planning/spot_risk.py's `rate_for`, the one the plan orders its candidates by:
the prior (ours), the published signal (planning/spot_signals.py) and this machine's preemption history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from skyspot.errors import UsageError

if TYPE_CHECKING:
    from skyspot.planning.spot_signals import Published, Signal


@dataclass
class SpotRiskRows:
    """`spot-risk`: one row per spot placement, and the dates of what they were computed from."""

    rows: list[dict[str, Any]]
    feed: str
    """The published signals' feed and the date of its snapshot (planning/spot_signals.py FEED, FEED_DATE)."""
    price_date: str
    """The price snapshot the placements come from."""


def spot_risk_rows(
    cloud: Optional[str] = None, instance: Optional[str] = None, region: Optional[str] = None
) -> SpotRiskRows:
    """Every spot placement of the price snapshot (filtered by cloud, instance type, region) with its rate."""
    from skyspot.app.report import price_rows
    from skyspot.planning.spot_risk import rate_for, read_history
    from skyspot.planning.spot_signals import FEED, FEED_DATE, Signal

    prices = price_rows(cloud, instance)
    if region is not None and region not in {r["region"] for r in prices.rows}:
        what = " ".join(x for x in (cloud, instance) if x)
        raise UsageError(
            f"the price snapshot has no {what + ' ' if what else ''}placement in region '{region}'; "
            "`skyspot prices` lists the regions"
        )
    places: set[tuple[str, str, Optional[str], str]] = set()
    for r in prices.rows:
        accelerator = f"{r['accelerator']}:{r['accelerator_count']}" if r["accelerator"] else ""
        if region is None:
            places.add((r["cloud"], r["instance_type"], None, accelerator))
        if region is None or r["region"] == region:
            places.add((r["cloud"], r["instance_type"], r["region"], accelerator))
    history = read_history()
    rows = []
    for c, itype, where, accelerator in sorted(places, key=lambda p: (p[0], p[1], p[2] or "")):
        risk = rate_for(history, c, region=where, instance_type=itype, spot=True, accelerator=accelerator or None)
        published = risk.published
        signal = published if isinstance(published, Signal) else None
        seen = risk.observed
        rows.append(
            {
                "cloud": c,
                "region": where,
                "instance_type": itype,
                "accelerator": accelerator or None,
                "spot": True,
                "prior_per_node_hour": risk.prior_per_node_hour,
                "published": _published(signal, published),
                "published_label": signal.label if signal else None,
                "published_date": signal.date if signal else None,
                "published_source": signal.source if signal else None,
                "published_multiplier": published.multiplier if published else 1.0,
                "published_note": published.text() if published else None,
                "observed_preemptions": seen.raw_preemptions,
                "observed_node_hours": seen.raw_node_hours,
                "observed_decayed_preemptions": seen.preemptions,
                "observed_decayed_node_hours": seen.node_hours,
                "observed": (
                    f"{seen.raw_preemptions} in {seen.raw_node_hours:,.1f} node-h"
                    if seen.raw_node_hours > 0 or seen.raw_preemptions
                    else "none"
                ),
                "per_node_hour": risk.per_node_hour,
                "source": risk.source,
            }
        )
    return SpotRiskRows(rows=rows, feed=f"{FEED} feed of {FEED_DATE}", price_date=prices.snapshot_date)


def _published(signal: Optional["Signal"], published: Optional["Published"]) -> str:
    """The table's PUBLISHED cell: the bucket and its multiplier, the type's median for any region, or none
    (the row's source says why)."""
    if signal is None:
        return "none published" if published is not None else "-"
    if signal.region is None:
        return f"median of {signal.regions} (x1)"
    return f"'{signal.label}' (x{signal.multiplier:.2g})"
