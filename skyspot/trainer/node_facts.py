"""What this node is, as the process that trains on it sees it: the `node` event.

The trainer's node leader emits it at every start (every node, every attempt, after the instance
metadata is read), and `prepare` prints the same facts in one line at the end of setup, so the
first real run says exactly what it ran on:

    image        the image id the cloud's metadata names (AWS ami-id, GCP instance/image, Azure
                 storageProfile.imageReference; trainer/instance.py), or None off a cloud
    python       the interpreter (path, version), its environment (prefix; `venv`: skyspot's own,
                 node_env.py) and how setup got it (`origin`: the image's, uv's managed)
    driver       the NVIDIA driver (nvidia-smi), None without one
    torch        torch's version and CUDA line (`cu126`, `pypi` for PyPI's own CUDA build, `cpu`)
    nccl         NCCL's version as torch reports it and the file this process loaded (from
                 /proc/self/maps): torch's own, unless LD_LIBRARY_PATH put another first (libpath.py)
    gpus         the devices torch sees (count, names)
    fabric       EFA and InfiniBand devices (/sys/class/infiniband, by driver), GCP's TCPX plugin
    nvme         what setup did with the local NVMe (trainer/local_disk.py's record), if it ran
    setup        where setup installed from and which wheelhouse (node_env.py's record in the venv)

Everything is read locally and cheaply; nothing here can fail a start (a fact it cannot read is None).
`kind` is what `cost-report` groups nodes by: the facts that make two nodes the same machine.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any, Mapping, Optional

INFINIBAND = Path("/sys/class/infiniband")
TCPX_PLUGIN = Path("/usr/local/tcpx/lib64/libnccl-net.so")  # SkyPilot's TCPX example (task/render.py)


def loaded_library(prefix: str, maps: Path = Path("/proc/self/maps")) -> Optional[str]:
    """The file of the first mapped library whose name starts with `prefix` (e.g. 'libnccl'), None if none."""
    try:
        for line in maps.read_text().splitlines():
            path = line.split(None, 5)[-1] if line.count(" ") >= 5 else ""
            if path.startswith("/") and os.path.basename(path).startswith(prefix + "."):
                return path
    except OSError:
        pass
    return None


def cuda_line(version: str, cuda: Optional[str]) -> str:
    """torch's CUDA line from its version: '2.13.0+cu126' -> cu126; PyPI's CUDA build -> pypi; else cpu."""
    local = version.partition("+")[2]
    if local:
        return local
    return "pypi" if cuda else "cpu"


def torch_facts() -> dict[str, Any]:
    import torch
    import torch.distributed  # noqa: F401 - what the trainer loads: NCCL comes with torch's CUDA libraries

    facts: dict[str, Any] = {
        "torch": {
            "version": torch.__version__,
            "cuda": torch.version.cuda,
            "line": cuda_line(torch.__version__, torch.version.cuda),
        }
    }
    nccl: dict[str, Any] = {"version": None, "library": loaded_library("libnccl")}
    try:
        version = torch.cuda.nccl.version()
        nccl["version"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception:  # noqa: BLE001 - a CPU build has no NCCL: the fact is None
        pass
    facts["nccl"] = nccl if nccl["version"] or nccl["library"] else None
    gpus: dict[str, Any] = {"count": 0, "names": []}
    try:
        if torch.cuda.is_available():
            gpus["count"] = torch.cuda.device_count()
            gpus["names"] = sorted({torch.cuda.get_device_name(i) for i in range(gpus["count"])})
    except Exception:  # noqa: BLE001
        pass
    facts["gpus"] = gpus
    return facts


def fabric_devices(root: Path = INFINIBAND) -> dict[str, Any]:
    """RDMA devices by kind (EFA: the `efa` driver; InfiniBand: the rest) and whether TCPX's plugin is there."""
    efa, infiniband = [], []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        names = []
    for name in names:
        try:
            driver = os.path.basename(os.readlink(root / name / "device" / "driver"))
        except OSError:
            driver = ""
        (efa if driver == "efa" or name.startswith("efa") else infiniband).append(name)
    return {"efa": efa, "infiniband": infiniband, "tcpx": TCPX_PLUGIN.exists()}


