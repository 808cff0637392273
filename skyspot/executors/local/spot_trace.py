"""Spot traces: a file of preemption times the local executor replays.

Format (YAML; see `traces/example.yaml` and docs/local.md):

    # seconds since the run was launched at which the cloud sends a preemption notice
    preemptions: [45, 120, 200]
    # optional: the notice window in seconds for this trace (else --notice), its cloud's timeline scaled to fit (docs/local.md)
    notice: 30
    # optional: after this many preemptions spot capacity is gone; later attempts run on-demand
    capacity_gone_after: 3
    # optional: spot nodes granted to each attempt in turn (the last repeats); below the recipe's
    # resources.num_nodes the trainer resumes at the smaller world size (needs resources.min_nodes)
    nodes: [2, 1, 2]
    # optional: spot capacity outages [start, end): a notice at the start takes a spot instance
    # running then, and no spot can be had until the end
    unavailable: [[300, 900], [1500, 1560]]
    # optional, instead of the top-level preemptions and unavailable: places of the simulated cloud,
    # each "cloud/region/zone" with its own preemptions and outages (executors/local/zones.py places
    # every spot attempt in one of them)
    zones:
      aws/us-east-1/us-east-1a: {preemptions: [40, 100, 160]}
      aws/us-east-2/us-east-2a: {preemptions: [], unavailable: [[600, 700]]}

Times count wall-clock from the launch, as a cloud's interruption log would. A notice
that falls while the run is between attempts (provisioning) is delivered to the next
attempt at once, as a cloud would preempt a freshly granted instance. `available` and
`losses` are what a trace means for capacity, for the local executor and the deadline
simulator (skyspot/planning/deadline.py) alike.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from skyspot import yaml12
from skyspot.errors import UsageError


@dataclass(frozen=True)
class Zone:
    """One place of a zoned trace: its own preemption times and spot outages, seconds since launch."""

    cloud: str
    region: str
    zone: str
    preemptions: tuple[float, ...] = ()
    unavailable: tuple[tuple[float, float], ...] = ()

    @property
    def key(self) -> str:
        return f"{self.cloud}/{self.region}/{self.zone}"

    def available(self, t: float) -> bool:
        return not any(start <= t < end for start, end in self.unavailable)

    def losses(self) -> list[float]:
        """Every moment a spot instance running here then is taken: preemptions and outage starts."""
        return sorted([*self.preemptions, *(start for start, _ in self.unavailable)])

    def as_dict(self) -> dict:
        return {
            "cloud": self.cloud,
            "region": self.region,
            "zone": self.zone,
            "preemptions": list(self.preemptions),
            "unavailable": [list(w) for w in self.unavailable],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Zone":
        return cls(
            str(d["cloud"]),
            str(d["region"]),
            str(d["zone"]),
            tuple(float(t) for t in d.get("preemptions") or []),
            tuple((float(a), float(b)) for a, b in d.get("unavailable") or []),
        )


@dataclass
class SpotTrace:
    preemptions: list[float] = field(default_factory=list)
    notice: Optional[float] = None
    capacity_gone_after: Optional[int] = None
    nodes: list[int] = field(default_factory=list)
    unavailable: list[tuple[float, float]] = field(default_factory=list)
    """Spot outages [start, end), seconds since launch, sorted and disjoint."""
    zones: list[Zone] = field(default_factory=list)
    """A zoned trace's places, in the trace's order (then `preemptions` and `unavailable` are empty)."""

    def available(self, t: float, preemptions: int = 0) -> bool:
        """Whether spot capacity can be had `t` seconds after launch, after `preemptions` so far (a zoned
        trace: in any of its zones)."""
        if self.capacity_gone_after is not None and preemptions >= self.capacity_gone_after:
            return False
        if self.zones:
            return any(zone.available(t) for zone in self.zones)
        return not any(start <= t < end for start, end in self.unavailable)

    def losses(self) -> list[float]:
        """Every moment a spot instance running then is taken: preemptions and outage starts."""
        return sorted([*self.preemptions, *(start for start, _ in self.unavailable)])

    @classmethod
    def from_spec(cls, spec) -> "SpotTrace":
        """The trace a local run's spec carries (a Spec or its local.json as a dict): the one way the
        controller, its deadline planner and the cost report's comparison rebuild what the run replayed."""
        get = spec.get if isinstance(spec, dict) else lambda key: getattr(spec, key, None)
        return cls(
            preemptions=[float(t) for t in get("trace_times") or []],
            capacity_gone_after=get("capacity_gone_after"),
            unavailable=[(float(a), float(b)) for a, b in get("unavailable") or []],
            zones=[Zone.from_dict(z) for z in get("zones") or []],
        )

    @classmethod
    def load(cls, path: str | Path) -> "SpotTrace":
        from skyspot.events import read_regular

        path = Path(path)
        if not path.exists():
            raise UsageError(f"cannot read spot trace '{path}': No such file or directory")
        # A regular file only (a FIFO would hang the read, /dev/zero never end it), and a small one.
        raw = read_regular(path, limit=MAX_TRACE_BYTES)
        if raw is None:
            raise UsageError(f"cannot read spot trace '{path}': not a readable regular file")
        if len(raw) > MAX_TRACE_BYTES:
            raise UsageError(f"spot trace '{path}' is larger than {MAX_TRACE_BYTES // 1024} KiB: not a trace")
        try:
            data = yaml12.load(raw.decode("utf-8", errors="replace"))  # the recipes' number grammar
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else str(path)
            raise UsageError(f"{where}: malformed spot trace YAML") from None
        if not isinstance(data, dict):
            raise UsageError(f"{path}: a spot trace is a mapping with a 'preemptions' list (see docs/local.md)")
        unknown = set(data) - {"preemptions", "notice", "capacity_gone_after", "nodes", "unavailable", "zones"}
        if unknown:
            raise UsageError(
                f"{path}: unknown spot trace key(s) {', '.join(sorted(unknown))} "
                "(known: preemptions, notice, capacity_gone_after, nodes, unavailable, zones)"
            )
        zones = _zones(path, data["zones"]) if "zones" in data else []
        if zones:
            both = sorted({"preemptions", "unavailable", "capacity_gone_after"} & set(data))
            if both:
                raise UsageError(
                    f"{path}: a zoned trace gives each zone its own preemptions and outages; move "
                    f"{', '.join(both)} into the zones"
                )
        times = data.get("preemptions") or []
        if not isinstance(times, list) or not all(_seconds(t) for t in times):
            raise UsageError(f"{path}: 'preemptions' must be a list of finite seconds >= 0")
        notice = data.get("notice")
        if notice is not None and not _seconds(notice):
            raise UsageError(f"{path}: 'notice' must be finite seconds >= 0")
        gone = data.get("capacity_gone_after")
        if gone is not None and (not isinstance(gone, int) or gone < 0):
            raise UsageError(f"{path}: 'capacity_gone_after' must be a whole number >= 0")
        nodes = data.get("nodes") or []
        if not isinstance(nodes, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in nodes
        ):
            raise UsageError(f"{path}: 'nodes' must be a list of node counts >= 1 (one per spot attempt)")
        return cls(
            sorted(float(t) for t in times),
            None if notice is None else float(notice),
            gone,
            nodes,
            _windows(path, data.get("unavailable") or []),
            zones,
        )


