"""Hourly prices of GPU instances on AWS, GCP and Azure, for plans and cost reports.

Two sources, in this order:

1. SkyPilot's own catalog, when it is already cached on this machine
   (`$SKY_RUNTIME_DIR` or `~`, then `.sky/catalogs/v8/<cloud>/vms.csv`). It is what
   SkyPilot's optimizer priced the launch with, so a report agrees with it.
2. The dated snapshot shipped in `skyspot/pricing/pricing_data/` (see SOURCE.md there).

We read SkyPilot's cached file ourselves rather than calling `sky.catalog.get_hourly_cost`:
SkyPilot's lookup re-downloads a cached catalog older than 7 hours and, for AWS, asks STS
(or the instance metadata address) who the caller is in order to map zone IDs to names.
Either would reach the network; a price lookup must never do that. Reading the file also
keeps this module import-light: nothing here imports `sky`.

Every price is a list price per whole instance (one node) per hour. Figures built on them
are estimates, not bills.

Prices SkyPilot would actually pay:

- Zones an account must opt into (AWS Local Zones such as `use1-atl2-az1`, Wavelength zones) never
  price a placement. SkyPilot's AWS catalog keeps only the zones `DescribeAvailabilityZones` returns
  for the account (sky/catalog/aws_catalog.py `_fetch_and_apply_az_mapping`, an inner join on
  sky/catalog/data_fetchers/fetch_aws.py `fetch_availability_zone_mappings`), and that call lists
  opt-in zones only once the account has opted in. Such a zone is used only when asked for by name
  (an attempt that really ran there).
- A missing spot price is reported as missing (`MissingPrice`), never replaced by the on-demand one.

Egress: `egress_price(cloud)` is the published internet-egress list price per GB of each cloud
(`pricing_data/egress_prices.csv`, dated and sourced in SOURCE.md), and `store_cloud(uri)` the
cloud a store URI lives on; planning/candidates.py and cost.py charge traffic between a store and GPUs on
another cloud with them.
"""

from __future__ import annotations

import csv
import datetime as _dt
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from skyspot import clouds
from skyspot.errors import UsageError

SNAPSHOT_DATE = "2026-11-29"
SNAPSHOT_PATH = Path(__file__).with_name("pricing_data") / "gpu_prices.csv"
EGRESS_PATH = Path(__file__).with_name("pricing_data") / "egress_prices.csv"
CLOUDS = clouds.CLOUDS
# Which cloud holds a store, by URI scheme (each cloud's `store_scheme`; skyspot.storage parses the URI).
STORE_CLOUDS = clouds.STORE_CLOUDS

SOURCE_CATALOG = "skypilot-catalog"
SOURCE_SNAPSHOT = "snapshot"

# sky/skylet/constants.py (skypilot 0.14.1): CATALOG_SCHEMA_VERSION = 'v8'; the directory is
# runtime_utils.get_runtime_dir_path('.sky/catalogs/v8'). tests/pricing/test_pricing.py pins the match.
_CATALOG_SCHEMA_VERSION = "v8"
_SKY_RUNTIME_DIR_ENV = "SKY_RUNTIME_DIR"

# Where a cloud's catalog needs a correction (a wrong accelerator count, a spot price that is not one,
# GPUs priced in rows of their own), its class in skyspot/clouds/ says so: `count_fixes`,
# `spot_at_on_demand_is_spot`, `attached_gpus`; which zones need an opt-in: `opt_in_zone`.

_HINT = "`skyspot prices` lists the instances and regions with known prices"


@dataclass(frozen=True)
class Price:
    """The hourly price of one instance (one node), and where the figure came from."""

    usd_per_hour: float
    source: str
    """"skypilot-catalog" (SkyPilot's cached catalog) or "snapshot" (shipped with skyspot)."""
    source_date: str
    """YYYY-MM-DD: the snapshot's date, or the day the cached catalog file was last written."""
    detail: str
    """One line a person can check: instance, spot or on-demand, region and zone, how chosen."""
    cloud: str
    instance_type: str
    region: str
    zone: Optional[str]
    spot: bool


