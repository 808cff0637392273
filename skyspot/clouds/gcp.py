"""GCP: everything skyspot knows about it, in one registered class (SkyPilot's sky/clouds/gcp.py).

Notices come from the metadata server's hanging GETs (the node's watcher protocol is
skyspot/trainer/notice/gcp.py); the figures and paths here are Google's own, each with its source, or
marked "ours".
"""

from __future__ import annotations

import re
from typing import ClassVar, Mapping, Optional

from skyspot.clouds.base import Cloud, SimulatedPlace, endpoint_url, register

GB, MIB = 1e9, 1024 * 1024

GCP_NOTICE_WINDOW_S = (
    30.0  # ACPI soft off, hard off 30 s later: https://cloud.google.com/compute/docs/instances/spot#preemption-process
)
# Planned maintenance: "Compute Engine gives GPU VMs a 1-hour stopping notice, while normal VMs
# receive only a 60-second notice": https://cloud.google.com/compute/docs/gpus/gpu-host-maintenance
GCP_GPU_MAINTENANCE_NOTICE_S = 3600.0
GCP_MAINTENANCE_NOTICE_S = 60.0
GCP_RETRY_S = 1.0  # the Compute docs' sample retries a 503 after 1 s; the GET itself hangs
# GCP Spot VMs can be given a longer notice (scheduling.preemptionNoticeDuration, up to 120 s on top
# of the 30 s); SkyPilot 0.14.1 cannot set it: sky/templates/gcp-ray.yml.j2 renders the scheduling
# block with fixed keys, and the `gcp:` config schema (sky/utils/schemas.py) has no field for it, so
# a task's config overrides cannot reach it either. GCP is planned with its 30 s.

# https://cloud.google.com/compute/docs/metadata/querying-metadata
GCP_ENDPOINT_VAR = "GCE_METADATA_HOST"  # google-auth's; it reads GCE_METADATA_ROOT second
GCP_DEFAULT_ENDPOINT = "http://metadata.google.internal"
GCP_DEFAULT_IP = "169.254.169.254"  # google-auth's _GCE_DEFAULT_MDS_IP, overridable with GCE_METADATA_IP
GCP_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
GCP_MAINTENANCE_PATH = "/computeMetadata/v1/instance/maintenance-event"
GCP_UPCOMING_PATH = "/computeMetadata/v1/instance/upcoming-maintenance"
GCP_SHUTDOWN_EVENTS = frozenset({"TERMINATE_ON_HOST_MAINTENANCE", "SHUTDOWN_ON_HOST_MAINTENANCE"})
GCP_WARNING_EVENTS = frozenset({"MIGRATE_ON_HOST_MAINTENANCE"})
# What the node is (trainer/instance.py): https://cloud.google.com/compute/docs/metadata/predefined-metadata-keys
GCP_INSTANCE_PATHS = {
    "machine_type": "/computeMetadata/v1/instance/machine-type",
    "preemptible": "/computeMetadata/v1/instance/scheduling/preemptible",
    "zone": "/computeMetadata/v1/instance/zone",
}
GCP_IMAGE_PATH = "/computeMetadata/v1/instance/image"  # optional: projects/P/global/images/NAME

# SkyPilot's default disk on a2 and a3-highgpu is pd-balanced (sky/clouds/gcp.py `_get_disk_type`): a
# 140 MiB/s baseline plus 0.28 MiB/s per GiB, capped per VM (1,200 MiB/s writes on large VMs):
# approximate, see https://cloud.google.com/compute/docs/disks/performance
_GCP_PD_BALANCED = (140.0, 0.28, 1200.0)

