"""Refuse, never fall back: a node that was given GPUs trains on them or not at all.

    python -m skyspot.trainer.prepare        # setup: require_cuda() first (SKYPILOT_SETUP_NUM_GPUS_PER_NODE)
    python -m skyspot.trainer ...            # every rank: require_cuda() before anything else

When torch cannot use CUDA (no driver, a driver older than the CUDA line torch was built for, a CPU
build of torch), DeepSpeed quietly picks its CPU accelerator and the trainer would run gloo on the
CPU with one rank per GPU while the GPUs bill. So on a node where SkyPilot says there are GPUs
(SKYPILOT_NUM_GPUS_PER_NODE in `run`, SKYPILOT_SETUP_NUM_GPUS_PER_NODE in `setup`, sky/skylet/
constants.py), CUDA not available, or fewer devices than the node's ranks, is a UsageError (exit 2)
whose one line names what was found: the driver's version (nvidia-smi), the CUDA line torch was
built for, and the devices torch sees. It is checked before the run directory gets anything but
the exit record, and before DeepSpeed is imported (which would pick its accelerator).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from typing import Mapping, Optional

from skyspot.errors import UsageError

# SkyPilot's names: the run's, and setup's own (setup does not get the run's variable).
GPUS_ENV = ("SKYPILOT_NUM_GPUS_PER_NODE", "SKYPILOT_SETUP_NUM_GPUS_PER_NODE")


def gpus_per_node(environ: Mapping[str, str] = os.environ) -> int:
    """How many GPUs SkyPilot gave this node (0 when none, or not on a SkyPilot node)."""
    for name in GPUS_ENV:
        raw = environ.get(name, "").strip()
        if raw:
            try:
                return max(0, int(float(raw)))  # SkyPilot writes an int; a fraction of a GPU counts as one
            except ValueError:
                continue
    return 0


def driver_version(timeout: float = 10.0) -> str:
    """The NVIDIA driver's version as nvidia-smi reports it, or why there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no NVIDIA driver (no nvidia-smi)"
    try:
        done = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"NVIDIA driver unknown (nvidia-smi: {type(err).__name__})"
    versions = sorted({line.strip() for line in done.stdout.splitlines() if line.strip()})
    if done.returncode != 0 or not versions:
        first = (done.stdout + done.stderr).strip().splitlines()
        return f"NVIDIA driver not answering (nvidia-smi: {first[0] if first else f'exit {done.returncode}'})"
    return f"NVIDIA driver {', '.join(versions)}"


def problem(
    need: int, *, available: bool, devices: int, torch_version: str, cuda: Optional[str], driver: str, source: str
) -> Optional[str]:
    """The one line that refuses the node, or None when CUDA can serve `need` ranks. Pure."""
    if available and devices >= need:
        return None
    built = f"torch {torch_version} built for CUDA {cuda}" if cuda else f"torch {torch_version} built without CUDA"
    seen = f"sees {devices} CUDA device{'' if devices == 1 else 's'}" if available else "cannot use CUDA"
    fix = (
        f"use an image whose driver supports CUDA {cuda}, or a torch build for this driver"
        if cuda
        else "install a CUDA build of torch"
    )
    return (
        f"this node has GPUs for {need} rank{'' if need == 1 else 's'} ({source}) but {built} {seen} "
        f"({driver}); refusing to train on the CPU: {fix}"
    )


def require_cuda(local_ranks: Optional[int] = None, environ: Mapping[str, str] = os.environ) -> int:
    """Raise UsageError (one line) when this node has GPUs but torch cannot use enough of them.

    `local_ranks`: the ranks this node runs (torchrun's LOCAL_WORLD_SIZE); default, one per GPU.
    Returns the number of GPUs SkyPilot gave the node (0: nothing to check).
    """
    gpus = gpus_per_node(environ)
    if gpus <= 0:
        return 0
    import torch

    need = local_ranks if local_ranks and local_ranks > 0 else gpus
    with warnings.catch_warnings():  # "the NVIDIA driver on your system is too old": said in our line instead
        warnings.simplefilter("ignore")
        available = bool(torch.cuda.is_available())
        devices = torch.cuda.device_count() if available else 0
    source = next(f"{name}={environ[name].strip()}" for name in GPUS_ENV if environ.get(name, "").strip())
    line = problem(
        need,
        available=available,
        devices=devices,
        torch_version=torch.__version__,
        cuda=torch.version.cuda,
        driver=driver_version() if devices < need else "",
        source=source,
    )
    if line is not None:
        raise UsageError(line)
    return gpus