@dataclass(frozen=True)
class _Row:
    instance_type: str  # "" for a GCP GPU row
    accelerator: str
    count: float
    price: Optional[float]
    spot_price: Optional[float]
    region: str
    zone: str
    origin: str


@dataclass(frozen=True)
class _Table:
    cloud: str
    rows: tuple[_Row, ...]
    source: str
    date: str
    location: str


@dataclass(frozen=True)
class _Offer:
    """One instance type in one zone (or region, for Azure) with its full hourly prices."""

    instance_type: str
    region: str
    zone: str
    price: Optional[float]
    spot_price: Optional[float]
    origin: str


@dataclass(frozen=True)
class EgressPrice:
    """A cloud's published price for data leaving it to the internet (first paid tier)."""

    cloud: str
    usd_per_unit: float
    unit: str
    """"GB" (10^9 bytes) or "GiB" (2^30 bytes), as the cloud's pricing page prints it."""
    what: str
    tier: str
    page: str
    as_of: str
    checked: str
    """How the figure was checked (see pricing_data/SOURCE.md)."""

    @property
    def usd_per_byte(self) -> float:
        return self.usd_per_unit / _UNIT_BYTES[self.unit]

    def cost(self, nbytes: float) -> float:
        return nbytes * self.usd_per_byte

    @property
    def label(self) -> str:
        return f"{self.cloud} ${self.usd_per_unit:g}/{self.unit} ({self.as_of})"


_UNIT_BYTES = {"GB": 10**9, "GiB": 2**30}


class MissingPrice(UsageError):
    """The instance is known but has no price of the kind asked for (spot or on-demand): never guessed."""


class _NotFound(Exception):
    """A table cannot price the request; the next table may."""


class _NoPrice(_NotFound):
    """The table knows the instance but lists no price of the kind asked for."""


# --- public API --------------------------------------------------------------------------


def hourly_price(
    cloud: str,
    instance_type: Optional[str] = None,
    accelerator: Optional[str] = None,
    accelerator_count: Optional[int] = None,
    region: Optional[str] = None,
    zone: Optional[str] = None,
    *,
    spot: bool,
    snapshot_only: bool = False,
) -> Price:
    """Price of one `instance_type` node per hour, spot or on-demand.

    Without an instance type, every type that carries the accelerator and count is a choice (AWS
    L40S:1: g6e.xlarge and g6e.2xlarge), and the cheapest of the kind asked for wins, as SkyPilot's
    optimizer chooses: a bigger type's spot price in some zone can undercut the smaller one's.
    Without a region, the cheapest region wins; within a region the cheapest zone wins, as SkyPilot's
    optimizer would choose. A zone the data does not list (AWS VMs report account-specific
    zone names, the catalog lists zone IDs) falls back to the region, and `detail` says so.
    `snapshot_only` ignores SkyPilot's cache, for results that must not depend on the machine
    (the candidate order of a rendered task).
    """
    cloud = _cloud(cloud)
    accelerator, accelerator_count = _split_accelerator(accelerator, accelerator_count)
    failures: list[_NotFound] = []
    for table in _tables(cloud, snapshot_only):
        try:
            names = [instance_type] if instance_type else _instance_types(table, accelerator, accelerator_count)
        except _NotFound as missing:
            failures.append(missing)
            continue
        prices = []
        for name in names:
            try:
                offers = _offers(table, name, _gpu_for(cloud, name, accelerator, accelerator_count))
                prices.append(_cheapest(table, name, offers, region, zone, spot))
            except _NotFound as missing:
                failures.append(missing)
        if prices:
            return min(prices, key=lambda p: (p.usd_per_hour, p.instance_type))
    kind = MissingPrice if isinstance(failures[-1], _NoPrice) else UsageError
    raise kind(f"{failures[-1]}; {_HINT}")