# GPUDirect-TCPX's NCCL settings for a3-highgpu-8g, as SkyPilot's own example exports them
# (skypilot-org/skypilot examples/gcp_gpu_direct_tcpx/nccl_tcpx_gcpvm_h100.yaml, `run`, the block after
# "Set environment variables"; Google's https://cloud.google.com/compute/docs/gpus/gpudirect lists the same).
# LD_LIBRARY_PATH, PATH and CUDA_VISIBLE_DEVICES of the example are left out: setup links the plugin
# beside torch's own NCCL (task/render.py TCPX_SETUP), and SkyPilot sets the GPUs.
TCPX_INSTANCE_TYPES = ("a3-highgpu-8g",)
TCPX_NCCL_ENV: Mapping[str, str] = {
    "NCCL_SOCKET_IFNAME": "eth0",
    "NCCL_CROSS_NIC": "0",
    "NCCL_ALGO": "Ring",
    "NCCL_PROTO": "Simple",
    "NCCL_NSOCKS_PERTHREAD": "4",
    "NCCL_SOCKET_NTHREADS": "1",
    "NCCL_NET_GDR_LEVEL": "PIX",
    "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
    "NCCL_P2P_PXN_LEVEL": "0",
    "NCCL_P2P_NET_CHUNKSIZE": "524288",
    "NCCL_P2P_PCI_CHUNKSIZE": "524288",
    "NCCL_P2P_NVL_CHUNKSIZE": "1048576",
    "NCCL_BUFFSIZE": "8388608",
    "NCCL_MAX_NCHANNELS": "8",
    "NCCL_MIN_NCHANNELS": "8",
    "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME": "eth1,eth2,eth3,eth4",
    "NCCL_GPUDIRECTTCPX_CTRL_DEV": "eth0",
    "NCCL_GPUDIRECTTCPX_TX_BINDINGS": "eth1:8-21,112-125;eth2:8-21,112-125;eth3:60-73,164-177;eth4:60-73,164-177",
    "NCCL_GPUDIRECTTCPX_RX_BINDINGS": "eth1:22-35,126-139;eth2:22-35,126-139;eth3:74-87,178-191;eth4:74-87,178-191",
    "NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS": "50000",
    "NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX": "/run/tcpx",
    "NCCL_GPUDIRECTTCPX_FORCE_ACK": "0",
}

# The watcher's action words -> the metadata key `instance/preempted` and `instance/maintenance-event`'s values.
_NATIVE = {
    "preempt": "preempted",
    "maintenance": "TERMINATE_ON_HOST_MAINTENANCE",
    "migrate": "MIGRATE_ON_HOST_MAINTENANCE",
}


