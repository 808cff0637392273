"""What each GPU instance type's inter-node fabric should carry, and the one judgment of a measured
figure against it: the trainer's fabric probe at every start (trainer/fabric_probe.py) decides with it,
`status` and `cost-report` read what it decided from the `fabric` event (`summarize`).

The figure compared is the all-reduce's bus bandwidth as nccl-tests defines it
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md: busbw = algbw x 2(n-1)/n for
all-reduce, "a number that reflects how optimally the hardware is used" and is comparable to the hardware's
peak whatever the rank count). Between nodes that peak is the node's fabric: the sum of its GPU-to-GPU
NICs' line rates, in GB/s (Gb/s / 8). A ring's bus bandwidth approaches it; NCCL's tree and the NIC-side
reductions can exceed it on two nodes (SkyPilot's EFA example measures about 78 GB/s on two p4d, whose four
EFA interfaces carry 50 GB/s), so a healthy fabric is not below it by much.

`MIN_FRACTION` (ours): below half the expected figure is a fabric that is not all there. What it is
meant to catch sits far below it: one EFA interface of a p4d's four (SkyPilot's example: about 20 GB/s, 0.4),
one of a p5's 32 (at most 1/32), NCCL on sockets (a few GB/s on 100 Gb/s front-end NICs); a healthy fabric
measured at the probe's size sits above it. Not higher, since the probe is a few seconds and a few hundred
MiB, not nccl-tests' sweep to 8 GB: a stricter bar would warn about healthy fabrics.

Import-light (standard library only): the CLI side reads it at `status`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping, Optional

MIN_FRACTION = 0.5
"""Below this fraction of the expected bus bandwidth, a multi-node start warns (or, with
`fabric.require: best`, refuses): see the module's docstring for why half."""

SLOW_TRANSPORTS = frozenset({"socket", "gloo", "tcp"})
"""Transports that are plain TCP between nodes: NCCL's sockets, gloo (CPU training)."""


@dataclass(frozen=True)
class FabricRate:
    """One instance type's GPU-to-GPU fabric between nodes, as its cloud publishes it."""

    cloud: str
    instance_type: str
    fabric: str
    """The fabric's name (EFA, GPUDirect-TCPX, InfiniBand NDR, ...)."""
    links: int
    """GPU-to-GPU network interfaces per node."""
    gbps_per_link: float
    """Line rate of one, in Gb/s."""
    source: str

    @property
    def total_gbps(self) -> float:
        return self.links * self.gbps_per_link

    @property
    def busbw_gbytes(self) -> float:
        """The bus bandwidth a two-node all-reduce should approach, GB/s (the node's fabric, Gb/s / 8)."""
        return self.total_gbps / 8

    @property
    def text(self) -> str:
        return f"{self.instance_type} {self.links} x {self.gbps_per_link:g} Gb/s {self.fabric}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "busbw_gbytes": self.busbw_gbytes}


_AWS_EFA = "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html"
_AWS_P4 = (
    "https://aws.amazon.com/blogs/compute/amazon-ec2-p4d-instances-deep-dive/ (400 Gbps EFA with GPUDirect "
    "RDMA) and " + _AWS_EFA + " (one EFA per network card; p4d has four)"
)
_AWS_P5 = (
    "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/p5-efa.html (P5 and P5e: up to 32 network cards, 3,200 Gbps)"
)
_GCP = "https://cloud.google.com/compute/docs/gpus/gpu-network-bandwidth"
_AZ_A100 = "https://learn.microsoft.com/azure/virtual-machines/nda100-v4-series (InfiniBand: GPUDirect RDMA, 8 x 200 Gigabit HDR)"
_AZ_NDM = "https://learn.microsoft.com/azure/virtual-machines/ndm-a100-v4-series (InfiniBand: GPUDirect RDMA, 8 x 200 Gigabit HDR)"
_AZ_H100 = (
    "https://learn.microsoft.com/azure/virtual-machines/sizes/gpu-accelerated/ndh100v5-series (a dedicated "
    "400 Gb/s NVIDIA Quantum-2 CX7 InfiniBand connection per GPU, 3.2 Tb/s per VM)"
)


def _rates(*rows: FabricRate) -> dict[str, FabricRate]:
    return {r.instance_type: r for r in rows}


