"""What the clouds publish about how often spot capacity is taken away, as a weight on our prior.

    found = signal_for("aws", "us-east-1", "p5.48xlarge")
    found.multiplier, found.text()      # 1.83, "x 1.8 (AWS Spot Advisor '>20%' for p5.48xlarge in us-east-1 ...)"
    signal_for("azure", "eastus", "Standard_ND96amsr_A100_v4").why   # none published, and why

The shipped snapshot is `pricing/pricing_data/spot_signals.csv` (its SOURCE.md section says where each
row comes from): AWS's Spot Instance Advisor feed, Linux, every region the feed has for the instance
types the price snapshot knows, as vendored on FEED_DATE.

- What AWS's bucket means: "Frequency of interruption represents the rate at which Spot has reclaimed
  capacity during the trailing month", in ranges <5 %, 5-10 %, 10-15 %, 15-20 %, >20 % (the Advisor
  page's wording, as quoted by grailbio/base `cloud/spotadvisor`). A share of capacity over a month is
  not a rate per node-hour, a long-running multi-node GPU job is not the average instance that share
  describes, and the top bucket is open-ended. So the bucket is read as a *relative* signal: how this
  region compares with the other regions of the same instance type.
- The weight: ratio = the bucket's midpoint (2.5, 7.5, 12.5, 17.5, 25 %) / the median midpoint of that
  type over the feed's regions, clamped to [1/4, 4]; multiplier = ratio ** WEIGHT (1/2), so at most x2
  and at least x0.5. Light on purpose: the feed is a monthly summary vendored once, and its buckets move
  a lot between copies (p5.48xlarge in us-east-1: '>20%' on 2025-06-28, '<5%' in a copy of about
  2026-08), so it only nudges the prior, and this machine's own preemptions soon outweigh it.
- Where it goes: planning/spot_risk.py scales the prior's rate by the multiplier and then blends in the
  preemption history as before (one pseudo-preemption in prior-hours / multiplier), so a handful of
  observed preemptions still overrides it.
- A candidate with no region (SkyPilot picks the cheapest region) gets the type's median: multiplier 1,
  with the regions at the bottom and top of the type's range named.
- Not published: Azure shows eviction-rate buckets per size and region, but only through an
  authenticated Azure Resource Graph query (SpotResources), so none is shipped; GCP publishes no
  per-type rate for Spot VMs. Their candidates keep the prior alone and say so.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional, Union

FEED = "AWS Spot Advisor"
FEED_DATE = "2025-06-28"
"""The date of the spotinfo commit that vendored the feed (the feed itself carries no date)."""
FEED_SOURCE = (
    "https://spot-bid-advisor.s3.amazonaws.com/spot-advisor-data.json as vendored in github:alexei-led/spotinfo "
    "internal/spot/data/spot-advisor-data.json @5eedf20a99614443af215f4aaf09bd10805cac72"
)
LABELS = ("<5%", "5-10%", "10-15%", "15-20%", ">20%")
"""The feed's `ranges`, by index (its `r` field)."""
MIDPOINTS = (2.5, 7.5, 12.5, 17.5, 25.0)
"""Each bucket's midpoint in percent; the open-ended top bucket is read as 25 %."""
CLAMP = (0.25, 4.0)
WEIGHT = 0.5
"""The exponent on the clamped ratio: the published signal moves the prior at most x2 either way."""
NAMED = 3
"""How many regions the any-region text names at each end."""


SIGNALS_PATH = Path(__file__).resolve().parents[1] / "pricing" / "pricing_data" / "spot_signals.csv"


@dataclass(frozen=True)
class Signal:
    """A published signal for one candidate and the multiplier it puts on the prior."""

    cloud: str
    instance_type: str
    region: Optional[str]
    """None: any region, the type's median."""
    label: Optional[str]
    """The region's bucket as published ("<5%"); None for any region."""
    bucket: Optional[int]
    ratio: float
    """The bucket's midpoint / the type's median midpoint, clamped to CLAMP (1 for any region)."""
    multiplier: float
    median_pct: float
    """The median bucket midpoint of the type over the feed's regions, percent."""
    regions: int
    """How many regions the feed has for the type."""
    lowest: tuple[str, ...] = ()
    """For any region: the regions in the type's lowest bucket (and `low_label`)."""
    low_label: str = ""
    highest: tuple[str, ...] = ()
    high_label: str = ""
    date: str = FEED_DATE
    source: str = FEED_SOURCE

    def text(self) -> str:
        """The signal as the risk's source says it."""
        if self.region is not None:
            return (
                f"x {self.multiplier:.2g} ({FEED} '{self.label}' for {self.instance_type} in {self.region} vs a median "
                f"{self.median_pct:g}% over its {self.regions} regions; feed of {self.date})"
            )
        return (
            f"x 1 ({FEED}, any region: {self.instance_type}'s median of {self.regions} regions; "
            f"lowest '{self.low_label}' in {_names(self.lowest)}, highest '{self.high_label}' in {_names(self.highest)}; "
            f"feed of {self.date})"
        )