def _record(path: Path) -> Optional[dict]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def collect(
    environ: Mapping[str, str] = os.environ,
    *,
    instance: Optional[Mapping[str, Any]] = None,
    run_dir: Optional[Path] = None,
) -> dict[str, Any]:
    """The node's facts (see the module's docstring); `instance` is what trainer/instance.py read."""
    from skyspot.node_host import INSTALLED, driver_version, venv_path
    from skyspot.trainer.local_disk import RECORD

    setup = _record(Path(sys.prefix) / INSTALLED)
    in_own = os.path.realpath(sys.prefix) == os.path.realpath(str(venv_path(environ)))
    facts: dict[str, Any] = {
        "image": (instance or {}).get("image"),
        "instance_type": (instance or {}).get("instance_type"),
        "python": {
            "path": sys.executable,
            "version": platform.python_version(),
            "prefix": sys.prefix,
            "venv": "skyspot" if in_own else ("other" if sys.prefix != sys.base_prefix else None),
            "origin": (setup or {}).get("python_origin"),
        },
        "driver": driver_version(),
    }
    facts.update(torch_facts())
    facts["fabric"] = fabric_devices()
    disk = _record(Path(run_dir).parent / RECORD) if run_dir is not None else None
    facts["nvme"] = None if disk is None else {k: disk.get(k) for k in ("used", "mountpoint", "devices", "reason")}
    facts["setup"] = None if setup is None else {k: setup.get(k) for k in ("source", "key", "cuda_line")}
    facts["kind"] = kind(facts)
    return facts


def kind(facts: Mapping[str, Any]) -> str:
    """One line that is the same for two nodes of the same kind: instance, image, Python, driver, torch, NCCL,
    GPUs, fabric."""
    python = facts.get("python") or {}
    torch = facts.get("torch") or {}
    nccl = facts.get("nccl") or {}
    gpus = facts.get("gpus") or {}
    fabric = facts.get("fabric") or {}
    parts = [
        facts.get("instance_type") or "unknown instance",
        f"image {facts.get('image') or 'unknown'}",
        f"python {python.get('version')}" + (" (skyspot venv)" if python.get("venv") == "skyspot" else ""),
        f"driver {facts.get('driver') or 'none'}",
        f"torch {torch.get('version')}",
        f"nccl {nccl.get('version') or '-'}"
        + (
            " (torch's own)"
            if _torchs_own(nccl.get("library"))
            else f" ({nccl['library']})"
            if nccl.get("library")
            else ""
        ),
        f"{gpus.get('count') or 0} GPU" + (f" {'/'.join(gpus['names'])}" if gpus.get("names") else ""),
        _fabric_text(fabric),
    ]
    return ", ".join(parts)


def _torchs_own(library: Optional[str]) -> bool:
    """A libnccl from the nvidia-nccl wheel torch depends on (site-packages/nvidia/nccl/lib)."""
    return bool(library) and re.search(r"/site-packages/nvidia/nccl[^/]*/lib/", library) is not None


def _fabric_text(fabric: Mapping[str, Any]) -> str:
    bits = []
    if fabric.get("efa"):
        bits.append(f"{len(fabric['efa'])} EFA")
    if fabric.get("infiniband"):
        bits.append(f"{len(fabric['infiniband'])} IB")
    if fabric.get("tcpx"):
        bits.append("TCPX")
    return "fabric " + ("+".join(bits) if bits else "tcp")


def summary_line(facts: Mapping[str, Any]) -> str:
    """What `prepare` prints at the end of setup."""
    nccl = facts.get("nccl") or {}
    where = f"; NCCL loaded from {nccl['library']}" if nccl.get("library") else ""
    return f"node: {facts['kind']}{where}"
