"""What the rehearsals found, kept in `$SKYSPOT_HOME/rehearsals.json`, keyed by (cloud, image, accelerators).

`skyspot launch RECIPE --rehearse` (app/rehearse.py) writes one entry per rehearsed candidate; every later
launch (app/launch.py prepare) reads them and leaves out each candidate whose last rehearsal failed, unless
`--force`, and its dry run says so. A candidate's image is the one its rendered `resources.ordered` entry asks
for (`image_id`), or `default`: SkyPilot's default image for that cloud and accelerator. The newest rehearsal
of a key is the one that counts: a later success brings the candidate back.

The file is small JSON, 0600, written whole and atomically (a temporary file renamed over it), so a reader
never sees half of it; a damaged file reads as no rehearsals, never as an error that blocks a launch.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from skyspot.ledger import skyspot_home

FILE = "rehearsals.json"
DEFAULT_IMAGE = "default"


@dataclass(frozen=True)
class Key:
    """What a rehearsal proves: a cloud's image with an accelerator (setup, the driver's torch line, the fabric)."""

    cloud: str
    image: str
    accelerators: str
    """`H100:8`, or `CPU` for a CPU-only recipe."""

    def text(self) -> str:
        return f"{self.cloud}/{self.image}/{self.accelerators}"


@dataclass(frozen=True)
class Record:
    """One rehearsal's outcome."""

    cloud: str
    image: str
    accelerators: str
    at: float
    """Unix time the rehearsal ended."""
    ok: bool
    line: str
    """`works`, or what failed, in one line."""
    minutes: float
    cost_usd: Optional[float]
    run: str
    """The rehearsal's run name (its row in the ledger, its logs: `skyspot logs RUN`)."""

    @property
    def key(self) -> Key:
        return Key(self.cloud, self.image, self.accelerators)

    def when(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(self.at))


def key_of(candidate: Any, entry: Mapping[str, Any]) -> Key:
    """A candidate's key, from the plan's candidate and its rendered `resources.ordered` entry."""
    image = entry.get("image_id")
    if isinstance(image, Mapping):  # per region
        image = json.dumps(dict(image), sort_keys=True, separators=(",", ":"))
    return Key(candidate.cloud, str(image) if image else DEFAULT_IMAGE, candidate.accelerators or "CPU")


def path() -> Path:
    return skyspot_home() / FILE


def read() -> dict[Key, Record]:
    """Every key's newest rehearsal; nothing when the file is missing or damaged."""
    try:
        data = json.loads(path().read_text())
    except (OSError, ValueError):
        return {}
    found: dict[Key, Record] = {}
    for item in data.get("rehearsals", []) if isinstance(data, dict) else []:
        try:
            record = Record(**item)
        except TypeError:
            continue
        found[record.key] = record
    return found


def failed() -> dict[Key, Record]:
    """The keys whose newest rehearsal failed."""
    return {key: record for key, record in read().items() if not record.ok}


def write(records: list[Record]) -> None:
    """Record these rehearsals, each replacing its key's earlier one."""
    kept = read()
    for record in records:
        kept[record.key] = record
    target = path()
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    temporary = target.with_name(f".{FILE}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({"rehearsals": [asdict(r) for r in kept.values()]}, handle, indent=2)
    os.replace(temporary, target)