def instance_for(cloud: str, accelerator: str, count: int, *, snapshot_only: bool = False) -> str:
    """The instance type that carries `count` x `accelerator` on `cloud`, e.g. ("aws", "H100", 8) -> "p5.48xlarge".

    Derived from the price rows, not a hand-kept table. Where several types fit (AWS H200 x8:
    p5e and p5en), the one with the lowest on-demand price anywhere wins.
    """
    cloud = _cloud(cloud)
    accelerator, count = _split_accelerator(accelerator, count)
    failures = []
    for table in _tables(cloud, snapshot_only):
        try:
            return _instance_for(table, accelerator, count)
        except _NotFound as missing:
            failures.append(str(missing))
    raise UsageError(f"{failures[-1]}; {_HINT}")


def offered(cloud: str, accelerator: str, count: int) -> Optional[str]:
    """Why `cloud` does not offer `count` x `accelerator`, from the price snapshot; None when it may.

    The snapshot is not every instance of every cloud, so absence alone proves nothing. It does hold,
    for each accelerator and count it lists, that pair's instance types on all three clouds (copied
    by type from SkyPilot's catalog: pricing_data/SOURCE.md). So a pair the snapshot lists on another
    cloud but not on this one is one this cloud lacks (GCP has no A10G, AWS no single A100-80GB); a
    pair it lists nowhere is left to SkyPilot's catalog at launch. Snapshot only, like the plan's order,
    so a rendered task does not depend on the machine.
    """
    cloud = _cloud(cloud)
    accelerator, number = _split_accelerator(accelerator, count)
    if not accelerator or not number:
        return None
    clouds = _offering_clouds(accelerator.lower(), number)
    if not clouds or cloud in clouds:
        return None
    return (
        f"{cloud} offers no {accelerator}:{number:g} instance (the price snapshot lists it on "
        f"{', '.join(sorted(clouds))} only)"
    )


@functools.lru_cache(maxsize=None)
def _offering_clouds(accelerator: str, count: float) -> frozenset:
    """Clouds whose snapshot rows carry `count` x `accelerator` (lower case) on one instance."""
    found = set()
    for cloud in CLOUDS:
        try:
            _instance_for(_snapshot_table(cloud), accelerator, count)
        except _NotFound:
            continue
        found.add(cloud)
    return frozenset(found)


def snapshot_rows(cloud: Optional[str] = None) -> list[dict]:
    """The shipped snapshot as whole-instance prices, one dict per instance type and zone.

    GCP rows are already summed (VM + GPUs in the same zone), so every row is what one
    node costs. Keys: cloud, instance_type, accelerator, accelerator_count, region, zone,
    opt_in_zone (a zone an account must opt into, which never prices a plan), usd_per_hour,
    spot_usd_per_hour (None where the snapshot has no spot price), source_date, source.
    """
    clouds = CLOUDS if cloud is None else (_cloud(cloud),)
    rows = []
    for name in clouds:
        table = _snapshot_table(name)
        types = sorted({r.instance_type for r in table.rows if r.instance_type})
        for instance_type in types:
            attached = _gpu_for(name, instance_type, None, None)
            row = next(r for r in table.rows if r.instance_type == instance_type)
            gpu = attached or (row.accelerator, row.count)
            for offer in _offers(table, instance_type, attached):
                rows.append(
                    {
                        "cloud": name,
                        "instance_type": instance_type,
                        "accelerator": gpu[0],
                        "accelerator_count": int(gpu[1]),
                        "region": offer.region,
                        "zone": offer.zone or None,
                        "opt_in_zone": opt_in_zone(name, offer.zone),
                        "usd_per_hour": offer.price,
                        "spot_usd_per_hour": offer.spot_price,
                        "source_date": table.date,
                        "source": offer.origin,
                    }
                )
    rows.sort(key=lambda r: (r["cloud"], r["instance_type"], r["region"], r["zone"] or ""))
    return rows


