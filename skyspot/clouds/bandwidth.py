"""The bandwidths a node is assumed to have, per cloud, and their precedence: what the CLI's notice-window
check and the trainer's first interval plan divide a checkpoint's bytes by, until the run's own events
measure them (`measured_bandwidth`). Each cloud's root disk is its own class's (`root_disk_write`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from skyspot.clouds.base import get, names
from skyspot.errors import UsageError

GB = 1e9  # bandwidths and sizes are decimal: 1 GB/s = 10^9 bytes per second
MIB = 1024 * 1024

# Local write: the rendered task keeps the fast checkpoint tier in $HOME (tasks/*.yaml, RUN_DIR), i.e. on
# the root disk SkyPilot creates with `disk_size` and its default disk tier "medium"
# (sky/clouds/cloud.py `_DEFAULT_DISK_TIER`, SkyPilot 0.14.1): each cloud's class says what that is.

# Upload from one node to an object store in the same region, sustained (each cloud's `upload_gbps`).
# Every rank streams its own shards while writing them (writer.py), through the SDK's parallel
# machinery: awscrt's S3 client (what boto3 uses for its CRT transfers), GCS composite parts, Azure
# blocks; 8 parts of 16 MiB in flight per rank, so 64 per 8-GPU node. Ours, a quarter of what the
# hardware allows: S3 serves "up to 100 Gb/s" to one instance given enough parallel requests
# (https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance-guidelines.html), a
# p4de has 400 Gbit/s and a p5 3,200 Gbit/s of network, and awscrt aims each client at 10 Gbit/s
# unless it knows the instance. 2.5 GB/s = 20 Gbit/s per node; the run's own upload_end events
# replace it (plan_from_events, the trainer's save-time predictor, `measured_bandwidth`).

# The fast tier on the node's local NVMe: the task's setup finds the instance-store / local-SSD /
# temporary NVMe devices of the 8-GPU instances the recipes use (p4de: 8 x 1 TB, p5: 8 x 3.84 TB,
# a2-ultragpu-8g: 8 x 375 GB, a3-highgpu-8g: 16 x 375 GB, ND96amsr A100 v4: 6.4 TB, ND H100 v5:
# 8 x 3.5 TB), stripes them, mounts them and puts the run directory there
# (`python -m skyspot.trainer.local_disk`). Clouds publish no per-instance write throughput for
# most of these; ours: 4 GB/s per node, about 0.5 GB/s per drive, below GCP's local SSD table
# (https://cloud.google.com/compute/docs/disks/local-ssd#performance, 8 NVMe devices: 3,120 MiB/s
# write) times the drives. The node measures its disk at setup (a `local_disk` event) and that
# figure replaces this one (`measured_bandwidth`).
LOCAL_NVME_GBPS = 4.0
# Device-to-host copy of a rank's ZeRO-3 shards into the pinned snapshot buffers, per GPU: PCIe Gen4
# x16 moves about 25 GB/s; ours 20. The ranks copy in parallel, so a node takes bytes_per_rank / 20.
SNAPSHOT_GBPS_PER_RANK = 20.0

WRITE_ENV, UPLOAD_ENV = "SKYSPOT_WRITE_GBPS", "SKYSPOT_UPLOAD_GBPS"


def default_write_gbps(cloud: str, disk_size_gb: int, local_nvme: bool = False) -> tuple[float, str]:
    """(GB/s, why) for the fast tier of a node of `cloud`: the node's local NVMe when it has some
    (`local_nvme`: GPU instances), else the root disk SkyPilot gives it with `disk_size_gb`."""
    found = get(cloud)
    if local_nvme:
        return LOCAL_NVME_GBPS, (
            f"local NVMe (setup: skyspot.trainer.local_disk), assumed {LOCAL_NVME_GBPS:g} GB/s "
            "until the node measures it"
        )
    return found.root_disk_write(disk_size_gb)


@dataclass(frozen=True)
class Bandwidth:
    """Assumed per-node bandwidths on one cloud, and where each figure came from."""

    cloud: str
    write_gbps: float
    """Local write of the checkpoint shards (all ranks of a node together), GB/s."""
    upload_gbps: float
    """Upload of a node's shards to the run's store, GB/s."""
    write_source: str
    upload_source: str


def _positive_gbps(raw: Any, where: str) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise UsageError(f"{where}={raw!r} is not a number; expected GB/s such as 2 or 0.5") from None
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{where}={raw!r} must be a positive number of GB/s")
    return value


def bandwidth_for(
    cloud: str,
    *,
    disk_size_gb: int = 256,
    overrides: Optional[Mapping[str, Mapping[str, float]]] = None,
    environ: Optional[Mapping[str, str]] = None,
    local_nvme: bool = False,
) -> Bandwidth:
    """The bandwidths assumed for `cloud`, with the project's precedence: the `overrides` argument
    (flags, or `measured_bandwidth` of a run's events; keyed by cloud, or "*" for every cloud) >
    environment (SKYSPOT_WRITE_GBPS_AWS, then SKYSPOT_WRITE_GBPS; the same for UPLOAD) > defaults."""
    environ = os.environ if environ is None else environ
    for scope in overrides or {}:
        if scope not in ("*", *names()):
            raise UsageError(f"bandwidth override for unknown cloud '{scope}'; expected {', '.join(names())} or *")
    write, write_source = default_write_gbps(cloud, disk_size_gb, local_nvme)
    default_upload = get(cloud).upload_gbps
    upload, upload_source = (
        default_upload,
        f"default (ours): {default_upload:g} GB/s per node streamed to a same-region store",
    )
    for key, env in (("write_gbps", WRITE_ENV), ("upload_gbps", UPLOAD_ENV)):
        chosen = None
        for name in (env, f"{env}_{cloud.upper()}"):  # the per-cloud variable wins
            if environ.get(name, "").strip():
                chosen = (_positive_gbps(environ[name].strip(), name), f"{name}={environ[name].strip()}")
        for scope in ("*", cloud):  # an argument for this cloud beats one for all clouds
            given = (overrides or {}).get(scope) or {}
            unknown = set(given) - {"write_gbps", "upload_gbps"}
            if unknown:
                raise UsageError(
                    f"bandwidth override for '{scope}' has unknown keys {sorted(unknown)}; "
                    "expected write_gbps and upload_gbps"
                )
            if key in given:
                chosen = (_positive_gbps(given[key], f"{scope}.{key}"), f"override {scope}.{key}={given[key]}")
        if chosen and key == "write_gbps":
            write, write_source = chosen
        elif chosen:
            upload, upload_source = chosen
    return Bandwidth(cloud, write, upload, write_source, upload_source)
