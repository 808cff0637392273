"""Azure: everything skyspot knows about it, in one registered class (SkyPilot's sky/clouds/azure.py).

Notices come from Scheduled Events (the node's watcher protocol is skyspot/trainer/notice/azure.py);
the figures and paths here are Microsoft's own, each with its source, or marked "ours".
"""

from __future__ import annotations

import re
from typing import ClassVar, Mapping, Optional

from skyspot.clouds.base import Cloud, SimulatedPlace, register

GB = 1e9

AZURE_NOTICE_WINDOW_S = 30.0  # Preempt minimum notice: https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events#event-scheduling
AZURE_POLL_S = 1.0  # "we recommend that you poll the service once per second" (the page above)

AZURE_ENDPOINT_VAR = "SKYSPOT_AZURE_METADATA_ENDPOINT"  # ours; Azure's SDKs have none
AZURE_DEFAULT_ENDPOINT = (
    "http://169.254.169.254"  # IMDS: https://learn.microsoft.com/azure/virtual-machines/instance-metadata-service
)
AZURE_API_VERSION = "2020-07-01"  # https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events#version-and-region-availability
AZURE_INSTANCE_API_VERSION = "2021-02-01"  # compute/name with format=text: the IMDS page above
AZURE_EVENTS_PATH = "/metadata/scheduledevents"
AZURE_NAME_PATH = "/metadata/instance/compute/name"
AZURE_COMPUTE_PATH = "/metadata/instance/compute"  # what the node is (trainer/instance.py): the IMDS page above
AZURE_RATE_LIMIT = 5  # "requests to IMDS are limited to 5 requests per second (on a per VM basis)": https://learn.microsoft.com/azure/virtual-machines/instance-metadata-service#rate-limiting
AZURE_SHUTDOWN_TYPES = frozenset({"Reboot", "Redeploy", "Terminate"})
AZURE_WARNING_TYPES = frozenset({"Freeze"})

# SkyPilot's default disk is Premium_LRS (sky/clouds/azure.py `_get_disk_type`), billed and throttled at
# the next size tier up, MB/s per tier: https://learn.microsoft.com/azure/virtual-machines/disks-types#premium-ssd-size
_AZURE_PREMIUM_SSD_MBPS = (
    (32, 25),
    (64, 50),
    (128, 100),
    (256, 125),
    (512, 150),
    (1024, 200),
    (2048, 250),
    (4096, 250),
    (8192, 500),
    (16384, 750),
    (32767, 900),
)


# ND A100 v4 / ND H100 v5 carry InfiniBand (8 x 200 Gb/s HDR, 8 x 400 Gb/s NDR:
# https://learn.microsoft.com/azure/virtual-machines/nda100-v4-series, .../nd-h100-v5-series), but SkyPilot's
# Azure GPU image has no RDMA user space. Microsoft's Ubuntu HPC image has it (MOFED, nvidia-peermem, NCCL's
# topology files in /opt/microsoft/: https://learn.microsoft.com/azure/virtual-machines/configure#vm-images and
# github.com/Azure/azhpc-images `topology/`, copied there by common/setup_sku_customizations.sh).
# ND candidates name it by SkyPilot's own tag for it, its Azure fallback image (sky/clouds/azure.py:50
# `_FALLBACK_IMAGE_ID`), not by URN: SkyPilot 0.14.1 sizes a `skypilot:` tag from its catalog's
# azure/images.csv (`get_image_size`, :189-202: offer `ubuntu-hpc` -> 30 GB, no Azure call), where a URN
# is sized by asking Azure (:204-281), which a task validated offline cannot. The catalog maps the tag to
# `microsoft-dsvm:ubuntu-hpc:2204:22.04.2023080201` (skypilot-org/skypilot-catalog catalogs/v5/azure/images.csv),
# resolved again at provisioning (:404-419) into the marketplace URN. That image's driver is 535.54.03
# (azhpc-images tag ubuntu-hpc-20230803, ubuntu/common/install_nvidiagpudriver.sh); node_env reads the
# driver on the node and picks the torch line for it (node_env.py TORCH_LINES), as on any image.
AZURE_HPC_IMAGE = "skypilot:gpu-ubuntu-2204"
ND_TOPOLOGY_FILES: Mapping[str, str] = {
    "standard_nd96asr_v4": "/opt/microsoft/ndv4-topo.xml",
    "standard_nd96amsr_a100_v4": "/opt/microsoft/ndv4-topo.xml",
    "standard_nd96isr_h100_v5": "/opt/microsoft/ndv5-topo.xml",
}
# PCIe relaxed ordering for GPUDirect RDMA in Azure's VMs, NCCL's and UCX's switch:
# https://techcommunity.microsoft.com/blog/azurehighperformancecomputingblog/nccl-performance-impact-with-pcie-relaxed-ordering/3660825
ND_NCCL_ENV: Mapping[str, str] = {
    "NCCL_IB_PCI_RELAXED_ORDERING": "1",
    "UCX_IB_PCI_RELAXED_ORDERING": "on",
    "NCCL_SOCKET_IFNAME": "eth0",  # the front-end NIC for NCCL's bootstrap; the IB HCAs carry the data
}