def opt_in_zone(cloud: str, zone: Optional[str]) -> bool:
    """True for a zone an account must opt into before it can run there (AWS Local Zones, Wavelength)."""
    found = clouds.find(str(cloud))
    return found is not None and found.opt_in_zone(zone)


def egress_price(cloud: str) -> EgressPrice:
    """`cloud`'s published internet-egress price, first paid tier (pricing_data/egress_prices.csv)."""
    return _egress_table()[_cloud(cloud)]


def store_cloud(store: Optional[str]) -> Optional[str]:
    """The cloud a store URI lives on (s3 -> aws, gs -> gcp, az -> azure); None for a local path or no store."""
    if not store:
        return None
    from skyspot.storage import parse_store_uri

    return STORE_CLOUDS.get(parse_store_uri(store).scheme)


def catalog_path(cloud: str) -> Path:
    """Where SkyPilot caches `cloud`'s catalog on this machine (the file may not exist)."""
    root = os.path.expanduser(os.environ.get(_SKY_RUNTIME_DIR_ENV, "~"))
    return Path(root) / ".sky" / "catalogs" / _CATALOG_SCHEMA_VERSION / _cloud(cloud) / "vms.csv"


# --- tables ------------------------------------------------------------------------------


def _tables(cloud: str, snapshot_only: bool = False) -> list[_Table]:
    """Tables to ask in order: SkyPilot's cached catalog if present, then the snapshot."""
    if snapshot_only:
        return [_snapshot_table(cloud)]
    tables = []
    path = catalog_path(cloud)
    try:
        mtime = path.stat().st_mtime
    except OSError:
        mtime = None
    if mtime is not None:
        tables.append(_catalog_table(cloud, str(path), mtime))
    tables.append(_snapshot_table(cloud))
    return tables


@functools.lru_cache(maxsize=None)
def _snapshot_table(cloud: str) -> _Table:
    with open(SNAPSHOT_PATH, newline="", encoding="utf-8") as f:
        rows = tuple(
            _row(
                cloud,
                r["instance_type"],
                r["accelerator_name"],
                r["accelerator_count"],
                r["price"],
                r["spot_price"],
                r["region"],
                r["zone"],
                r["source"],
            )
            for r in csv.DictReader(f)
            if r["cloud"] == cloud
        )
    return _Table(cloud, rows, SOURCE_SNAPSHOT, SNAPSHOT_DATE, str(SNAPSHOT_PATH))


@functools.lru_cache(maxsize=None)
def _egress_table() -> dict[str, EgressPrice]:
    with open(EGRESS_PATH, newline="", encoding="utf-8") as f:
        rows = {
            r["cloud"]: EgressPrice(
                r["cloud"],
                float(r["usd_per_unit"]),
                r["unit"],
                r["what"],
                r["tier"],
                r["page"],
                r["as_of"],
                r["checked"],
            )
            for r in csv.DictReader(f)
        }
    missing = [c for c in CLOUDS if c not in rows]
    if missing or any(p.unit not in _UNIT_BYTES for p in rows.values()):
        raise ValueError(f"{EGRESS_PATH}: needs one row per cloud in {CLOUDS} with unit GB or GiB")
    return rows


@functools.lru_cache(maxsize=8)
def _catalog_table(cloud: str, path: str, mtime: float) -> _Table:
    """SkyPilot's cached catalog (its own column names); keyed on mtime so a refresh is seen."""
    origin = f"SkyPilot catalog {path}"
    with open(path, newline="", encoding="utf-8") as f:
        rows = tuple(
            _row(
                cloud,
                r.get("InstanceType"),
                r.get("AcceleratorName"),
                r.get("AcceleratorCount"),
                r.get("Price"),
                r.get("SpotPrice"),
                r.get("Region"),
                r.get("AvailabilityZone"),
                origin,
            )
            for r in csv.DictReader(f)
        )
    date = _dt.datetime.fromtimestamp(mtime, _dt.timezone.utc).date().isoformat()
    return _Table(cloud, rows, SOURCE_CATALOG, date, path)


