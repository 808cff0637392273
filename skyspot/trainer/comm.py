"""The few collectives the trainer runs besides DeepSpeed's own.

`writer_exchange` runs on a dedicated gloo group, used only by the checkpoint writer threads:
their all-gathers then never interleave with the training loop's collectives on the default
group (collectives on one group must be issued in the same order on every rank, and a
background thread cannot promise that), and gloo works for CPU and GPU runs alike.

`io_gather` and `io_barrier` are where ranks wait while some rank does I/O of unbounded length: the
store probe, a node leader fetching the base model or its checkpoint part, reading a bucket data
file, the emergency upload, rank 0 writing final/. They run on a gloo group of their own whose
timeout fits that work (SKYSPOT_IO_TIMEOUT_SECONDS, else the recipe's I/O plan: at least 2 h, 141 GB at
20 MB/s; skyspot/start_bounds.py, which gives the watchdog's first-step bound too), never inside the
default group: its timeout (SKYSPOT_DIST_TIMEOUT_SECONDS, 600 s on a cloud) is meant to fail a lost
node fast, and with NCCL's async error handling it aborts every rank when it expires. A peer that
dies still ends a gloo wait at once (its connections close); only a peer alive but stuck waits the
whole timeout.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from skyspot.start_bounds import IO_TIMEOUT_S

WRITER_TIMEOUT = datetime.timedelta(minutes=30)
IO_TIMEOUT_ENV = "SKYSPOT_IO_TIMEOUT_SECONDS"


def io_timeout(environ=os.environ, planned: float = IO_TIMEOUT_S) -> datetime.timedelta:
    """How long ranks wait for one rank's I/O: SKYSPOT_IO_TIMEOUT_SECONDS, else `planned` (the recipe's
    I/O plan, start_bounds.StartBounds.io_seconds; default 2 h)."""
    raw = environ.get(IO_TIMEOUT_ENV, "").strip()
    try:
        seconds = float(raw) if raw else planned
    except ValueError:
        seconds = planned
    return datetime.timedelta(seconds=seconds if seconds > 0 else planned)


class Comm:
    def __init__(self, io_seconds: float = IO_TIMEOUT_S) -> None:
        self.world_size = dist.get_world_size()
        # Every rank must create the group, in the same order.
        self._writer_group = dist.new_group(backend="gloo", timeout=WRITER_TIMEOUT)
        self._io_group = dist.new_group(backend="gloo", timeout=io_timeout(planned=io_seconds))

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def writer_exchange(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._writer_group)
        return out

    def io_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, waiting as long as one rank's I/O may take (not the default group's timeout)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._io_group)
        return out

    def io_barrier(self) -> None:
        """Wait for every rank, as long as one rank's I/O may take (writing and uploading final/, say)."""
        dist.barrier(group=self._io_group)

    def broadcast_int(self, value: int, device) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.broadcast(t, src=0)
        return int(t.item())

    def barrier(self) -> None:
        dist.barrier()