RATES: dict[str, dict[str, FabricRate]] = {
    "aws": _rates(
        FabricRate("aws", "p4d.24xlarge", "EFA", 4, 100, _AWS_P4),
        FabricRate("aws", "p4de.24xlarge", "EFA", 4, 100, _AWS_P4),
        FabricRate("aws", "p5.48xlarge", "EFA", 32, 100, _AWS_P5),
        FabricRate("aws", "p5e.48xlarge", "EFA", 32, 100, _AWS_P5),
        # p5en: EFAv3, 16 cards x 200 Gbps, the same 3,200 Gbps (https://aws.amazon.com/ec2/instance-types/p5/)
        FabricRate(
            "aws", "p5en.48xlarge", "EFAv3", 16, 200, "https://aws.amazon.com/ec2/instance-types/p5/ (3,200 Gbps EFAv3)"
        ),
    ),
    "gcp": _rates(
        # A3 High: 1,000 Gbps in all, four 200 Gbps NICs for GPU-to-GPU traffic (GPUDirect-TCPX) and one gVNIC.
        FabricRate("gcp", "a3-highgpu-8g", "GPUDirect-TCPX", 4, 200, _GCP + " (A3 High: 4 x 200 Gbps GPU NICs)"),
        # A3 Mega: 1,800 Gbps in all, eight 200 Gbps NICs for GPU-to-GPU traffic (GPUDirect-TCPXO) and one gVNIC.
        FabricRate("gcp", "a3-megagpu-8g", "GPUDirect-TCPXO", 8, 200, _GCP + " (A3 Mega: 8 x 200 Gbps GPU NICs)"),
        # A3 Ultra: eight ConnectX-7 NICs, 3,200 Gbps, GPUDirect RDMA.
        FabricRate("gcp", "a3-ultragpu-8g", "RoCE (GPUDirect RDMA)", 8, 400, _GCP + " (A3 Ultra: 8 CX-7, 3,200 Gbps)"),
        # A2: no GPU fabric; up to 100 Gbps on the VM's own NIC (TCP).
        FabricRate("gcp", "a2-highgpu-8g", "TCP (no GPU fabric)", 1, 100, _GCP + " (A2: up to 100 Gbps)"),
        FabricRate("gcp", "a2-ultragpu-8g", "TCP (no GPU fabric)", 1, 100, _GCP + " (A2: up to 100 Gbps)"),
    ),
    "azure": _rates(
        FabricRate("azure", "Standard_ND96asr_v4", "InfiniBand HDR", 8, 200, _AZ_A100),
        FabricRate("azure", "Standard_ND96amsr_A100_v4", "InfiniBand HDR", 8, 200, _AZ_NDM),
        FabricRate("azure", "Standard_ND96isr_H100_v5", "InfiniBand NDR", 8, 400, _AZ_H100),
    ),
}
"""Per cloud, per instance type: the 8-GPU types the recipes' candidates use (the price snapshot's)."""


def expected_for(instance_type: Optional[str], cloud: Optional[str] = None) -> Optional[FabricRate]:
    """The instance type's fabric, or None for a type without one in the table (CPU, 1-GPU, unknown)."""
    if not instance_type:
        return None
    clouds = [cloud.lower()] if cloud and cloud.lower() in RATES else list(RATES)
    for name in clouds:
        found = RATES[name].get(instance_type)
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class Judgment:
    """A measured start's fabric against its instance type's: what the trainer records and acts on."""

    on_sockets: bool
    """More than one node, over plain TCP (SLOW_TRANSPORTS)."""
    below_expected: bool
    """More than one node, and the probe's bus bandwidth below MIN_FRACTION of the expected figure."""
    expected_gbps: Optional[float]
    """The expected bus bandwidth in GB/s (None: no figure for this instance type, or one node)."""
    line: Optional[str]
    """One line saying what is wrong with the measured and expected figures; None when nothing is."""

    transport: Optional[str] = None

    @property
    def short(self) -> bool:
        """What `fabric.require: best` refuses: plain TCP between nodes, or below the fraction."""
        return self.on_sockets or self.below_expected

    @property
    def warns(self) -> bool:
        """What `fabric.require: warn` warns about: NCCL fallen back to sockets, or below the fraction. gloo is
        CPU training, which has no other transport: recorded (and refused by `best`), not warned about."""
        return self.below_expected or (self.on_sockets and (self.transport or "").lower() != "gloo")


def judge(
    *,
    busbw_gbps: Optional[float],
    transport: Optional[str],
    num_nodes: int,
    expected: Optional[FabricRate],
    fraction: float = MIN_FRACTION,
) -> Judgment:
    """The one judgment of a start's fabric. One node has no fabric to judge: the probe then measures the
    node's own links (NVLink, shared memory), which no fabric figure describes."""
    if num_nodes <= 1:
        return Judgment(False, False, None, None)
    measured = "not measured" if busbw_gbps is None else f"{busbw_gbps:.2f} GB/s bus bandwidth"
    want = expected.busbw_gbytes if expected is not None else None
    expected_text = (
        f"expected {want:g} GB/s ({expected.text})"
        if expected is not None
        else "no expected figure for this instance type"
    )
    on_sockets = (transport or "").lower() in SLOW_TRANSPORTS
    below = want is not None and busbw_gbps is not None and busbw_gbps < fraction * want
    line = None
    if on_sockets:
        line = f"the fabric between {num_nodes} nodes is plain TCP ({transport}): measured {measured}, {expected_text}"
    elif below:
        line = (
            f"the fabric between {num_nodes} nodes is below {fraction:g} of what it should carry: measured "
            f"{measured} on {transport or 'an unknown transport'}, {expected_text}"
        )
    return Judgment(on_sockets, below, want, line, transport)


def summarize(fabric_events: Iterable[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
    """What `status` and `cost-report` show of one attempt's `fabric` events (one per node): the transports,
    the slowest node's probe, the expected figure, whether any node was below it or on sockets, and the
    first node's warning (`warning`: what the mark in `status` and `cost-report` stands for); None when no
    node recorded one."""
    events = list(fabric_events)
    if not events:
        return None
    transports = sorted({str(e["transport"]) for e in events if e.get("transport")})
    measured = [float(e["busbw_gbps"]) for e in events if isinstance(e.get("busbw_gbps"), (int, float))]
    expected = [float(e["expected_gbps"]) for e in events if isinstance(e.get("expected_gbps"), (int, float))]
    return {
        "transport": ", ".join(transports) or None,
        "busbw_gbps": min(measured) if measured else None,
        "expected_gbps": max(expected) if expected else None,
        "below_expected": any(e.get("below_expected") is True for e in events),
        "on_sockets": any(e.get("on_sockets") is True for e in events),
        "warning": next((str(e["warning"]) for e in events if e.get("warning")), None),
    }
