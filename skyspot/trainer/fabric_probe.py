"""The fabric probe: at every start, after the rendezvous and before the model is built, every rank
all-reduces one buffer of a fixed size a few times, and the start knows what its fabric carries.

Measured as nccl-tests measures it (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
warm-up iterations first, then timed ones; the time of one operation is the slowest rank's average
(nccl-tests reduces its time across ranks with a max); algorithm bandwidth algbw = size / time, and the
bus bandwidth of an all-reduce busbw = algbw x 2(n-1)/n, n the number of ranks, the figure that compares
with the hardware's peak whatever n is. clouds/fabric_rates.py holds what each instance type's fabric
should carry and judges the figure; trainer/fabric.py puts both in the `fabric` event.

The size is the recipe's `fabric.probe_mib`, by default 256 MiB on GPUs (NCCL) and 4 MiB on CPU ranks
(gloo): large enough on a real fabric to be near its plateau rather than its latency, small enough that
one buffer is nothing beside a model. How many timed iterations follows from the warm-up: as many as fit
in BUDGET_S (at most MAX_ITERS, at least one), decided from the slowest rank's warm-up so every rank
issues the same collectives. On a healthy fabric the probe takes well under a second; on sockets a few.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

MIB = 1024 * 1024
DEFAULT_MIB = {"nccl": 256, "gloo": 4}
"""The probe's buffer by backend, when the recipe does not set fabric.probe_mib."""
WARMUP_ITERS = 2
MAX_ITERS = 20
BUDGET_S = 3.0
"""Ours: the timed iterations' share of a start (a few seconds at most, even on sockets)."""


def bus_bandwidth(size_bytes: float, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes per second for one all-reduce of `size_bytes` taking `seconds` on
    `world_size` ranks (nccl-tests: busbw = algbw x 2(n-1)/n; 0 for one rank, where nothing moves)."""
    if seconds <= 0 or world_size < 1:
        raise ValueError(f"an all-reduce takes a positive time on at least one rank, got {seconds} s, {world_size}")
    algbw = size_bytes / seconds
    return algbw, algbw * 2 * (world_size - 1) / world_size


def timed_iterations(warmup_seconds_each: float, budget_s: float = BUDGET_S, most: int = MAX_ITERS) -> int:
    """How many timed all-reduces fit in `budget_s`, given one warm-up's time (at least one, at most `most`)."""
    if warmup_seconds_each <= 0 or not math.isfinite(warmup_seconds_each):
        return most
    return max(1, min(most, int(budget_s / warmup_seconds_each)))


def probe_bytes(probe_mib: Optional[int], backend: str) -> int:
    """The probe's buffer in bytes: the recipe's, else the backend's default; a multiple of 4 (float32)."""
    mib = DEFAULT_MIB.get(backend, DEFAULT_MIB["gloo"]) if probe_mib is None else probe_mib
    return int(mib * MIB) // 4 * 4


@dataclass(frozen=True)
class ProbeResult:
    size_bytes: int
    iters: int
    seconds: float
    """One all-reduce, the slowest rank's average over the timed iterations."""
    algbw_gbps: float
    busbw_gbps: float
    """GB/s (10^9 bytes per second), as nccl-tests prints them."""
    world_size: int

    def fields(self) -> dict[str, Any]:
        """The `fabric` event's probe fields."""
        out = asdict(self)
        return {
            "busbw_gbps": round(out["busbw_gbps"], 3),
            "algbw_gbps": round(out["algbw_gbps"], 3),
            "probe_bytes": out["size_bytes"],
            "probe_iters": out["iters"],
            "probe_seconds": round(out["seconds"], 6),
            "probe_world_size": out["world_size"],
        }


def result(size_bytes: int, iters: int, seconds: float, world_size: int) -> ProbeResult:
    algbw, busbw = bus_bandwidth(size_bytes, seconds, world_size)
    return ProbeResult(size_bytes, iters, seconds, algbw / 1e9, busbw / 1e9, world_size)


def measure(
    size_bytes: int, device, *, warmup: int = WARMUP_ITERS, budget_s: float = BUDGET_S, most: int = MAX_ITERS
) -> Optional[ProbeResult]:
    """The probe, on every rank of the default process group (a collective: every rank calls it with the
    same arguments). None for a world of one, or a size of 0."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    if world < 2 or size_bytes <= 0:
        return None
    buffer = torch.zeros(size_bytes // 4, dtype=torch.float32, device=device)
    clock = torch.zeros(1, dtype=torch.float64, device=device)
    on_gpu = buffer.is_cuda

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize(clock.device)

    def slowest(seconds: float) -> float:
        clock.fill_(seconds)
        dist.all_reduce(clock, op=dist.ReduceOp.MAX)
        return float(clock.item())

    try:
        dist.barrier()
        began = time.perf_counter()
        for _ in range(max(1, warmup)):
            dist.all_reduce(buffer)
        sync()
        iters = timed_iterations(slowest((time.perf_counter() - began) / max(1, warmup)), budget_s, most)
        dist.barrier()
        began = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buffer)
        sync()
        seconds = slowest((time.perf_counter() - began) / iters)
    finally:
        del buffer
        if on_gpu:
            torch.cuda.empty_cache()  # the model gets the memory back
    return result(size_bytes, iters, seconds, world)
