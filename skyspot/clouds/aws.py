"""AWS: everything skyspot knows about it, in one registered class (SkyPilot's sky/clouds/aws.py).

Notices come from IMDS (the node's watcher protocol is skyspot/trainer/notice/aws.py); the figures and
paths here are AWS's own, each with its source, or marked "ours".
"""

from __future__ import annotations

import logging
import re
from typing import Any, ClassVar, Mapping, Optional

from skyspot.clouds.base import Cloud, SimulatedPlace, register

log = logging.getLogger(__name__)

GB, MIB = 1e9, 1024 * 1024

AWS_NOTICE_WINDOW_S = 120.0  # "two minutes before": https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html
AWS_POLL_S = 5.0  # "check for these interruption notices every 5 seconds" (the page above)

# IMDS: https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instancedata-data-retrieval.html
AWS_ENDPOINT_VAR = "AWS_EC2_METADATA_SERVICE_ENDPOINT"  # botocore's
AWS_DEFAULT_ENDPOINT = "http://169.254.169.254"
AWS_IPV6_ENDPOINT = "http://[fd00:ec2::254]"  # botocore METADATA_BASE_URL_IPv6 (Nitro instances)
AWS_TOKEN_PATH = "/latest/api/token"
AWS_INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
AWS_REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
AWS_MAINTENANCE_PATH = "/latest/meta-data/events/maintenance/scheduled"
# What the node is (trainer/instance.py): https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instancedata-data-categories.html
AWS_INSTANCE_PATHS = {
    "instance_type": "/latest/meta-data/instance-type",
    "lifecycle": "/latest/meta-data/instance-life-cycle",
    "zone": "/latest/meta-data/placement/availability-zone",
    "zone_id": "/latest/meta-data/placement/availability-zone-id",
    "region": "/latest/meta-data/placement/region",
    "image": "/latest/meta-data/ami-id",  # the node's facts (trainer/node_facts.py); optional
}
# What each planned event means for a training job. A shutdown stops or restarts the VM; a warning
# leaves it running (a pause of seconds, a live migration, network maintenance).
# https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/monitoring-instances-status-check_sched.html
AWS_SHUTDOWN_CODES = frozenset({"instance-reboot", "system-reboot", "instance-stop", "instance-retirement"})
AWS_WARNING_CODES = frozenset({"system-maintenance"})

# SkyPilot 0.14.1's default disk tier "medium" on AWS is gp3 with 3500 IOPS and throughput iops // 16 =
# 218 MiB/s (sky/clouds/aws.py `_get_disk_specs`; gp3 throughput is in MiB/s:
# https://docs.aws.amazon.com/ebs/latest/userguide/general-purpose.html).
_AWS_GP3_MIBPS = 3500 // 16

# Zones every account gets, as the catalog (zone IDs, use1-az4) or a VM (zone names, us-east-1a)
# spells them. Anything else is a zone an account must opt into: Local Zones (use1-atl2-az1,
# us-east-1-atl-2a) and Wavelength zones (use1-wl1-bos-wlz1, us-east-1-wl1-bos-wlz-1).
_AWS_STANDARD_ZONE = re.compile(r"^(?:[a-z]{2,}\d+-az\d+|[a-z]{2}(?:-gov)?-[a-z]+-\d+[a-z])$")


