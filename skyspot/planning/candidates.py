"""Plan: the candidate resources a recipe may land on, in the order SkyPilot should try them.

Candidates are clouds x accelerators (x regions when given) x {spot, on-demand}.
Every spot candidate comes before every on-demand one, and each group is sorted by its
expected cost per hour, cheapest first: the nodes at the price snapshot's list price plus
the internet egress a candidate on another cloud than the store pays for checkpoint
uploads and resume downloads (`egress`, docs/planning.md). So the rendered task's
`resources.ordered` means "cheapest spot anywhere, then cheapest on-demand" (see
docs/architecture.md). A candidate without a price (the snapshot has no spot price for
it) says so in `price_note` and comes after the priced ones of its group.

A pair of cloud and accelerator the cloud does not offer (GCP has no A10G) is no candidate at all
(`dropped` lists them and why: pricing.offered). With `resources.network_tier: best`, each candidate
whose cloud provides a fast fabric for it asks SkyPilot for it (`network_tier`), an Azure ND candidate gets
InfiniBand from its image instead (no `network_tier`: SkyPilot has none on Azure), and the others say why
they go without (`fabric`; clouds.fast_fabric, `Cloud.image_fabric`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Mapping, Optional

from typing import TYPE_CHECKING

from skyspot.errors import UsageError
from skyspot.planning.deadline import CLOUD_RESTART_PRIOR_SECONDS
from skyspot.recipe import Recipe

if TYPE_CHECKING:
    from skyspot.planning.spot_risk import History

RESTART_SECONDS = CLOUD_RESTART_PRIOR_SECONDS
"""A recovery's provisioning, setup, start-up and restore on every node, before anything is measured: the
deadline planner's prior (planning/deadline.py; Can't Be Late, Table 4: 0.2-0.3 h)."""


@dataclass(frozen=True)
class Candidate:
    """One placement SkyPilot may use: a cloud, an accelerator spec, optionally a region, spot or not."""

    cloud: str
    accelerators: Optional[str]  # "H100:8"; None for CPU nodes
    region: Optional[str]
    spot: bool
    instance_type: Optional[str] = None  # from the price snapshot, for display and cost
    usd_per_hour: Optional[float] = None  # per node, estimated from the price snapshot
    price_note: Optional[str] = None
    """Why `usd_per_hour` is None, e.g. "no spot price in snapshot" (never the on-demand price instead)."""
    egress_usd_per_hour: Optional[float] = None
    """Expected internet egress between this candidate and the store, all nodes together (`egress`):
    0.0 on the store's cloud or without a cloud store; None when it cannot be estimated."""
    egress_note: Optional[str] = None
    """What the egress figure leaves out or why it is unknown."""
    expected_usd_per_hour: Optional[float] = None
    """All nodes at `usd_per_hour` plus the egress: what candidates are ordered by; None without a price."""
    network_tier: Optional[str] = None
    """`best` when the recipe asks for the fast fabric and this candidate's cloud provides it (rendered)."""
    fabric: Optional[str] = None
    """The fabric `network_tier: best` gets it (EFA, GPUDirect-TCPX), the one its image gives it without
    network_tier (Azure ND: InfiniBand), or why it goes without."""
    preemptions_per_node_hour: Optional[float] = None
    """Expected preemptions per node-hour (planning/spot_risk.py: the prior blended with the history)."""
    risk_source: Optional[str] = None
    """Where that figure comes from: the prior, the preemptions observed, or both."""
    preemption_usd: Optional[float] = None
    """What one preemption costs, all nodes: the restart (RESTART_SECONDS) and half an interval of lost work."""
    expected_cost_usd_per_hour: Optional[float] = None
    """Per hour of training: `expected_usd_per_hour` plus the expected preemptions' cost (`expected_cost`);
    what candidates are ordered by under `resources.placement: expected_cost`; None without a price."""
    price_rank: Optional[int] = None
    """This candidate's place (1, 2, ...) in the price order, to show where the expected-cost order differs."""

    @property
    def accelerator_name(self) -> Optional[str]:
        return self.accelerators.partition(":")[0] if self.accelerators else None

    @property
    def accelerator_count(self) -> int:
        if not self.accelerators:
            return 0
        return int(self.accelerators.partition(":")[2] or 1)


