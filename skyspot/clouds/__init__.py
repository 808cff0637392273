"""Cloud facts: one registered class per cloud (aws.py, gcp.py, azure.py, each a `Cloud` of base.py),
the registry (`get(name)`, `all()`, `names()`), and what both sides of skyspot compute from the clouds'
figures: assumed bandwidths (bandwidth.py) and preemption priors (priors.py).

What a cloud must provide is `base.REQUIRED`: its notice window, poll period and watcher binding, its
metadata endpoint rules, store scheme, region names, fast fabric, bandwidth and prior figures, and the
keys its prices are read by. A new cloud is one module here plus its tests; nothing outside this
package branches on a cloud's name.

A leaf: it imports nothing from skyspot but errors, so the CLI side and the trainer both import it and
neither imports the other. Import-light (standard library only; the CLI reads it at start-up).
"""

from __future__ import annotations

from typing import Optional

from skyspot.clouds.base import REQUIRED, Cloud, CloudDefinitionError, all, find, get, names, register
from skyspot.clouds.aws import AWS_NOTICE_WINDOW_S, AWS_POLL_S
from skyspot.clouds.gcp import GCP_GPU_MAINTENANCE_NOTICE_S, GCP_MAINTENANCE_NOTICE_S, GCP_NOTICE_WINDOW_S
from skyspot.clouds.azure import AZURE_NOTICE_WINDOW_S, AZURE_POLL_S
from skyspot.clouds.bandwidth import (
    GB,
    LOCAL_NVME_GBPS,
    MIB,
    SNAPSHOT_GBPS_PER_RANK,
    UPLOAD_ENV,
    WRITE_ENV,
    Bandwidth,
    bandwidth_for,
    default_write_gbps,
)
from skyspot.clouds.priors import LARGE_ACCELERATORS, MtbpPrior, mtbp_prior

CLOUDS = names()
"""The registered clouds' names: ("aws", "gcp", "azure")."""
NOTICE_WINDOWS_S: dict[str, float] = {c.name: c.notice_window_s for c in all()}
NOTICE_DETECT_S: dict[str, float] = {c.name: c.notice_detect_s for c in all()}
DEFAULT_UPLOAD_GBPS: dict[str, float] = {c.name: c.upload_gbps for c in all()}
STORE_CLOUDS: dict[str, str] = {c.store_scheme: c.name for c in all()}
"""Which cloud holds a store, by URI scheme (s3 -> aws, gs -> gcp, az -> azure)."""


def fast_fabric(cloud: str, accelerators: Optional[str]) -> tuple[Optional[str], str]:
    """(the fabric `network_tier: best` gets this candidate, or None; why not, when None)."""
    return get(cloud).fast_fabric(accelerators)


__all__ = [
    "REQUIRED",
    "Cloud",
    "CloudDefinitionError",
    "all",
    "find",
    "get",
    "names",
    "register",
    "CLOUDS",
    "NOTICE_WINDOWS_S",
    "NOTICE_DETECT_S",
    "DEFAULT_UPLOAD_GBPS",
    "STORE_CLOUDS",
    "fast_fabric",
    "AWS_NOTICE_WINDOW_S",
    "AWS_POLL_S",
    "GCP_NOTICE_WINDOW_S",
    "GCP_GPU_MAINTENANCE_NOTICE_S",
    "GCP_MAINTENANCE_NOTICE_S",
    "AZURE_NOTICE_WINDOW_S",
    "AZURE_POLL_S",
    "GB",
    "MIB",
    "LOCAL_NVME_GBPS",
    "SNAPSHOT_GBPS_PER_RANK",
    "WRITE_ENV",
    "UPLOAD_ENV",
    "Bandwidth",
    "bandwidth_for",
    "default_write_gbps",
    "LARGE_ACCELERATORS",
    "MtbpPrior",
    "mtbp_prior",
]
