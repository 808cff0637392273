"""The fabric probe's arithmetic (trainer/fabric_probe.py) as nccl-tests does it, and one real gloo probe
between two processes on this machine."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from skyspot.ports import free_port
from skyspot.trainer import fabric_probe
from skyspot.trainer.fabric_probe import MIB, bus_bandwidth, probe_bytes, timed_iterations


def test_bus_bandwidth_is_algbw_times_two_n_minus_one_over_n():
    # nccl-tests PERFORMANCE.md: all-reduce busbw = algbw * 2(n-1)/n.
    assert bus_bandwidth(1e9, 0.1, 2) == (1e10, 1e10)
    algbw, busbw = bus_bandwidth(256 * MIB, 0.01, 16)
    assert algbw == pytest.approx(256 * MIB / 0.01) and busbw == pytest.approx(algbw * 30 / 16)
    assert bus_bandwidth(1e6, 1.0, 1) == (1e6, 0.0)  # one rank moves nothing
    with pytest.raises(ValueError):
        bus_bandwidth(1e6, 0.0, 2)


def test_the_timed_iterations_fit_the_budget_and_every_rank_would_pick_the_same():
    assert timed_iterations(0.001) == fabric_probe.MAX_ITERS  # a fast fabric: all of them
    assert timed_iterations(1.0, budget_s=3.0) == 3  # sockets: what fits in the budget
    assert timed_iterations(10.0) == 1  # at least one
    assert timed_iterations(0.0) == fabric_probe.MAX_ITERS


def test_the_size_is_the_recipes_else_the_backends_default():
    assert probe_bytes(None, "nccl") == 256 * MIB and probe_bytes(None, "gloo") == 4 * MIB
    assert probe_bytes(1, "nccl") == MIB and probe_bytes(0, "gloo") == 0


def _rank(rank: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        queue.put((rank, fabric_probe.measure(1 * MIB, torch.device("cpu"))))
    finally:
        dist.destroy_process_group()


def test_a_real_gloo_probe_between_two_processes_measures_a_positive_bus_bandwidth():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    a, b = results[0], results[1]
    assert a.busbw_gbps > 0 and a.size_bytes == MIB and a.world_size == 2
    # Every rank reports the slowest rank's time and the same iteration count: the same figure everywhere.
    assert (a.iters, a.seconds, a.busbw_gbps) == (b.iters, b.seconds, b.busbw_gbps)
    assert a.busbw_gbps == pytest.approx(a.algbw_gbps)  # 2(n-1)/n is 1 for two ranks