def region_cloud(region: str) -> str:
    """Which cloud a region name belongs to, by how each cloud spells its regions (`region_pattern`)."""
    from skyspot import clouds

    for cloud in clouds.all():
        if cloud.region_pattern.match(region):
            return cloud.name
    raise UsageError(f"region '{region}' is not an AWS (us-east-1), GCP (us-central1) or Azure (eastus2) region name")


def _priced(candidate: Candidate) -> Candidate:
    """Attach the snapshot's instance type and hourly price, when the snapshot knows the pair: the
    cheapest type carrying the accelerators for the candidate's capacity, as SkyPilot chooses."""
    if not candidate.accelerators:
        return candidate
    from skyspot.pricing import prices as pricing

    try:
        price = pricing.hourly_price(
            candidate.cloud,
            accelerator=candidate.accelerator_name,
            accelerator_count=candidate.accelerator_count,
            region=candidate.region,
            spot=candidate.spot,
            snapshot_only=True,
        )
        return replace(candidate, instance_type=price.instance_type, usd_per_hour=price.usd_per_hour)
    except pricing.MissingPrice:
        note = f"no {'spot' if candidate.spot else 'on-demand'} price in snapshot"
    except UsageError:
        note = "not in snapshot" + (f" for {candidate.region}" if candidate.region else "")
    try:
        instance = pricing.instance_for(
            candidate.cloud, candidate.accelerator_name, candidate.accelerator_count, snapshot_only=True
        )
    except UsageError:  # the snapshot does not cover this pair; SkyPilot's catalog will decide
        return replace(candidate, price_note="not in snapshot")
    return replace(candidate, instance_type=instance, price_note=note)


# =========================================================================== egress


@dataclass(frozen=True)
class Egress:
    """Expected internet traffic between one candidate and the store per hour, all nodes together.

    Uploads leave the candidate's cloud (its egress price); resume downloads leave the store's cloud
    (the store's egress price). Zero on the store's own cloud: inter-region traffic is not counted.
    """

    usd_per_hour: Optional[float]
    """None when the checkpoint size is unknown."""
    upload_bytes_per_hour: Optional[float]
    """None when the interval is in steps only (the step time is unknown before the run)."""
    download_bytes_per_hour: float
    note: str = ""