@register
class GCP(Cloud):
    name = "gcp"
    label = "GCP"

    notice_window_s = GCP_NOTICE_WINDOW_S
    notice_poll_s = GCP_RETRY_S
    notice_detect_s = 0.0  # a hanging GET returns the moment the notice is set
    notice_watcher = "skyspot.trainer.notice.gcp"
    sigterm = "with_notice"  # `preempted` and the ACPI soft-off come together
    planned_actions = frozenset({"maintenance"})

    metadata_endpoint_var = GCP_ENDPOINT_VAR
    metadata_default_endpoint = GCP_DEFAULT_ENDPOINT

    # The local executor's stand-in; 0.05 s (ours) so a scaled-down window never busy-polls.
    simulated = SimulatedPlace(region="us-central1", zone="us-central1-a", stand_in="g2-standard-96", min_poll_s=0.05)

    store_scheme = "gs"
    spot_signal = None
    spot_signal_missing = "GCP publishes no per-type preemption rate for Spot VMs"
    region_pattern = re.compile(r"^[a-z]+-[a-z]+\d+$")  # us-central1

    # GPUDirect-TCPX: SkyPilot 0.14.1 boots the host as `skypilot:gpu-direct-cos` (Container-Optimized OS)
    # with the TCPX receive daemon for the a3-highgpu-8g's NICs (`--gpu_nic_preset a3vm`), and the task runs
    # in the docker image `nccl-plugin-gpudirecttcpx` (sky/provision/gcp/constants.py). It does this for any
    # GPU, but only a3-highgpu-8g (H100:8) has the NICs it is written for: elsewhere it is all cost.
    fabric = "GPUDirect-TCPX"
    fabric_accelerators = ("H100:8",)
    no_fabric = "GPUDirect-TCPX is for H100:8 (a3-highgpu-8g) only"

    upload_gbps = 2.5  # ours: see skyspot/clouds/bandwidth.py
    prior_node_hours = {"large": 4.0, "small": 12.0, "cpu": 24.0}  # ours: see skyspot/clouds/priors.py

    # The catalog prices the GPUs of a2/a3/g2 machines in separate rows (empty InstanceType); a machine's
    # full price is its VM row plus the matching GPU row in the same zone (pricing/prices.py).
    attached_gpus = (
        (re.compile(r"a2-highgpu-(\d+)g"), "A100", None),
        (re.compile(r"a2-megagpu-(16)g"), "A100", None),
        (re.compile(r"a2-ultragpu-(\d+)g"), "A100-80GB", None),
        (re.compile(r"a3-highgpu-(\d+)g"), "H100", None),
        (re.compile(r"a3-megagpu-(8)g"), "H100-MEGA", None),
        (re.compile(r"g2-standard-96"), "L4", 8),
        (re.compile(r"g2-standard-48"), "L4", 4),
        (re.compile(r"g2-standard-24"), "L4", 2),
        (re.compile(r"g2-standard-(4|8|12|16|32)"), "L4", 1),
    )
    spot_at_on_demand_is_spot = True
    count_fixes: ClassVar[Mapping[str, int]] = {}

    def fabric_env(self, instance_type: Optional[str]) -> dict[str, str]:
        return dict(TCPX_NCCL_ENV) if instance_type in TCPX_INSTANCE_TYPES else {}

    def fabric_image(self, instance_type: Optional[str]) -> Optional[str]:
        return None  # SkyPilot sets the TCPX host image and container itself (sky/resources.py:1535-1541)

    def root_disk_write(self, disk_size_gb: int) -> tuple[float, str]:
        base, per_gib, cap = _GCP_PD_BALANCED
        mibps = min(base + per_gib * disk_size_gb, cap)
        return mibps * MIB / GB, f"SkyPilot default disk: pd-balanced {disk_size_gb} GiB, ~{mibps:.0f} MiB/s"

    def native_action(self, action: str) -> Optional[str]:
        return _NATIVE.get(action)

    def metadata_redirect_env(self, url: str) -> dict[str, str]:
        # google-auth reads GCE_METADATA_HOST, then its old name GCE_METADATA_ROOT, and pings GCE_METADATA_IP
        # (not the host) to decide whether it is on GCE; all three are host:port. GCE_METADATA_MTLS_MODE=none
        # so an inherited `strict` (google-auth >= 2.40 speaks mTLS to the metadata server then) does not
        # try HTTPS against a plain-HTTP server.
        host_port = url.split("://", 1)[-1].rstrip("/")
        return {
            GCP_ENDPOINT_VAR: host_port,
            "GCE_METADATA_ROOT": host_port,
            "GCE_METADATA_IP": host_port,
            "GCE_METADATA_MTLS_MODE": "none",
        }

    def metadata_override(self, env: Mapping[str, str]) -> str:
        return env.get(GCP_ENDPOINT_VAR, "").strip() or env.get("GCE_METADATA_ROOT", "").strip()

    def metadata_fallback(self, env: Mapping[str, str]) -> Optional[str]:
        """Google documents 169.254.169.254 beside metadata.google.internal, and google-auth pings
        GCE_METADATA_IP (default that address). With GCE_METADATA_HOST set and no GCE_METADATA_IP there
        is no fallback, so a redirected watcher never reaches a real address."""
        ip = env.get("GCE_METADATA_IP", "").strip()
        if ip:
            return endpoint_url(ip)
        return None if self.metadata_override(env) else endpoint_url(GCP_DEFAULT_IP)


def maintenance_notice_s(env: Mapping[str, str]) -> float:
    """How far ahead planned maintenance is announced on this node: an hour on a GPU VM, else 60 s."""
    gpus = env.get("SKYPILOT_NUM_GPUS_PER_NODE", "").strip()
    return GCP_GPU_MAINTENANCE_NOTICE_S if gpus not in ("", "0") else GCP_MAINTENANCE_NOTICE_S