@dataclass(frozen=True)
class NoSignal:
    """Nothing published for a candidate, and why."""

    why: str
    multiplier: float = 1.0

    def text(self) -> str:
        return f"no published signal: {self.why}"


Published = Union[Signal, NoSignal]


def signal_for(cloud: str, region: Optional[str], instance_type: Optional[str]) -> Published:
    """The published signal for a spot candidate (module docstring), or NoSignal saying why there is none."""
    from skyspot import clouds

    cloud = str(cloud).lower()
    facts = clouds.find(cloud)
    if facts is None:
        return NoSignal(f"none known for cloud '{cloud}'")
    if facts.spot_signal != FEED:
        return NoSignal(facts.spot_signal_missing or f"none shipped for {facts.label}")
    if not instance_type:
        return NoSignal("no instance type to look up")
    by_region = _snapshot().get(instance_type)
    if not by_region:
        return NoSignal(f"{instance_type} is not in the {FEED} feed of {FEED_DATE}")
    median = _median([MIDPOINTS[b] for b in by_region.values()])
    if region is None:
        low, high = min(by_region.values()), max(by_region.values())
        return Signal(
            cloud,
            instance_type,
            region=None,
            label=None,
            bucket=None,
            ratio=1.0,
            multiplier=1.0,
            median_pct=median,
            regions=len(by_region),
            lowest=tuple(sorted(r for r, b in by_region.items() if b == low)),
            low_label=LABELS[low],
            highest=tuple(sorted(r for r, b in by_region.items() if b == high)),
            high_label=LABELS[high],
        )
    if region not in by_region:
        return NoSignal(f"the {FEED} feed of {FEED_DATE} has no {instance_type} in {region}")
    bucket = by_region[region]
    ratio = ratio_of(bucket, median)
    return Signal(
        cloud,
        instance_type,
        region=region,
        label=LABELS[bucket],
        bucket=bucket,
        ratio=ratio,
        multiplier=ratio**WEIGHT,
        median_pct=median,
        regions=len(by_region),
    )


def ratio_of(bucket: int, median_pct: float) -> float:
    """The clamped ratio of a bucket's midpoint to the type's median midpoint (before WEIGHT)."""
    low, high = CLAMP
    return min(high, max(low, MIDPOINTS[bucket] / median_pct))


def regions(instance_type: str) -> dict[str, int]:
    """Every region the feed has for `instance_type`, with its bucket (empty when the feed lacks the type)."""
    return dict(_snapshot().get(instance_type, {}))


@lru_cache(maxsize=1)
def _snapshot() -> dict[str, dict[str, int]]:
    """instance type -> region -> bucket, from the shipped CSV (AWS rows only)."""
    from skyspot import clouds

    feed_clouds = {c.name for c in clouds.all() if c.spot_signal == FEED}
    found: dict[str, dict[str, int]] = {}
    with SIGNALS_PATH.open(newline="") as handle:
        for row in csv.DictReader(handle):
            bucket = int(row["bucket"])
            if row["cloud"] not in feed_clouds or not 0 <= bucket < len(LABELS) or row["label"] != LABELS[bucket]:
                raise ValueError(f"{SIGNALS_PATH}: a row that is not the feed's: {row}")
            found.setdefault(row["instance_type"], {})[row["region"]] = bucket
    return found


def _median(values: list[float]) -> float:
    """The median (the mean of the two middle values for an even count); `statistics` costs 4 ms to import."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _names(regions: tuple[str, ...]) -> str:
    shown = ", ".join(regions[:NAMED])
    return shown + (f" +{len(regions) - NAMED} more" if len(regions) > NAMED else "")
