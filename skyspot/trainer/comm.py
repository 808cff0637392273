"""The few collectives the trainer runs besides DeepSpeed's own.

`writer_exchange` runs on a dedicated gloo group, used only by the checkpoint writer threads:
their all-gathers then never interleave with the training loop's collectives on the default
group (collectives on one group must be issued in the same order on every rank, and a
background thread cannot promise that), and gloo works for CPU and GPU runs alike.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

WRITER_TIMEOUT = datetime.timedelta(minutes=30)


class Comm:
    def __init__(self) -> None:
        self.world_size = dist.get_world_size()
        # Every rank must create the group, in the same order.
        self._writer_group = dist.new_group(backend="gloo", timeout=WRITER_TIMEOUT)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def writer_exchange(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._writer_group)
        return out

    def broadcast_int(self, value: int, device) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.broadcast(t, src=0)
        return int(t.item())

    def barrier(self) -> None:
        dist.barrier()
