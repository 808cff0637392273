"""Plan: the candidate resources a recipe may land on, in the order SkyPilot should try them.

Candidates are clouds x accelerators (x regions when given) x {spot, on-demand}.
Every spot candidate comes before every on-demand one, and each group is sorted by
the price snapshot (cheapest first), so the rendered task's `resources.ordered`
means "cheapest spot anywhere, then cheapest on-demand" (see docs/architecture.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from skyspot.errors import UsageError
from skyspot.recipe import Recipe

# Region names by cloud, as the clouds spell them: us-east-1 (AWS), us-central1 (GCP), eastus2 (Azure).
_REGION_PATTERNS = {
    "aws": re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d+$"),
    "gcp": re.compile(r"^[a-z]+-[a-z]+\d+$"),
    "azure": re.compile(r"^[a-z]+\d*$"),
}


@dataclass(frozen=True)
class Candidate:
    """One placement SkyPilot may use: a cloud, an accelerator spec, optionally a region, spot or not."""

    cloud: str
    accelerators: Optional[str]  # "H100:8"; None for CPU nodes
    region: Optional[str]
    spot: bool
    instance_type: Optional[str] = None  # from the price snapshot, for display and cost
    usd_per_hour: Optional[float] = None  # per node, estimated from the price snapshot

    @property
    def accelerator_name(self) -> Optional[str]:
        return self.accelerators.partition(":")[0] if self.accelerators else None

    @property
    def accelerator_count(self) -> int:
        if not self.accelerators:
            return 0
        return int(self.accelerators.partition(":")[2] or 1)


def region_cloud(region: str) -> str:
    """Which cloud a region name belongs to."""
    for cloud, pattern in _REGION_PATTERNS.items():
        if pattern.match(region):
            return cloud
    raise UsageError(f"region '{region}' is not an AWS (us-east-1), GCP (us-central1) or Azure (eastus2) region name")


def _priced(candidate: Candidate) -> Candidate:
    """Attach the snapshot's instance type and hourly price, when the snapshot knows the pair."""
    if not candidate.accelerators:
        return candidate
    from skyspot import pricing

    try:
        instance = pricing.instance_for(candidate.cloud, candidate.accelerator_name, candidate.accelerator_count,
                                        snapshot_only=True)
    except UsageError:  # the snapshot does not cover this pair; SkyPilot's catalog will decide
        return candidate
    if not instance:
        return candidate
    try:
        price = pricing.hourly_price(candidate.cloud, instance_type=instance, accelerator=candidate.accelerator_name,
                                     accelerator_count=candidate.accelerator_count, region=candidate.region,
                                     spot=candidate.spot, snapshot_only=True)
        usd = price.usd_per_hour
    except UsageError:
        usd = None
    return Candidate(candidate.cloud, candidate.accelerators, candidate.region, candidate.spot, instance, usd)


def candidates(recipe: Recipe, *, with_prices: bool = True) -> list[Candidate]:
    """Every candidate placement for the recipe: spot first, then on-demand; cheapest first within each."""
    resources = recipe.resources
    regions_by_cloud: dict[str, list[Optional[str]]] = {}
    for region in resources.regions:
        cloud = region_cloud(region)
        if cloud not in resources.clouds:
            raise UsageError(f"region '{region}' belongs to {cloud}, which is not in resources.clouds "
                             f"({', '.join(resources.clouds)})")
        regions_by_cloud.setdefault(cloud, []).append(region)
    modes = ([True] if resources.spot else []) + ([False] if resources.on_demand_fallback or not resources.spot else [])
    accelerators: list[Optional[str]] = list(resources.accelerators) or [None]

    planned: list[Candidate] = []
    for spot in modes:
        group = []
        for cloud in resources.clouds:
            cloud_regions = regions_by_cloud.get(cloud, [None] if not resources.regions else [])
            for accelerator in accelerators:
                for region in cloud_regions:
                    candidate = Candidate(cloud, accelerator, region, spot)
                    group.append(_priced(candidate) if with_prices else candidate)
        # Stable sort: unpriced candidates keep recipe order after the priced ones.
        group.sort(key=lambda c: (c.usd_per_hour is None, c.usd_per_hour or 0.0))
        planned.extend(group)
    if not planned:
        raise UsageError("no candidate resources: resources.regions names no region of resources.clouds")
    return planned