def egress(
    recipe: Recipe,
    cloud: str,
    *,
    spot: bool,
    accelerator: Optional[str] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Egress:
    """What a candidate on `cloud` is expected to pay per hour for traffic to and from the recipe's store.

    - uploads: one checkpoint (`sizing.state_bytes(...).checkpoint_bytes`, every node's part) per
      checkpoint interval: `checkpoint.every_seconds`, or the planner's initial interval for `auto`.
      With `every_steps` as well, checkpoints may come more often: this is then a floor.
    - resume downloads (spot only): the same bytes once per expected preemption of the job, at
      `checkpoint.mtbp_prior_seconds` or the cloud's prior (`clouds.mtbp_prior`).
    """
    from skyspot import clouds, sizing
    from skyspot.pricing import prices as pricing

    environ = os.environ if environ is None else environ
    store = pricing.store_cloud(recipe.storage.store)
    if store is None or store == cloud:
        return Egress(0.0, 0.0, 0.0, "" if store is None else "store's cloud")
    state = sizing.state_bytes(recipe, environ=environ)
    if state.checkpoint_bytes is None:
        return Egress(None, None, 0.0, "egress unknown: checkpoint size unknown")
    interval = _interval_s(recipe, cloud, environ)
    note = ""
    if interval is not None:
        upload: Optional[float] = state.checkpoint_bytes * 3600 / interval
    elif recipe.checkpoint.every_steps:
        upload, note = None, "uploads not counted: interval in steps"
    else:
        upload = 0.0  # no interval checkpoints: only the final one
    download = 0.0
    if spot:
        mtbp = (
            recipe.checkpoint.mtbp_prior_seconds
            or clouds.mtbp_prior(cloud, accelerator, recipe.resources.num_nodes).job_s
        )
        download = state.checkpoint_bytes * 3600 / mtbp
    usd = pricing.egress_price(cloud).cost(upload or 0.0) + pricing.egress_price(store).cost(download)
    return Egress(usd, upload, download, note)


def _interval_s(recipe: Recipe, cloud: str, environ: Mapping[str, str]) -> Optional[float]:
    """Seconds between interval checkpoints, when the recipe gives them in seconds (or `auto`)."""
    from skyspot.trainer.interval import initial_plan  # the interval the trainer will start with

    every = recipe.checkpoint.every_seconds
    if every == "auto":
        plan = initial_plan(recipe, cloud, environ=environ)
        return plan.every_seconds if plan else None
    return float(every) if every else None


def egress_basis(recipe: Recipe, *, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """One line saying what the egress column of a plan assumes; None without a cloud store."""
    from skyspot.pricing import prices as pricing
    from skyspot import sizing

    store = pricing.store_cloud(recipe.storage.store)
    if store is None:
        return None
    state = sizing.state_bytes(recipe, environ=environ)
    size = "unknown" if state.checkpoint_bytes is None else f"{state.checkpoint_bytes / 1e9:,.1f} GB"
    ckpt = recipe.checkpoint
    every = ckpt.every_seconds
    interval = (
        "at the planned interval (auto)"
        if every == "auto"
        else f"every {every:g} s"
        if every
        else f"every {ckpt.every_steps} steps (not counted: step time unknown)"
        if ckpt.every_steps
        else "at the end only"
    )
    if every and ckpt.every_steps:
        interval += f" (every_steps={ckpt.every_steps} may add more, not counted)"
    prices = ", ".join(pricing.egress_price(c).label for c in pricing.CLOUDS)
    return (
        f"egress: the store is on {store}. A candidate on another cloud uploads each checkpoint ({size}) "
        f"{interval}; on spot it also downloads one after each expected preemption (planning prior). "
        f"Internet egress, first paid tier: {prices}. Traffic between regions of {store} is not counted."
    )


def _expected(candidate: Candidate, recipe: Recipe, environ: Optional[Mapping[str, str]]) -> Candidate:
    traffic = egress(recipe, candidate.cloud, spot=candidate.spot, accelerator=candidate.accelerators, environ=environ)
    total = None
    if candidate.usd_per_hour is not None:
        total = candidate.usd_per_hour * recipe.resources.num_nodes + (traffic.usd_per_hour or 0.0)
    return replace(
        candidate,
        egress_usd_per_hour=traffic.usd_per_hour,
        egress_note=traffic.note or None,
        expected_usd_per_hour=total,
    )


def expected_cost(
    candidate: Candidate, recipe: Recipe, history: Optional["History"], environ: Optional[Mapping[str, str]]
) -> Candidate:
    """The candidate's risk and expected cost per hour of training (docs/reliability.md, "Placement by
    expected cost"): price x hours + expected preemptions x (restart + lost work), egress included.

    Per hour of training, the job (ZeRO-3: any node lost stops it) expects rate x nodes preemptions; each
    pays every node for the restart (RESTART_SECONDS: provisioning, setup, start-up and restore, the planner's
    prior before anything is measured) and for half a checkpoint interval of lost work. The run's hours
    multiply every term alike, so the order per hour is the order per run."""
    from skyspot.planning.spot_risk import rate_for

    risk = rate_for(
        history,
        candidate.cloud,
        region=candidate.region,
        instance_type=candidate.instance_type,
        spot=candidate.spot,
        accelerator=candidate.accelerators,
    )
    found = replace(candidate, preemptions_per_node_hour=risk.per_node_hour, risk_source=risk.source)
    if candidate.usd_per_hour is None or candidate.expected_usd_per_hour is None:
        return found
    nodes = recipe.resources.num_nodes
    interval = _interval_s(recipe, candidate.cloud, os.environ if environ is None else environ)
    lost_s = (interval or 0.0) / 2
    per_preemption = candidate.usd_per_hour * nodes * (RESTART_SECONDS + lost_s) / 3600
    overhead = risk.per_node_hour * nodes * per_preemption
    return replace(
        found, preemption_usd=per_preemption, expected_cost_usd_per_hour=candidate.expected_usd_per_hour + overhead
    )


def candidates(
    recipe: Recipe,
    *,
    with_prices: bool = True,
    environ: Optional[Mapping[str, str]] = None,
    history: Optional["History"] = None,
) -> list[Candidate]:
    """Every candidate placement for the recipe: spot first, then on-demand; each group ordered, cheapest
    first and unpriced last, by expected cost per hour of training (`resources.placement: expected_cost`,
    the default: price, egress and what the expected preemptions cost, from `history`, the prior alone
    when None) or by price (`placement: price`: nodes + egress to and from the store)."""
    resources = recipe.resources
    regions_by_cloud: dict[str, list[Optional[str]]] = {}
    for region in resources.regions:
        cloud = region_cloud(region)
        if cloud not in resources.clouds:
            raise UsageError(
                f"region '{region}' belongs to {cloud}, which is not in resources.clouds "
                f"({', '.join(resources.clouds)})"
            )
        regions_by_cloud.setdefault(cloud, []).append(region)
    modes = ([True] if resources.spot else []) + ([False] if resources.on_demand_fallback or not resources.spot else [])
    accelerators: list[Optional[str]] = list(resources.accelerators) or [None]

    planned: list[Candidate] = []
    for spot in modes:
        group = []
        for cloud in resources.clouds:
            cloud_regions = regions_by_cloud.get(cloud, [None] if not resources.regions else [])
            for accelerator in accelerators:
                if accelerator and _lacks(cloud, accelerator):
                    continue  # `dropped` says which and why
                for region in cloud_regions:
                    candidate = Candidate(cloud, accelerator, region, spot)
                    if with_prices:
                        candidate = _expected(_priced(candidate), recipe, environ)
                    group.append(_with_fabric(candidate, recipe))
        # Stable sort: unpriced candidates keep recipe order after the priced ones.
        group.sort(key=lambda c: (c.expected_usd_per_hour is None, c.expected_usd_per_hour or 0.0))
        if with_prices:
            group = [
                expected_cost(replace(c, price_rank=len(planned) + i), recipe, history, environ)
                for i, c in enumerate(group, 1)
            ]
            if recipe.resources.placement == "expected_cost":
                group.sort(key=lambda c: (c.expected_cost_usd_per_hour is None, c.expected_cost_usd_per_hour or 0.0))
        planned.extend(group)
    if not planned:
        raise UsageError("no candidate resources: resources.regions names no region of resources.clouds")
    return planned


def dropped(recipe: Recipe) -> list[tuple[str, str, str]]:
    """(cloud, accelerators, why) for each pair of resources.clouds x resources.accelerators the plan
    leaves out because that cloud does not offer the accelerator (pricing.offered)."""
    out = []
    for cloud in recipe.resources.clouds:
        for accelerator in recipe.resources.accelerators:
            why = _lacks(cloud, accelerator)
            if why:
                out.append((cloud, accelerator, why))
    return out


def _lacks(cloud: str, accelerator: str) -> Optional[str]:
    from skyspot.pricing import prices as pricing

    name, _, count = accelerator.partition(":")
    return pricing.offered(cloud, name, int(count or 1))


def _with_fabric(candidate: Candidate, recipe: Recipe) -> Candidate:
    """Ask for `network_tier: best` only where SkyPilot provides a fabric for it (clouds.fast_fabric):
    on Azure the request alone makes SkyPilot's optimizer drop the candidate. A candidate whose fabric comes
    with its image instead (Azure ND: the HPC image, task/render.py) says so; the rest say why they go without."""
    if recipe.resources.network_tier != "best":
        return candidate
    from skyspot import clouds

    fabric, why_not = clouds.fast_fabric(candidate.cloud, candidate.accelerators)
    if fabric is not None:
        return replace(candidate, network_tier="best", fabric=fabric)
    from_image = clouds.get(candidate.cloud).image_fabric(candidate.instance_type)
    return replace(candidate, fabric=from_image or f"no fast fabric: {why_not}")
