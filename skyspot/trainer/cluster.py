"""Where this process runs, from SkyPilot's variables and torchrun's, and nothing executor-specific.

SkyPilot sets on every node: SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS (one per line),
SKYPILOT_NUM_NODES, SKYPILOT_NUM_GPUS_PER_NODE, SKYPILOT_TASK_ID and SKYPILOT_CLUSTER_INFO (JSON,
e.g. {"cluster_name": "c1", "cloud": "GCP", "region": "us-central1", "zone": "us-central1-a"}).
torchrun sets RANK, WORLD_SIZE and LOCAL_RANK for each worker. The local executor sets the same
SkyPilot variables, so one task runs unchanged under both executors.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from skyspot.attempts import UNKNOWN  # what `where` says for a fact it lacks; attempts.py reads it as missing


@dataclass(frozen=True)
class Placement:
    rank: int
    """Global rank (torchrun's RANK)."""
    world_size: int
    local_rank: int
    node_rank: int
    num_nodes: int
    node_ips: tuple[str, ...] = ()
    gpus_per_node: int = 0
    task_id: Optional[str] = None
    where: dict[str, Any] = field(default_factory=dict)
    """cloud, region, zone, instance_type, spot (from SKYPILOT_CLUSTER_INFO; "unknown" when absent)."""

    @property
    def local_world_size(self) -> int:
        return max(1, self.world_size // max(1, self.num_nodes))

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    @property
    def is_node_leader(self) -> bool:
        """Local rank 0: writes this node's manifest, marker, exit record, and watches for notices."""
        return self.local_rank == 0


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "").strip()
    try:
        return int(raw) if raw else default
    except ValueError:
        return default


def where_from_cluster_info(raw: Optional[str], num_nodes: int) -> dict[str, Any]:
    """Placement facts for events, from the SKYPILOT_CLUSTER_INFO JSON; "unknown" for what it lacks."""
    info: dict[str, Any] = {}
    if raw:
        try:
            parsed = json.loads(raw)
            info = parsed if isinstance(parsed, dict) else {}
        except ValueError:
            info = {}

    def label(key: str) -> str:
        value = info.get(key)
        return str(value) if isinstance(value, (str, int, float)) and value != "" else UNKNOWN

    cloud = label("cloud")
    spot = info.get("use_spot", info.get("spot"))
    return {"cloud": cloud.lower() if cloud != UNKNOWN else cloud, "region": label("region"),
            "zone": label("zone"), "instance_type": label("instance_type"),
            "spot": spot if isinstance(spot, bool) else UNKNOWN, "num_nodes": num_nodes}


def from_environment(environ: Mapping[str, str] = os.environ) -> Placement:
    num_nodes = max(1, _int(environ, "SKYPILOT_NUM_NODES", 1))
    ips = tuple(ip.strip() for ip in environ.get("SKYPILOT_NODE_IPS", "").splitlines() if ip.strip())
    return Placement(
        rank=_int(environ, "RANK", 0),
        world_size=max(1, _int(environ, "WORLD_SIZE", 1)),
        local_rank=_int(environ, "LOCAL_RANK", 0),
        node_rank=_int(environ, "SKYPILOT_NODE_RANK", 0),
        num_nodes=num_nodes,
        node_ips=ips,
        gpus_per_node=_int(environ, "SKYPILOT_NUM_GPUS_PER_NODE", 0),
        task_id=environ.get("SKYPILOT_TASK_ID") or None,
        where=where_from_cluster_info(environ.get("SKYPILOT_CLUSTER_INFO"), num_nodes),
    )


def run_id(run_name: Optional[str], run_dir: str | os.PathLike, environ: Mapping[str, str] = os.environ) -> str:
    """--run-name, else SKYSPOT_RUN_NAME, else SKYPILOT_TASK_ID, else the run directory's name."""
    for candidate in (run_name, environ.get("SKYSPOT_RUN_NAME"), environ.get("SKYPILOT_TASK_ID")):
        if candidate and candidate.strip():
            return candidate.strip()
    return Path(run_dir).resolve().name