def _row(cloud, instance_type, accelerator, count, price, spot_price, region, zone, origin) -> _Row:
    instance_type = (instance_type or "").strip()
    facts = clouds.get(cloud)
    fixed = facts.count_fixes.get(instance_type.lower())
    price, spot_price = _price(price), _price(spot_price)
    if not facts.spot_at_on_demand_is_spot and spot_price is not None and spot_price == price:
        spot_price = None  # the on-demand price again (skyspot/clouds/azure.py), not a spot price
    return _Row(
        instance_type,
        (accelerator or "").strip(),
        fixed or _number(count) or 0.0,
        price,
        spot_price,
        (region or "").strip(),
        (zone or "").strip(),
        origin,
    )


def _price(text) -> Optional[float]:
    # SkyPilot's Azure fetcher writes 0 for an H100 price Azure's API lacks, "to enable launching"
    # (sky/catalog/data_fetchers/fetch_azure.py): a zero is a missing price, not a free machine.
    value = _number(text)
    return value if value is not None and value > 0 else None


def _number(text) -> Optional[float]:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return None if value != value else value  # NaN, as pandas writes a missing value


# --- lookups -----------------------------------------------------------------------------


def _cloud(cloud: str) -> str:
    name = str(cloud or "").strip().lower()
    if name not in CLOUDS:
        raise UsageError(f"no prices for cloud '{cloud}' (known: {', '.join(CLOUDS)}); {_HINT}")
    return name


def _split_accelerator(accelerator: Optional[str], count) -> tuple[Optional[str], Optional[float]]:
    """Accept "H100:8" as well as ("H100", 8)."""
    if accelerator and ":" in accelerator:
        accelerator, _, text = accelerator.partition(":")
        count = count or _number(text)
    return accelerator, (float(count) if count else None)


def _gpu_for(
    cloud: str, instance_type: str, accelerator: Optional[str], count: Optional[float]
) -> Optional[tuple[str, float]]:
    """Where the cloud prices GPUs in rows of their own (GCP), the GPU rows to add to the VM row; other
    clouds price GPUs inside the VM row."""
    attached = clouds.get(cloud).attached_gpus
    if not attached:
        return None
    if accelerator and count:
        return accelerator, count
    for pattern, name, fixed_count in attached:
        match = pattern.fullmatch(instance_type)
        if match:
            return name, float(fixed_count or match.group(1))
    return None


def _same(a: str, b: str) -> bool:
    return a.lower() == b.lower()


def _offers(table: _Table, instance_type: str, gpu: Optional[tuple[str, float]]) -> list[_Offer]:
    vms = [r for r in table.rows if r.instance_type and _same(r.instance_type, instance_type)]
    if not vms:
        raise _NotFound(f"no price for {table.cloud} instance '{instance_type}' in the {table.source}")
    if gpu is None:
        return [_Offer(r.instance_type, r.region, r.zone, r.price, r.spot_price, r.origin) for r in vms]
    name, count = gpu
    gpus = {
        (r.region, r.zone): r
        for r in table.rows
        if not r.instance_type and _same(r.accelerator, name) and r.count == count
    }
    offers = []
    for vm in vms:
        g = gpus.get((vm.region, vm.zone))
        if g is not None:
            origin = vm.origin if vm.origin == g.origin else f"{vm.origin} + {g.origin}"
            offers.append(
                _Offer(
                    vm.instance_type,
                    vm.region,
                    vm.zone,
                    _add(vm.price, g.price),
                    _add(vm.spot_price, g.spot_price),
                    origin,
                )
            )
    if not offers:
        raise _NotFound(
            f"no zone prices both {table.cloud} '{instance_type}' and its {name} x{count:g} in the {table.source}"
        )
    return offers


def _add(a: Optional[float], b: Optional[float]) -> Optional[float]:
    # Rounded to the catalog's own precision so 3.52301 + 4.48032 reads 8.00333, not 8.003330000000001.
    return None if a is None or b is None else round(a + b, 6)


