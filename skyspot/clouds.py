"""Cloud facts: the published properties of AWS, GCP and Azure that both sides of skyspot plan with.

How long a preemption notice gives a VM and how often its metadata service should be asked (the
trainer's notice watchers and the CLI's window check), the bandwidth SkyPilot's default disks and a
node's uploads are assumed to have (the window check and the trainer's first interval plan), and the
prior for how often a spot node is preempted (the plan's egress estimate and the trainer's interval).
Each figure carries its source in one line; "ours" marks a figure no cloud publishes.

A leaf: it imports nothing from skyspot but errors, so the CLI side and the trainer both import it
and neither imports the other. Import-light (the CLI reads it at start-up).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

from skyspot.errors import UsageError

CLOUDS = ("aws", "gcp", "azure")

GB = 1e9  # bandwidths and sizes are decimal: 1 GB/s = 10^9 bytes per second
MIB = 1024 * 1024

# Notice windows: how long between a preemption notice and the VM going away.
AWS_NOTICE_WINDOW_S = 120.0  # "two minutes before": https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html
GCP_NOTICE_WINDOW_S = 30.0  # ACPI soft off, hard off 30 s later: https://cloud.google.com/compute/docs/instances/spot#preemption-process
AZURE_NOTICE_WINDOW_S = 30.0  # Preempt minimum notice: https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events#event-scheduling
NOTICE_WINDOWS_S: dict[str, float] = {"aws": AWS_NOTICE_WINDOW_S, "gcp": GCP_NOTICE_WINDOW_S,
                                      "azure": AZURE_NOTICE_WINDOW_S}
# Planned maintenance on GCP: "Compute Engine gives GPU VMs a 1-hour stopping notice, while normal VMs
# receive only a 60-second notice": https://cloud.google.com/compute/docs/gpus/gpu-host-maintenance
GCP_GPU_MAINTENANCE_NOTICE_S = 3600.0
GCP_MAINTENANCE_NOTICE_S = 60.0

# How often to ask the metadata service for a notice.
AWS_POLL_S = 5.0  # "check for these interruption notices every 5 seconds" (the AWS page above)
AZURE_POLL_S = 1.0  # "we recommend that you poll the service once per second" (the Azure page above)
# How late the trainer can learn of a notice: the watcher's polling period (skyspot/trainer/notice/).
# GCP's watcher holds a hanging GET open, which returns the moment the notice is set.
NOTICE_DETECT_S: dict[str, float] = {"aws": AWS_POLL_S, "gcp": 0.0, "azure": AZURE_POLL_S}



# =========================================================================== the fast fabric

# What SkyPilot 0.14.1 does with a candidate's `network_tier: best`, per cloud (read in its code;
# tests/executors/sky/test_sky_real.py holds each to SkyPilot's own objects):
# - AWS: EFA on instance types that have it (sky/clouds/aws.py `_EFA_INSTANCE_TYPE_PREFIXES`: p4d,
#   p4de, p5, p5e, p5en, g5, g6, g6e, ...; others keep the standard network), and such a node boots
#   the "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)" (`_EFA_IMAGE_NAME`) instead of
#   SkyPilot's default GPU image.
# - GCP: GPUDirect-TCPX: the host boots `skypilot:gpu-direct-cos` (Container-Optimized OS) with the
#   TCPX receive daemon for the a3-highgpu-8g's NICs (`--gpu_nic_preset a3vm`), and the task runs in
#   the docker image `nccl-plugin-gpudirecttcpx` (sky/provision/gcp/constants.py). It does this for any
#   GPU, but only a3-highgpu-8g (H100:8) has the NICs it is written for: elsewhere it is all cost.
# - Azure: not offered; `network_tier` is an unsupported feature there (sky/clouds/azure.py
#   CUSTOM_NETWORK_TIER), so a candidate asking for it is one SkyPilot's optimizer drops. Azure's
#   ND A100 v4 / ND H100 v5 sizes carry InfiniBand in the VM itself, without asking.
FAST_FABRIC: dict[str, Optional[tuple[str, tuple[str, ...]]]] = {
    "aws": ("EFA", ()),  # () = every accelerator: SkyPilot enables EFA only where the type has it
    "gcp": ("GPUDirect-TCPX", ("H100:8",)),
    "azure": None,
}
_NO_FABRIC = {  # the plan's note; docs/clouds.md ("The fabric") says the rest
    "gcp": "GPUDirect-TCPX is for H100:8 (a3-highgpu-8g) only",
    "azure": "SkyPilot has none on Azure (ND sizes carry InfiniBand anyway)",
}


def fast_fabric(cloud: str, accelerators: Optional[str]) -> tuple[Optional[str], str]:
    """(the fabric `network_tier: best` gets this candidate, or None; why not, when None)."""
    entry = FAST_FABRIC.get(cloud)
    if entry is None:
        return None, _NO_FABRIC.get(cloud, f"no network_tier on {cloud}")
    name, only = entry
    if not accelerators:
        return None, "CPU nodes: no fast fabric"
    if only and accelerators not in only:
        return None, _NO_FABRIC[cloud]
    return name, ""


# =========================================================================== bandwidth assumptions

# Local write: the rendered task keeps the fast checkpoint tier in $HOME (tasks/*.yaml, RUN_DIR), i.e. on
# the root disk SkyPilot creates with `disk_size` and its default disk tier "medium"
# (sky/clouds/cloud.py `_DEFAULT_DISK_TIER`, SkyPilot 0.14.1). What "medium" is on each cloud:
# AWS gp3 with 3500 IOPS and throughput iops // 16 = 218 MiB/s (sky/clouds/aws.py `_get_disk_specs`;
# gp3 throughput is in MiB/s: https://docs.aws.amazon.com/ebs/latest/userguide/general-purpose.html).
_AWS_GP3_MIBPS = 3500 // 16
# GCP pd-balanced for a2 and a3-highgpu (sky/clouds/gcp.py `_get_disk_type`): a 140 MiB/s baseline plus
# 0.28 MiB/s per GiB, capped per VM (1,200 MiB/s writes on large VMs): approximate, see
# https://cloud.google.com/compute/docs/disks/performance
_GCP_PD_BALANCED = (140.0, 0.28, 1200.0)
# Azure Premium_LRS (sky/clouds/azure.py `_get_disk_type`), billed and throttled at the next size tier
# up, MB/s per tier: https://learn.microsoft.com/azure/virtual-machines/disks-types#premium-ssd-size
_AZURE_PREMIUM_SSD_MBPS = ((32, 25), (64, 50), (128, 100), (256, 125), (512, 150), (1024, 200), (2048, 250),
                           (4096, 250), (8192, 500), (16384, 750), (32767, 900))

# Upload from one node to an object store in the same region, sustained. Every rank streams its own
# shards while writing them (writer.py), through the SDK's parallel machinery: awscrt's S3 client
# (what boto3 uses for its CRT transfers), GCS composite parts, Azure blocks; 8 parts of 16 MiB in
# flight per rank, so 64 per 8-GPU node. Ours, a quarter of what the hardware allows: S3 serves "up
# to 100 Gb/s" to one instance given enough parallel requests
# (https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance-guidelines.html), a
# p4de has 400 Gbit/s and a p5 3,200 Gbit/s of network, and awscrt aims each client at 10 Gbit/s
# unless it knows the instance. 2.5 GB/s = 20 Gbit/s per node; the run's own upload_end events
# replace it (plan_from_events, the trainer's save-time predictor, `measured_bandwidth`).
DEFAULT_UPLOAD_GBPS: dict[str, float] = {"aws": 2.5, "gcp": 2.5, "azure": 2.5}

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
# GCP Spot VMs can be given a longer notice (scheduling.preemptionNoticeDuration, up to 120 s on top
# of the 30 s); SkyPilot 0.14.1 cannot set it: sky/templates/gcp-ray.yml.j2 renders the scheduling
# block with fixed keys, and the `gcp:` config schema (sky/utils/schemas.py) has no field for it, so
# a task's config overrides cannot reach it either. GCP is planned with its 30 s.

WRITE_ENV, UPLOAD_ENV = "SKYSPOT_WRITE_GBPS", "SKYSPOT_UPLOAD_GBPS"


def default_write_gbps(cloud: str, disk_size_gb: int, local_nvme: bool = False) -> tuple[float, str]:
    """(GB/s, why) for the fast tier of a node of `cloud`: the node's local NVMe when it has some
    (`local_nvme`: GPU instances), else the root disk SkyPilot gives it with `disk_size_gb`."""
    if local_nvme and cloud in CLOUDS:
        return LOCAL_NVME_GBPS, (f"local NVMe (setup: skyspot.trainer.local_disk), assumed {LOCAL_NVME_GBPS:g} GB/s "
                                 "until the node measures it")
    if cloud == "aws":
        return _AWS_GP3_MIBPS * MIB / GB, f"SkyPilot default disk: gp3, {_AWS_GP3_MIBPS} MiB/s"
    if cloud == "gcp":
        base, per_gib, cap = _GCP_PD_BALANCED
        mibps = min(base + per_gib * disk_size_gb, cap)
        return mibps * MIB / GB, f"SkyPilot default disk: pd-balanced {disk_size_gb} GiB, ~{mibps:.0f} MiB/s"
    if cloud == "azure":
        mbps = next((m for size, m in _AZURE_PREMIUM_SSD_MBPS if disk_size_gb <= size), _AZURE_PREMIUM_SSD_MBPS[-1][1])
        return mbps * 1e6 / GB, f"SkyPilot default disk: Premium SSD {disk_size_gb} GiB, {mbps} MB/s"
    raise UsageError(f"unknown cloud '{cloud}'; expected aws, gcp or azure")


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


def bandwidth_for(cloud: str, *, disk_size_gb: int = 256,
                  overrides: Optional[Mapping[str, Mapping[str, float]]] = None,
                  environ: Optional[Mapping[str, str]] = None, local_nvme: bool = False) -> Bandwidth:
    """The bandwidths assumed for `cloud`, with the project's precedence: the `overrides` argument
    (flags, or `measured_bandwidth` of a run's events; keyed by cloud, or "*" for every cloud) >
    environment (SKYSPOT_WRITE_GBPS_AWS, then SKYSPOT_WRITE_GBPS; the same for UPLOAD) > defaults."""
    environ = os.environ if environ is None else environ
    for scope in overrides or {}:
        if scope not in ("*", *CLOUDS):
            raise UsageError(f"bandwidth override for unknown cloud '{scope}'; expected aws, gcp, azure or *")
    write, write_source = default_write_gbps(cloud, disk_size_gb, local_nvme)
    upload, upload_source = (DEFAULT_UPLOAD_GBPS[cloud],
                             f"default (ours): {DEFAULT_UPLOAD_GBPS[cloud]:g} GB/s per node streamed to a "
                             "same-region store")
    for key, env in (("write_gbps", WRITE_ENV), ("upload_gbps", UPLOAD_ENV)):
        chosen = None
        for name in (env, f"{env}_{cloud.upper()}"):  # the per-cloud variable wins
            if environ.get(name, "").strip():
                chosen = (_positive_gbps(environ[name].strip(), name), f"{name}={environ[name].strip()}")
        for scope in ("*", cloud):  # an argument for this cloud beats one for all clouds
            given = (overrides or {}).get(scope) or {}
            unknown = set(given) - {"write_gbps", "upload_gbps"}
            if unknown:
                raise UsageError(f"bandwidth override for '{scope}' has unknown keys {sorted(unknown)}; "
                                 "expected write_gbps and upload_gbps")
            if key in given:
                chosen = (_positive_gbps(given[key], f"{scope}.{key}"), f"override {scope}.{key}={given[key]}")
        if chosen and key == "write_gbps":
            write, write_source = chosen
        elif chosen:
            upload, upload_source = chosen
    return Bandwidth(cloud, write, upload, write_source, upload_source)


# =========================================================================== preemption rate

# Priors for the mean time between preemptions of ONE node, by cloud and accelerator class. Rough and
# ours: no cloud publishes a time between preemptions. AWS's Spot Instance Advisor
# (https://aws.amazon.com/ec2/spot/instance-advisor/) gives each instance type a "frequency of
# interruption" bucket (<5 %, 5-10 %, 10-15 %, 15-20 %, >20 %): the share of its spot capacity reclaimed
# over the trailing month, which does not convert into an MTBP for one long-running VM, and whose top
# bucket is open-ended. Azure shows eviction-rate buckets of the same shape per size and region (portal,
# and Azure Resource Graph's SpotResources table, which needs credentials). GCP publishes none for spot
# VMs ("Compute Engine might preempt Spot VMs at any time"). So the priors are short on purpose: the
# first plan errs towards checkpointing often, and the run's own preemptions replace them.
LARGE_ACCELERATORS = ("A100", "A100-80GB", "H100", "H100-MEGA", "H200", "B200")
PRIOR_NODE_HOURS: dict[tuple[str, str], float] = {
    ("aws", "large"): 6.0, ("aws", "small"): 24.0, ("aws", "cpu"): 24.0,
    ("gcp", "large"): 4.0, ("gcp", "small"): 12.0, ("gcp", "cpu"): 24.0,
    ("azure", "large"): 4.0, ("azure", "small"): 12.0, ("azure", "cpu"): 24.0,
}


@dataclass(frozen=True)
class MtbpPrior:
    """A prior for the mean time between preemptions, for one node and for the whole job."""

    cloud: str
    accelerator: Optional[str]
    accelerator_class: str
    num_nodes: int
    per_node_s: float
    job_s: float
    """per_node_s / num_nodes: with ZeRO-3 losing any node stops the job; independent preemptions assumed."""
    source: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def mtbp_prior(cloud: str, accelerator: Optional[str] = None, num_nodes: int = 1) -> MtbpPrior:
    """The prior mean time between preemptions for `num_nodes` spot nodes of `accelerator` on `cloud`."""
    cloud = cloud.lower()
    name = accelerator.partition(":")[0] if accelerator else None
    klass = "cpu" if not name else ("large" if name in LARGE_ACCELERATORS else "small")
    label = {"cpu": "CPU nodes", "large": "large GPUs", "small": "small GPUs"}[klass]
    if (cloud, klass) not in PRIOR_NODE_HOURS:
        raise UsageError(f"unknown cloud '{cloud}'; expected aws, gcp or azure")
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    per_node = PRIOR_NODE_HOURS[(cloud, klass)] * 3600
    return MtbpPrior(cloud, name, klass, num_nodes, per_node, per_node / num_nodes,
                     f"skyspot prior ({cloud}, {label}: {PRIOR_NODE_HOURS[(cloud, klass)]:g} h per node), "
                     "rough; see docs/planning.md")
