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
    return {
        "cloud": cloud.lower() if cloud != UNKNOWN else cloud,
        "region": label("region"),
        "zone": label("zone"),
        "instance_type": label("instance_type"),
        "spot": spot if isinstance(spot, bool) else UNKNOWN,
        "num_nodes": num_nodes,
    }


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


LAUNCHER_RANK_ENV = "SKYSPOT_LAUNCHER_RANK"
"""torchrun's own global rank for this worker, kept when pin_rank replaces RANK."""


def pin_rank(environ=os.environ) -> bool:
    """Make the global rank follow SkyPilot's node rank: RANK = node rank x local world size + local rank.

    Why: torchrun's c10d rendezvous (the one that restarts workers in place, task/render.py) numbers the
    nodes by sorting their descriptors (address, agent pid), not by --node_rank, which only the static
    rendezvous honours. A node's local checkpoint holds its own ranks' ZeRO shards and its events are
    named by its node rank, so the ranks must stay with the node: across restarts in place (the order
    holds while the agents live) and across attempts (new agents, a new order). torchrun's rank is kept
    in SKYSPOT_LAUNCHER_RANK: its rank 0 is the one torchrun told to host the workers' store
    (init_process_group below). True when RANK was changed."""
    if LAUNCHER_RANK_ENV in environ:
        return False
    pinned = _node_ordered_rank(environ)
    if pinned is None:
        return False
    environ[LAUNCHER_RANK_ENV] = environ.get("RANK", "0")
    environ["RANK"] = str(pinned)
    return True


def pinned_rank(environ: Mapping[str, str]) -> Optional[int]:
    """The global rank a worker started with `environ` (torchrun's) trains as: the node rank x local world
    size + local rank where pin_rank applies, else torchrun's RANK (None: not a worker). The node
    supervisor's watchdog numbers the workers it watches by this too, so that "global rank 0" is the
    rank that writes the steps, not whichever rank torchrun's rendezvous numbered 0."""
    pinned = None if LAUNCHER_RANK_ENV in environ else _node_ordered_rank(environ)
    if pinned is not None:
        return pinned
    return _int(environ, "RANK", 0) if "RANK" in environ else None


def _node_ordered_rank(environ: Mapping[str, str]) -> Optional[int]:
    """SkyPilot's node rank x local world size + local rank; None where torchrun's numbering stays (not
    under torchrun's agent, not on a SkyPilot node, or not SkyPilot's shape of equal nodes)."""
    if "GROUP_RANK" not in environ or "SKYPILOT_NODE_RANK" not in environ:
        return None
    local_world = max(1, _int(environ, "LOCAL_WORLD_SIZE", 1))
    nodes = max(1, _int(environ, "SKYPILOT_NUM_NODES", 1))
    if nodes * local_world != _int(environ, "WORLD_SIZE", 1):
        return None
    return _int(environ, "SKYPILOT_NODE_RANK", 0) * local_world + _int(environ, "LOCAL_RANK", 0)


def init_process_group(backend: str, timeout, environ=os.environ) -> None:
    """The default process group with the pinned ranks, on the store of this generation of workers.

    With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the rendered task sets it: torchrun's shared store keeps
    the previous generation's keys and a restarted group hangs in its first collective, pytorch issue
    135712) the worker torchrun numbered 0 hosts a new store at MASTER_ADDR:MASTER_PORT, which torchrun
    picked on that worker's node; env:// would have the pinned rank 0 host it, on another node maybe.
    Without pinning, DeepSpeed's own init (env://) is used."""
    import torch.distributed as dist

    launcher = environ.get(LAUNCHER_RANK_ENV)
    if launcher is None or dist.is_initialized():
        return
    shared = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the agent hosts it: every worker a client
    world = _int(environ, "WORLD_SIZE", 1)
    store = dist.TCPStore(
        environ["MASTER_ADDR"],
        int(environ["MASTER_PORT"]),
        world,
        is_master=not shared and launcher == "0",
        timeout=timeout,
        multi_tenant=True,
    )
    dist.init_process_group(backend, store=store, rank=_int(environ, "RANK", 0), world_size=world, timeout=timeout)