MAX_TRACE_BYTES = 1 << 20
"""A spot trace is a few lines; a bigger file is refused before it is parsed."""


def _seconds(v) -> bool:
    """A time in a trace: a finite number >= 0 (YAML's .inf and .nan are numbers too), never a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


MAX_ZONES = 64
_PART = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def _zones(path: Path, raw) -> list[Zone]:
    """A zoned trace's `zones`: "cloud/region/zone" -> {preemptions, unavailable}, each place once."""
    from skyspot import clouds

    if not isinstance(raw, dict) or not raw:
        raise UsageError(f"{path}: 'zones' must map 'cloud/region/zone' to that zone's preemptions and outages")
    if len(raw) > MAX_ZONES:
        raise UsageError(f"{path}: {len(raw)} zones; a trace has at most {MAX_ZONES}")
    zones = []
    for key, entry in raw.items():
        parts = str(key).split("/")
        if len(parts) != 3 or not all(_PART.match(p) for p in parts):
            raise UsageError(f"{path}: zone '{key}' must be cloud/region/zone, e.g. aws/us-east-1/us-east-1a")
        cloud, region, zone = parts
        if cloud not in clouds.names():
            raise UsageError(f"{path}: zone '{key}': '{cloud}' is not one of {', '.join(clouds.names())}")
        if not clouds.get(cloud).region_pattern.match(region):
            raise UsageError(f"{path}: zone '{key}': '{region}' is not a {clouds.get(cloud).label} region name")
        entry = {} if entry is None else entry
        if not isinstance(entry, dict) or set(entry) - {"preemptions", "unavailable"}:
            raise UsageError(f"{path}: zone '{key}' takes 'preemptions' and 'unavailable' only")
        times = entry.get("preemptions") or []
        if not isinstance(times, list) or not all(_seconds(t) for t in times):
            raise UsageError(f"{path}: zone '{key}': 'preemptions' must be a list of finite seconds >= 0")
        windows = _windows(path, entry.get("unavailable") or [], what=f"zone '{key}': 'unavailable'")
        zones.append(Zone(cloud, region, zone, tuple(sorted(float(t) for t in times)), tuple(windows)))
    return zones


def _windows(path: Path, raw, what: str = "'unavailable'") -> list[tuple[float, float]]:
    number = _seconds

    if not isinstance(raw, list) or not all(
        isinstance(w, list) and len(w) == 2 and all(map(number, w)) and w[0] < w[1] for w in raw
    ):
        raise UsageError(f"{path}: {what} must be a list of [start, end] pairs of seconds, 0 <= start < end")
    windows = sorted((float(a), float(b)) for a, b in raw)
    for (_, end), (start, _) in zip(windows, windows[1:]):
        if start < end:
            raise UsageError(f"{path}: {what} windows overlap at {start:g}s; merge them")
    return windows