def _cheapest(
    table: _Table, instance_type: str, offers: list[_Offer], region: Optional[str], zone: Optional[str], spot: bool
) -> Price:
    kind = "spot" if spot else "on-demand"
    how = "cheapest region" if region is None else "cheapest zone in region"
    if region is not None:
        offers = [o for o in offers if _same(o.region, region)]
        if not offers:
            raise _NotFound(f"no price for {table.cloud} '{instance_type}' in region '{region}' in the {table.source}")
    note = ""
    if zone:
        in_zone = [o for o in offers if o.zone and _same(o.zone, zone)]
        if in_zone:
            offers, how = in_zone, "zone as given"
        elif any(o.zone for o in offers):
            note = f"; zone '{zone}' not in the price data, used the cheapest zone"
    if how != "zone as given":
        opted = [o for o in offers if opt_in_zone(table.cloud, o.zone)]
        offers = [o for o in offers if not opt_in_zone(table.cloud, o.zone)]
        if not offers:
            raise _NotFound(
                f"{table.cloud} '{instance_type}'{f' in {region}' if region else ''} is priced only in "
                f"zones an account must opt into ({', '.join(sorted({o.zone for o in opted}))}) "
                f"in the {table.source}"
            )
    priced = [(o.spot_price if spot else o.price, o) for o in offers]
    priced = [(value, o) for value, o in priced if value is not None]
    if not priced:
        raise _NoPrice(
            f"no {kind} price for {table.cloud} '{instance_type}'"
            f"{f' in {region}' if region else ''} in the {table.source}"
        )
    value, best = min(priced, key=lambda p: (p[0], p[1].region, p[1].zone))
    where = best.region + (f" ({best.zone})" if best.zone else "")
    detail = f"{table.cloud} {best.instance_type} {kind} in {where}, {how}{note}; {table.source} {table.date}"
    return Price(
        usd_per_hour=value,
        source=table.source,
        source_date=table.date,
        detail=detail,
        cloud=table.cloud,
        instance_type=best.instance_type,
        region=best.region,
        zone=best.zone or None,
        spot=spot,
    )


def _instance_for(table: _Table, accelerator: Optional[str], count: Optional[float]) -> str:
    """The one type `instance_for` names: the lowest on-demand price anywhere."""
    return min(_instance_types(table, accelerator, count), key=lambda t: (*_lowest_prices(table, t), t))


def _instance_types(table: _Table, accelerator: Optional[str], count: Optional[float]) -> list[str]:
    """Every instance type in `table` that carries `count` x `accelerator`, sorted by name."""
    if not accelerator or not count:
        raise _NotFound(f"need an instance type or an accelerator and count to price {table.cloud}")

    def carries(gpu: Optional[tuple[str, float]]) -> bool:
        return gpu is not None and _same(gpu[0], accelerator) and gpu[1] == count

    if clouds.get(table.cloud).attached_gpus:
        vm_types = {r.instance_type for r in table.rows if r.instance_type}
        types = {t for t in vm_types if carries(_gpu_for(table.cloud, t, None, None))}
    else:
        types = {r.instance_type for r in table.rows if r.instance_type and carries((r.accelerator, r.count))}
    if not types:
        raise _NotFound(f"no {table.cloud} instance with {accelerator}:{count:g} in the {table.source}")
    return sorted(types)


def _lowest_prices(table: _Table, instance_type: str) -> tuple[float, float]:
    """(lowest on-demand, lowest spot) in any zone an account gets without opting in; missing prices sort last."""
    rows = [r for r in table.rows if r.instance_type == instance_type and not opt_in_zone(table.cloud, r.zone)]
    return (_min(r.price for r in rows), _min(r.spot_price for r in rows))


def _min(values: Iterable[Optional[float]]) -> float:
    return min((v for v in values if v is not None), default=float("inf"))
