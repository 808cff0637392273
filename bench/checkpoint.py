"""Benchmarks 1 and 2: checkpoint stall and emergency checkpoint, for `tiny` and a state over 1 GB.

One torchrun worker per state size (bench/_ckpt_worker.py) measures, on the same engine and in
the same process: skyspot's stall (the loop's `CheckpointManager.save`), DeepSpeed's synchronous
`save_checkpoint` made durable (fsync), and the floor (one copy into existing buffers), round
after round; then a real emergency checkpoint (SIGTERM mid-step, the trainer's own loop) and
the run directory's write bandwidth.

Goals: stall <= 0.10x sync and <= 2x floor, from the second checkpoint on; emergency
signal -> commit <= 1.5x (bytes / write bandwidth) + 1 s.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench._launch import LARGE, LARGE_QUICK, ensure_shm_op, run_worker
from bench.common import Figure, Results

GOAL_VS_SYNC = 0.10
GOAL_VS_FLOOR = 2.0
# Notice windows (skyspot/trainer/notice/ cites the clouds' pages): GCP and Azure 30 s, AWS 120 s.
WINDOWS = {"GCP/Azure": 30.0, "AWS": 120.0}


def _mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def run(results: Results, quick: bool) -> None:
    ensure_shm_op(results)
    sizes = [("tiny", [], 2 if quick else 5), ("large", LARGE_QUICK if quick else LARGE, 2 if quick else 3)]
    for label, overrides, repeats in sizes:
        start = time.time()
        log = Path(tempfile.gettempdir()) / f"skyspot-bench-ckpt-{label}.log"
        with tempfile.TemporaryDirectory(prefix="skyspot-bench-ckpt-") as tmp:
            args = ["--run-dir", str(Path(tmp) / "run"), "--repeats", str(repeats), *overrides]
            out = run_worker("bench._ckpt_worker", args, timeout=900, log=log)
        print(f"   checkpoint {label}: {time.time() - start:.0f}s", file=sys.stderr, flush=True)
        report(results, label, out)


def report(results: Results, label: str, out: dict) -> None:
    rounds = out["rounds"]
    ours, sync, floor = rounds["skyspot"][1:], rounds["sync"][1:], rounds["floor"][1:]
    size = f"{label}, {out['params'] / 1e6:.1f}M params, {_mb(out['node_bytes'])}/node"
    vs_sync = [o / s for o, s in zip(ours, sync)]
    vs_floor = [o / f for o, f in zip(ours, floor)]
    write = statistics.median(rounds["write"][1:])
    results.add(
        Figure(
            "checkpoint",
            f"stall, skyspot ({size})",
            "s",
            ours,
            note=f"first checkpoint {rounds['skyspot'][0]:.3f} s (allocates the snapshot buffers); "
            f"background write + commit {write:.2f} s",
        )
    )
    results.add(Figure("checkpoint", f"sync save_checkpoint + fsync, DeepSpeed ({label})", "s", sync))
    results.add(
        Figure(
            "checkpoint",
            f"floor: copy into existing buffers ({label})",
            "s",
            floor,
            note=f"{_mb(out['state_bytes_rank0'])} on rank 0, "
            f"{out['state_bytes_rank0'] / statistics.median(floor) / 1e9:.1f} GB/s",
        )
    )
    m_sync, m_floor = statistics.median(vs_sync), statistics.median(vs_floor)
    why = ""
    if label == "tiny" and (m_sync > GOAL_VS_SYNC or m_floor > GOAL_VS_FLOOR):
        why = (
            "missed: at 1.6 MB DeepSpeed's fixed per-save work dominates both paths (ZeRO-3 releases and "
            "re-gathers its persistent parameters, one all-gather each: about 26 of every 40 ms; 3 barriers; "
            "copies the recovery scripts); the copy itself is under 1 ms. Profile: docs/benchmarks.md"
        )
    elif m_sync > GOAL_VS_SYNC or m_floor > GOAL_VS_FLOOR:
        why = "missed: see the stall figure; noisy machine or fixed DeepSpeed cost"
    results.add(
        Figure(
            "checkpoint",
            f"stall / sync ({label})",
            "x",
            vs_sync,
            goal=f"<= {GOAL_VS_SYNC}",
            met=m_sync <= GOAL_VS_SYNC,
            note=why,
        )
    )
    results.add(
        Figure(
            "checkpoint",
            f"stall / floor ({label})",
            "x",
            vs_floor,
            goal=f"<= {GOAL_VS_FLOOR:g}",
            met=m_floor <= GOAL_VS_FLOOR,
            note=why,
        )
    )

    e = out["emergency"]
    bps = out["write_bps"]
    nbytes = e["bytes"]
    floor_s = nbytes / bps
    goal_s = 1.5 * floor_s + 1.0
    total = e["signal_to_commit_seconds"]
    save = e["blocked_seconds"] + e["write_seconds"]
    inflight = max(0.0, total - save)
    fits = ", ".join(f"{name} {w:.0f} s: {'fits' if total <= w else 'DOES NOT FIT'}" for name, w in WINDOWS.items())
    why = (
        ""
        if total <= goal_s
        else (
            f"missed: {inflight:.1f} s of it is finishing the step in flight (a step takes "
            f"{e['typical_step_seconds']:.1f} s here); the save itself took {save:.1f} s"
        )
    )
    results.add(
        Figure(
            "checkpoint",
            f"emergency: signal -> committed ({size})",
            "s",
            [total],
            goal=f"<= 1.5x floor + 1 s = {goal_s:.2f} s",
            met=total <= goal_s,
            note=f"floor {floor_s:.3g} s ({_mb(nbytes)} at {bps / 1e6:.0f} MB/s write+fsync); "
            f"in-flight step {inflight:.2f} s, snapshot {e['blocked_seconds']:.2f} s, "
            f"write+commit {e['write_seconds']:.2f} s; {fits}" + (f"; {why}" if why else ""),
        )
    )
    if label == "large":
        # What fits a window at this bandwidth: the floor's rate, and skyspot's achieved write rate
        # after the fixed part (in-flight step, snapshot) measured above.
        achieved = nbytes / e["write_seconds"]
        rate = min(achieved, bps)
        fixed = inflight + e["blocked_seconds"]
        for name, window in WINDOWS.items():
            results.add(
                Figure(
                    "checkpoint",
                    f"largest state/node committed in {window:.0f} s ({name})",
                    "GB",
                    [max(0.0, (window - fixed)) * rate / 1e9],
                    note=f"(window - {fixed:.1f} s in-flight step and snapshot) x {rate / 1e6:.0f} MB/s, "
                    f"the lower of the disk's write+fsync ({bps / 1e6:.0f} MB/s) and skyspot's "
                    f"achieved write ({achieved / 1e6:.0f} MB/s, 2 ranks in parallel)",
                )
            )