@register
class Azure(Cloud):
    name = "azure"
    label = "Azure"

    notice_window_s = AZURE_NOTICE_WINDOW_S
    notice_poll_s = AZURE_POLL_S
    notice_detect_s = AZURE_POLL_S
    notice_watcher = "skyspot.trainer.notice.azure"
    sigterm = None  # a Preempt event, then eviction at its NotBefore, with no signal
    planned_actions = frozenset(t.lower() for t in AZURE_SHUTDOWN_TYPES)

    metadata_endpoint_var = AZURE_ENDPOINT_VAR
    metadata_default_endpoint = AZURE_DEFAULT_ENDPOINT

    # The local executor's stand-in. A scaled-down window polls at most four times a second, under the
    # five IMDS allows a VM before it answers 429 (the local metadata server enforces that limit too).
    simulated = SimulatedPlace(
        region="eastus", zone=None, stand_in="Standard_ND96asr_v4", min_poll_s=1.0 / (AZURE_RATE_LIMIT - 1)
    )

    store_scheme = "az"
    spot_signal = None
    # The eviction-rate buckets per size and region are served by Azure Resource Graph (SpotResources) only.
    spot_signal_missing = "Azure publishes eviction rates only to an authenticated Azure Resource Graph query"
    region_pattern = re.compile(r"^[a-z]+\d*$")  # eastus2

    # `network_tier` is an unsupported feature on Azure in SkyPilot 0.14.1 (sky/clouds/azure.py:102
    # CUSTOM_NETWORK_TIER), so a candidate asking for it is one SkyPilot's optimizer drops. ND A100 v4 /
    # ND H100 v5 sizes carry InfiniBand in the VM itself; NCCL uses it on the HPC image with the IB settings
    # (`fabric_image`, `fabric_env`), without asking SkyPilot (`image_fabric`, the plan's note).
    fabric = None
    fabric_accelerators = ()
    no_fabric = "SkyPilot has no network_tier on Azure, and only ND A100 v4 / ND H100 v5 sizes carry InfiniBand"

    upload_gbps = 2.5  # ours: see skyspot/clouds/bandwidth.py
    prior_node_hours = {"large": 4.0, "small": 12.0, "cpu": 24.0}  # ours: see skyspot/clouds/priors.py

    attached_gpus = ()  # GPUs priced inside the VM row
    # Azure's spot meters are discounted from pay-as-you-go; a "spot" price equal to it (every
    # Standard_ND96isr_H100_v5 row of the snapshot) is the on-demand price again, not a spot price.
    spot_at_on_demand_is_spot = False
    # The catalog lists Standard_ND96isr_H100_v5 with 12 GPUs; Azure's ND H100 v5 SKU has 8.
    count_fixes: ClassVar[Mapping[str, int]] = {"standard_nd96isr_h100_v5": 8}

    def root_disk_write(self, disk_size_gb: int) -> tuple[float, str]:
        mbps = next((m for size, m in _AZURE_PREMIUM_SSD_MBPS if disk_size_gb <= size), _AZURE_PREMIUM_SSD_MBPS[-1][1])
        return mbps * 1e6 / GB, f"SkyPilot default disk: Premium SSD {disk_size_gb} GiB, {mbps} MB/s"

    def native_action(self, action: str) -> Optional[str]:
        return action.capitalize() if action else None  # Scheduled Events' EventType

    def metadata_redirect_env(self, url: str) -> dict[str, str]:
        # Ours for the watcher (Azure's SDKs have no endpoint variable), and the IMDS address
        # azure-identity's managed-identity credential uses.
        return {AZURE_ENDPOINT_VAR: url.rstrip("/"), "AZURE_POD_IDENTITY_AUTHORITY_HOST": url.rstrip("/")}

    def fabric_env(self, instance_type: Optional[str]) -> dict[str, str]:
        topo = _nd_topology(instance_type)
        if topo is None:
            return {}
        return {**ND_NCCL_ENV, "NCCL_TOPO_FILE": topo}

    def fabric_image(self, instance_type: Optional[str]) -> Optional[str]:
        return AZURE_HPC_IMAGE if _nd_topology(instance_type) else None

    def image_fabric(self, instance_type: Optional[str]) -> Optional[str]:
        if _nd_topology(instance_type) is None:
            return None
        return f"InfiniBand via Microsoft's HPC image ({AZURE_HPC_IMAGE}) and NCCL's IB settings, no network_tier"


def _nd_topology(instance_type: Optional[str]) -> Optional[str]:
    """The NCCL topology file of an ND size with InfiniBand, None for any other size."""
    return ND_TOPOLOGY_FILES.get(str(instance_type or "").lower())