# SkyPilot 0.14.1's EFA rule (sky/clouds/aws.py:83-97 `_EFA_INSTANCE_TYPE_PREFIXES`, :162-166
# `_is_efa_instance_type`): an instance type starting with one of these gets EFA under `network_tier: best`.
EFA_INSTANCE_TYPE_PREFIXES = (
    "g4dn.",
    "g5.",
    "g6.",
    "gr6.",
    "g6e.",
    "g7e.",
    "p4d.",
    "p4de.",
    "p5.",
    "p5e.",
    "p5en.",
    "p6-b200.",
    "p6-b300.",
)
# EC2 DescribeInstanceTypes NetworkInfo.EfaInfo.MaximumEfaInterfaces, what SkyPilot asks AWS for at launch
# (sky/clouds/aws.py:197-216 `_get_max_efa_interfaces`); figures from
# https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html (tests/test_clouds_fabric.py
# checks them against SkyPilot's own function over moto's copy of DescribeInstanceTypes).
MAX_EFA_INTERFACES: Mapping[str, int] = {
    "p4d.24xlarge": 4,
    "p4de.24xlarge": 4,
    "p5.48xlarge": 32,
    "p5e.48xlarge": 32,
    "p5en.48xlarge": 16,
    "p6-b200.48xlarge": 8,
    "g6e.48xlarge": 4,
    "g5.48xlarge": 1,
}
# The aws-ofi-nccl plugin and libfabric on the DLAMI SkyPilot boots for EFA (the "Deep Learning Base OSS
# Nvidia Driver GPU AMI"): "/opt/amazon/ofi-nccl/lib" and "/opt/amazon/efa/lib" per its release notes
# https://docs.aws.amazon.com/dlami/latest/devguide/aws-deep-learning-base-gpu-ami-ubuntu-22-04.html and the
# EFA NCCL guide https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start-nccl.html (FI_PROVIDER=efa;
# FI_EFA_USE_DEVICE_RDMA=1 on p4d/p4de/p5 family, whose EFA devices do RDMA reads).
AWS_OFI_NCCL_LIB = "/opt/amazon/ofi-nccl/lib"
AWS_EFA_LIB = "/opt/amazon/efa/lib"
_EFA_RDMA_PREFIXES = ("p4d.", "p4de.", "p5.", "p5e.", "p5en.", "p6-b200.", "p6-b300.")


def is_efa_instance_type(instance_type: Optional[str]) -> bool:
    """SkyPilot's rule, sky/clouds/aws.py:162-166."""
    return bool(instance_type) and str(instance_type).startswith(EFA_INSTANCE_TYPE_PREFIXES)


def gets_efa(candidate: Any) -> bool:
    """Whether a planned candidate boots SkyPilot's EFA image with EFA attached: an AWS candidate asking for
    `network_tier: best` on an instance type of SkyPilot's EFA list (the rule above)."""
    return (
        getattr(candidate, "cloud", None) == AWS.name
        and getattr(candidate, "network_tier", None) == "best"
        and is_efa_instance_type(getattr(candidate, "instance_type", None))
    )


def efa_interfaces(instance_type: Optional[str], use_internal_ips: bool) -> tuple[int, Optional[int]]:
    """(interfaces SkyPilot 0.14.1 attaches to a `network_tier: best` node of `instance_type`, the most it has;
    None where this table does not know the type).

    SkyPilot asks AWS for the maximum (sky/clouds/aws.py:800-808), and attaches the first interface as
    `efa` and the others (NetworkCardIndex 1..max-1) only when the node gets no public IP, i.e. with
    `aws.use_internal_ips` (sky/clouds/aws.py:810-838 warns; sky/provision/aws/instance.py:350-380 attaches,
    `associate_public_ip_address = not use_internal_ips` at :691 and :716)."""
    if not is_efa_instance_type(instance_type):
        return 0, 0
    most = MAX_EFA_INTERFACES.get(str(instance_type))
    if most is None:
        return 1, None
    if most > 1 and use_internal_ips:
        return most, most
    return min(most, 1), most


