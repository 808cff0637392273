"""Priors for how often a spot node is preempted: the plan's egress estimate and the trainer's first
checkpoint interval start from them, and the run's own preemptions replace them.

Rough and ours (each cloud's `prior_node_hours`): no cloud publishes a time between preemptions. AWS's
Spot Instance Advisor (https://aws.amazon.com/ec2/spot/instance-advisor/) gives each instance type a
"frequency of interruption" bucket (<5 %, 5-10 %, 10-15 %, 15-20 %, >20 %): the share of its spot
capacity reclaimed over the trailing month, which does not convert into an MTBP for one long-running
VM, and whose top bucket is open-ended. Azure shows eviction-rate buckets of the same shape per size and
region (portal, and Azure Resource Graph's SpotResources table, which needs credentials). GCP publishes
none for spot VMs ("Compute Engine might preempt Spot VMs at any time"). So the priors are short on
purpose: the first plan errs towards checkpointing often.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from skyspot.clouds.base import get

LARGE_ACCELERATORS = ("A100", "A100-80GB", "H100", "H100-MEGA", "H200", "B200")
_LABELS = {"cpu": "CPU nodes", "large": "large GPUs", "small": "small GPUs"}


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
    found = get(cloud)
    name = accelerator.partition(":")[0] if accelerator else None
    klass = "cpu" if not name else ("large" if name in LARGE_ACCELERATORS else "small")
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    hours = found.prior_node_hours[klass]
    per_node = hours * 3600
    return MtbpPrior(
        found.name,
        name,
        klass,
        num_nodes,
        per_node,
        per_node / num_nodes,
        f"skyspot prior ({found.name}, {_LABELS[klass]}: {hours:g} h per node), rough; see docs/planning.md",
    )
