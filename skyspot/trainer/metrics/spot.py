"""The spot story on the dashboards' step axis: preemptions so far, cost so far, where the run is.

The node cannot price itself: the trainer never imports skyspot.pricing (tests/test_imports.py), so the
task hands it the hourly prices it may need in SKYSPOT_PRICES (task/render.py fills it from the planned
candidates; the local executor from its simulated placement), a JSON list of

    {"cloud": "aws", "region": null, "instance_type": "p5.48xlarge", "accelerators": "H100:8",
     "spot": true, "usd_per_hour": 31.4}

per node, at list price. Cost so far is this attempt's price x its nodes x its time since its start,
plus every earlier attempt's from the run's events (attempts.split, as cost-report splits them): an
estimate for the curve; `skyspot cost-report` remains the account (egress, the executor's own times).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

PRICES_ENV = "SKYSPOT_PRICES"


def price_table(environ: Mapping[str, str] = os.environ) -> list[dict[str, Any]]:
    """The prices the task gave this node; [] when it gave none or they do not parse."""
    try:
        table = json.loads(environ.get(PRICES_ENV) or "[]")
    except ValueError:
        return []
    return (
        [row for row in table if isinstance(row, dict) and isinstance(row.get("usd_per_hour"), (int, float))]
        if isinstance(table, list)
        else []
    )


def hourly_price(table: Iterable[Mapping[str, Any]], where: Mapping[str, Any]) -> Optional[float]:
    """Per node: the cheapest row of `where`'s cloud and capacity that agrees with every fact `where`
    knows (instance type, region, accelerators); None when no row does."""
    from skyspot.attempts import UNKNOWN, is_spot

    cloud, spot = str(where.get("cloud") or "").lower(), is_spot(where)

    def agrees(row: Mapping[str, Any], key: str) -> bool:
        known = where.get(key)
        return row.get(key) in (None, "") or known in (None, "", UNKNOWN) or row[key] == known

    rows = [
        float(r["usd_per_hour"])
        for r in table
        if str(r.get("cloud") or "").lower() == cloud
        and bool(r.get("spot")) == spot
        and all(agrees(r, k) for k in ("instance_type", "region", "accelerators"))
    ]
    return min(rows) if rows else None


def where_text(where: Mapping[str, Any]) -> str:
    """`aws us-east-1 (us-east-1a) p5.48xlarge spot x2`: what a dashboard shows at an attempt's start."""
    from skyspot.attempts import UNKNOWN, is_spot

    parts = [str(where.get(k)) for k in ("cloud", "region") if where.get(k) not in (None, "", UNKNOWN)]
    if where.get("zone") not in (None, "", UNKNOWN):
        parts.append(f"({where['zone']})")
    if where.get("instance_type") not in (None, "", UNKNOWN):
        parts.append(str(where["instance_type"]))
    parts.append("spot" if is_spot(where) else "on-demand")
    nodes = where.get("num_nodes")
    if isinstance(nodes, int) and nodes > 1:
        parts.append(f"x{nodes}")
    if where.get("simulated"):
        parts.append("(simulated)")
    return " ".join(parts)


@dataclass
class SpotStory:
    """This attempt's price and the run's past, read once at the attempt's start."""

    attempt: int
    started_at: float
    nodes: int
    usd_per_hour: Optional[float]
    """All nodes of this attempt; None when no price is known (then no cost scalar is drawn)."""
    earlier_usd: Optional[float]
    preemptions: int

    def scalars(self, ts: float) -> dict[str, float]:
        out = {"spot/preemptions": float(self.preemptions), "spot/attempt": float(self.attempt)}
        if self.usd_per_hour is not None and self.earlier_usd is not None:
            out["spot/cost_usd"] = self.earlier_usd + self.usd_per_hour * max(0.0, ts - self.started_at) / 3600
        return out


def story(start: Mapping[str, Any], earlier_events: list[dict], table: list[dict[str, Any]]) -> SpotStory:
    """The story at this attempt's `start` event, from the earlier attempts' events and the price table."""
    from skyspot.attempts import split

    where = start.get("where") if isinstance(start.get("where"), Mapping) else {}
    nodes = _nodes(where)
    price = hourly_price(table, where)
    attempt = int(start.get("attempt") or 0)
    # This start goes in too: an earlier attempt with no record of its end, followed by it, was killed with its node.
    past = [e for e in earlier_events if e.get("attempt") != attempt] + [dict(start, type="start")]
    earlier = [a for a in split(past) if a.number < attempt]
    earlier_usd: Optional[float] = 0.0
    for a in earlier:
        hourly = hourly_price(table, a.where)
        if hourly is None:
            earlier_usd = None  # one unpriced attempt: no honest total
            break
        earlier_usd += (a.end - a.start) / 3600 * hourly * _nodes(a.where)
    return SpotStory(
        attempt=attempt,
        started_at=float(start.get("ts") or 0.0),
        nodes=nodes,
        usd_per_hour=None if price is None else price * nodes,
        earlier_usd=earlier_usd,
        preemptions=sum(1 for a in earlier if a.preempted),
    )


def _nodes(where: Mapping[str, Any]) -> int:
    nodes = where.get("num_nodes")
    return nodes if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes > 0 else 1
