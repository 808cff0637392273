"""Which transport NCCL chose between nodes, recorded at start: the `fabric` event.

`network_tier: best` asks SkyPilot for EFA, GPUDirect-TCPX or InfiniBand (docs/clouds.md, "The
fabric"), but whether NCCL uses it is decided on the node, by NCCL, from what the image has. So the
node leader has NCCL say it: before the process group exists, `prepare` sets

    NCCL_DEBUG=INFO  NCCL_DEBUG_SUBSYS=INIT,NET  NCCL_DEBUG_FILE=<run dir>/nccl/nccl.%h.%p.log

for that process only (the other ranks keep NCCL's default), unless the task set NCCL_DEBUG or
NCCL_DEBUG_FILE itself. After the first collective, `record` reads NCCL's own line (src/init.cc,
`INFO(NCCL_INIT, "Using network %s", ...)`, unchanged from 2.x to now):

    Using network IB                 ib      InfiniBand verbs (Azure ND, RoCE shows as roce)
    Using network Socket             socket  plain TCP: what a multi-node run must not be on
    Using network AWS Libfabric      ofi     the aws-ofi-nccl plugin (EFA; `Libfabric` in newer ones)
    Using network GPUDirectTCPX      tcpx    GCP a3-highgpu's plugin (FasTrak: tcpxo, a3-mega)

and `.../GDRDMA` on a channel line means GPUDirect RDMA. Without the file (the task chose its own
NCCL_DEBUG), the transport comes from the NCCL_* variables the task set, or is `unknown`. With gloo
(CPU training) it is `gloo`.

The event also carries the fabric probe's figures (trainer/fabric_probe.py: `busbw_gbps`, `algbw_gbps`,
`probe_bytes`, `probe_iters`, `probe_seconds`), what the node's instance type should carry
(clouds/fabric_rates.py: `expected_gbps`, `expected`, `expected_source`) and the judgment of the two
(`on_sockets`, `below_expected`, `require`). The log says it in one line. A multi-node start on plain TCP or
below the fraction is warned about, in the log and the event (`warning`); with `fabric.require: best` the
returned fields carry `refused`, the one line the start refuses with (loop.setup raises it on every rank).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping, MutableMapping, Optional

from skyspot.clouds.fabric_rates import expected_for, judge

LOG_DIR = "nccl"
LOG_PATTERN = "nccl.%h.%p.log"  # NCCL expands %h (host name) and %p (pid) itself

# The variables that steer NCCL's choice, recorded with it (none holds a secret).
ENV_KEYS = (
    "NCCL_NET",
    "NCCL_NET_PLUGIN",
    "NCCL_IB_DISABLE",
    "NCCL_IB_HCA",
    "NCCL_SOCKET_IFNAME",
    "NCCL_NET_GDR_LEVEL",
    "FI_PROVIDER",
    "FI_EFA_USE_DEVICE_RDMA",
    "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME",
)

_USING = re.compile(r"NCCL INFO Using network (.+?)\s*$", re.MULTILINE)
_ROCE = re.compile(r"NET/IB : Using .*/RoCE")
_EFA = re.compile(r"NET/OFI Selected [Pp]rovider is efa")
_NETWORKS = (  # (substring of NCCL's network name, lower case) -> transport word
    ("gpudirecttcpx", "tcpx"),
    ("fastrak", "tcpxo"),
    ("tcpxo", "tcpxo"),
    ("libfabric", "ofi"),
    ("ofi", "ofi"),
    ("socket", "socket"),
    ("ib", "ib"),
)


def prepare(
    run_dir: Path, *, backend: str, node_leader: bool, environ: MutableMapping[str, str] = os.environ
) -> Optional[Path]:
    """Before init_process_group: have this process's NCCL write its INIT/NET lines to a file; the
    directory it writes in, or None (not NCCL, not the node leader, or the task set NCCL_DEBUG)."""
    if backend != "nccl" or not node_leader or environ.get("NCCL_DEBUG") or environ.get("NCCL_DEBUG_FILE"):
        return None
    directory = Path(run_dir) / LOG_DIR
    directory.mkdir(parents=True, exist_ok=True)
    environ["NCCL_DEBUG"] = "INFO"
    environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
    environ["NCCL_DEBUG_FILE"] = str(directory / LOG_PATTERN)
    return directory


def from_log(text: str) -> dict[str, Any]:
    """{network: NCCL's name, transport: our word, gdr: GPUDirect RDMA seen} from NCCL INFO lines."""
    match = _USING.search(text)
    if match is None:
        return {"network": None, "transport": "unknown", "gdr": False}
    network = match.group(1)
    transport = _transport(network)
    if transport == "ib" and _ROCE.search(text):
        transport = "roce"
    if transport == "ofi" and _EFA.search(text):
        network += " (efa)"
    return {"network": network, "transport": transport, "gdr": "/GDRDMA" in text}


def _transport(network: str) -> str:
    name = network.strip().lower()
    for part, word in _NETWORKS:
        if part == "ib" and name != "ib":
            continue  # "ib" alone; not a substring of another plugin's name
        if part in name:
            return word
    return name or "unknown"


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    forced = environ.get("NCCL_NET", "").strip()
    if forced:
        return {"network": forced, "transport": _transport(forced), "gdr": False}
    return {"network": None, "transport": "unknown", "gdr": False}


def record(
    log_dir: Optional[Path],
    *,
    backend: str,
    num_nodes: int,
    events=None,
    environ: Mapping[str, str] = os.environ,
    pid: Optional[int] = None,
    say: Callable[[str], None] = print,
    probe: Optional[Mapping[str, Any]] = None,
    where: Optional[Mapping[str, Any]] = None,
    require: str = "warn",
) -> dict[str, Any]:
    """After the first collective and the probe (node leader): the `fabric` event, its one line in the log,
    and a warning for a multi-node run on sockets or below its instance type's figure. `probe`: the probe's
    fields (fabric_probe.ProbeResult.fields), `where`: the node's placement (its instance type and cloud).
    Returns the event's fields (with `refused` when `require` is `best` and the fabric is short)."""
    env = {k: environ[k] for k in ENV_KEYS if environ.get(k)}
    if backend != "nccl":
        fields: dict[str, Any] = {"network": None, "transport": backend, "gdr": False, "source": "backend"}
    elif log_dir is not None:
        text = _read_log(log_dir, os.getpid() if pid is None else pid)
        fields = {
            **(from_log(text) if text else _from_env(environ)),
            "source": "nccl log" if text else "env",
            "log": str(log_dir),
        }
    else:
        fields = {**_from_env(environ), "source": "env"}
    fields.update(backend=backend, num_nodes=num_nodes, env=env, **dict(probe or {}))
    where = where or {}
    instance_type = where.get("instance_type")
    rate = expected_for(instance_type if instance_type not in (None, "", "unknown") else None, where.get("cloud"))
    verdict = judge(
        busbw_gbps=fields.get("busbw_gbps"), transport=fields["transport"], num_nodes=num_nodes, expected=rate
    )
    fields.update(
        instance_type=instance_type,
        expected_gbps=verdict.expected_gbps,
        expected=rate.text if rate is not None and num_nodes > 1 else None,
        expected_source=rate.source if rate is not None and num_nodes > 1 else None,
        on_sockets=verdict.on_sockets,
        below_expected=verdict.below_expected,
        require=require,
    )
    say(summary_line(fields))
    if verdict.warns:
        advice = (
            "ZeRO-3's traffic will dominate each step. Ask for `resources.network_tier: best` on a cloud that "
            'has a fast fabric (docs/clouds.md, "The fabric")'
            if verdict.on_sockets
            else 'Check what the node\'s fabric got (docs/clouds.md, "The fabric probe")'
        )
        fields["warning"] = f"{verdict.line}. {advice}"
    if verdict.short and require == "best":
        fields["refused"] = (
            f"fabric.require=best: {verdict.line}; refusing to start (fabric.require=warn trains on it with a warning)"
        )
    elif "warning" in fields:
        say(f"warning: {fields['warning']}")
    if events is not None:
        events.emit("fabric", **fields)
    return fields


def summary_line(fields: Mapping[str, Any]) -> str:
    """The log's one line: transport, the probe's bus bandwidth, size and iterations, the expected figure."""
    parts = [
        f"fabric: {fields.get('num_nodes')} node(s) on {fields.get('transport')}"
        + (f" ({fields['network']})" if fields.get("network") else "")
    ]
    if isinstance(fields.get("busbw_gbps"), (int, float)):
        parts.append(
            f"all-reduce of {fields['probe_bytes'] / (1 << 20):g} MiB x {fields.get('probe_iters')}: bus "
            f"bandwidth {fields['busbw_gbps']:.2f} GB/s"
        )
    else:
        parts.append("not probed")
    if fields.get("expected_gbps") is not None:
        parts.append(
            f"expected {fields['expected_gbps']:g} GB/s ({fields.get('expected')})"
            + (" BELOW" if fields.get("below_expected") else "")
        )
    return "; ".join(parts)


def _read_log(log_dir: Path, pid: int) -> str:
    """This process's NCCL log (NCCL truncates the host name at its first dot, hence the glob)."""
    for path in sorted(Path(log_dir).glob(f"nccl.*.{pid}.log")):
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""
    return ""