def _true(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() == "true"


@register
class AWS(Cloud):
    name = "aws"
    label = "AWS"

    notice_window_s = AWS_NOTICE_WINDOW_S
    notice_poll_s = AWS_POLL_S
    notice_detect_s = AWS_POLL_S
    notice_watcher = "skyspot.trainer.notice.aws"
    sigterm = "at_deadline"  # the OS shuts down at the notice's `time`
    planned_actions = AWS_SHUTDOWN_CODES

    metadata_endpoint_var = AWS_ENDPOINT_VAR
    metadata_default_endpoint = AWS_DEFAULT_ENDPOINT

    # The local executor's stand-in; 0.05 s (ours) so a scaled-down window never busy-polls.
    simulated = SimulatedPlace(region="us-east-1", zone="us-east-1a", stand_in="g5.48xlarge", min_poll_s=0.05)

    store_scheme = "s3"
    # Spot Instance Advisor's interruption buckets per type and region (pricing_data/SOURCE.md).
    spot_signal = "AWS Spot Advisor"
    spot_signal_missing = ""
    region_pattern = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d+$")  # us-east-1

    # SkyPilot 0.14.1 attaches EFA on instance types that have it (sky/clouds/aws.py
    # `_EFA_INSTANCE_TYPE_PREFIXES`: p4d, p4de, p5, p5e, p5en, g5, g6, g6e, ...; others keep the standard
    # network), and such a node boots the "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)"
    # (`_EFA_IMAGE_NAME`) instead of SkyPilot's default GPU image.
    fabric = "EFA"
    fabric_accelerators = ()  # every accelerator: SkyPilot enables EFA only where the type has it
    no_fabric = "no EFA on this instance type"

    upload_gbps = 2.5  # ours: see skyspot/clouds/bandwidth.py
    prior_node_hours = {"large": 6.0, "small": 24.0, "cpu": 24.0}  # ours: see skyspot/clouds/priors.py

    attached_gpus = ()  # GPUs priced inside the VM row
    spot_at_on_demand_is_spot = True  # AWS's spot price is capped at on-demand and does reach it
    count_fixes: ClassVar[Mapping[str, int]] = {}

    def root_disk_write(self, disk_size_gb: int) -> tuple[float, str]:
        return _AWS_GP3_MIBPS * MIB / GB, f"SkyPilot default disk: gp3, {_AWS_GP3_MIBPS} MiB/s"

    def native_action(self, action: str) -> Optional[str]:
        # instance-action `terminate`, `stop`, `hibernate`; scheduled event codes `system-reboot`, ...
        # The rebalance recommendation has no action word of AWS's own.
        return None if action == "rebalance" else action

    def metadata_redirect_env(self, url: str) -> dict[str, str]:
        # botocore and the other AWS SDKs read the endpoint; the mode set to IPv4 so an inherited IPv6
        # mode changes nothing.
        return {AWS_ENDPOINT_VAR: url.rstrip("/") + "/", "AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE": "IPv4"}

    def metadata_endpoint(self, env: Mapping[str, str]) -> Optional[str]:
        # The AWS SDKs' switch for "do not touch IMDS". An explicit endpoint (the local executor's
        # loopback server) still counts, since it is not the IMDS that switch guards.
        if _true(env, "AWS_EC2_METADATA_DISABLED"):
            return None
        return AWS_IPV6_ENDPOINT if _ipv6(env) else AWS_DEFAULT_ENDPOINT

    def opt_in_zone(self, zone: Optional[str]) -> bool:
        return bool(zone) and not _AWS_STANDARD_ZONE.match(str(zone).lower())

    def fabric_env(self, instance_type: Optional[str]) -> dict[str, str]:
        # The EFA NCCL guide (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start-nccl.html):
        # libfabric's EFA provider, and NCCL finds the aws-ofi-nccl plugin on LD_LIBRARY_PATH
        # (SKYSPOT_LIBPATH_KEEP keeps those folders through libpath.py's clean-up).
        if not is_efa_instance_type(instance_type):
            return {}
        env = {"FI_PROVIDER": "efa", "SKYSPOT_LIBPATH_PREPEND": f"{AWS_OFI_NCCL_LIB}:{AWS_EFA_LIB}"}
        if str(instance_type).startswith(_EFA_RDMA_PREFIXES):
            env["FI_EFA_USE_DEVICE_RDMA"] = "1"
        return env

    def fabric_image(self, instance_type: Optional[str]) -> Optional[str]:
        return None  # SkyPilot picks the EFA AMI itself; skyspot checks its owner (clouds/aws_images.py)


def _ipv6(env: Mapping[str, str]) -> bool:
    """botocore's resolve_imds_endpoint_mode: the mode variable, else AWS_IMDS_USE_IPV6; IPv4 by default."""
    mode = env.get("AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE", "").strip().lower()
    if mode:
        if mode not in ("ipv4", "ipv6"):
            log.warning("AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE=%r is neither IPv4 nor IPv6; using IPv4", mode)
            return False
        return mode == "ipv6"
    return _true(env, "AWS_IMDS_USE_IPV6")
