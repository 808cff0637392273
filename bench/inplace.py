"""Benchmark 9: a crashed rank's recovery, in place against a re-provisioned attempt.

Two runs of `tiny` on the local executor, 2 nodes x 1 CPU rank, each with the rank of node 1
SIGKILLed mid-step (`--crash-at-steps`) and `--provision-delay` set to a measured cloud figure
(PROVISION_S):

- in place: the default recipe (resilience.restarts_in_place=3): torchrun's agents restart every
  rank on the same machines, which resume from the newest local checkpoint;
- re-provisioned: resilience.restarts_in_place=0, as before in-place restarts: the node exits with
  the error, the executor "provisions" new machines (the delay) and a new attempt resumes.

Each figure is the time from the crash (the executor's `rank_crash_injected` event) to the next
completed step (global rank 0's next `step` event), from the run's own events.

    python -m bench --only inplace
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import _launch
from bench._launch import BIN, bench_env, ensure_shm_op, events
from bench.common import Figure, Results

# SkyPilot's own measurement of `sky launch` on Azure, one node, 5 runs: mean 349.8 s (issue 3695,
# https://github.com/skypilot-org/skypilot/issues/3695, "Speed up the provisioning of Azure"). A CPU VM;
# an 8-GPU VM boots a larger GPU image, so this is a lower bound for the one in docs/benchmarks.md.
PROVISION_S = 350.0
QUICK_PROVISION_S = 10.0  # --quick: the same two paths; the ratio's note projects it to PROVISION_S
CRASH_AT = 7
OVERRIDES = [
    "train.steps=16",
    "checkpoint.every_steps=2",
    "train.log_every=100",
    "resources.num_nodes=2",
    "resources.cpu_ranks=1",
]


def _run(name: str, home: Path, provision: float, extra: list[str], log: Path) -> float:
    command = [
        str(BIN / "skyspot"),
        "launch",
        "tiny",
        "--local",
        "-n",
        name,
        "--provision-delay",
        str(provision),
        "--crash-at-steps",
        f"{CRASH_AT}:1",
        *OVERRIDES,
        *extra,
    ]
    with open(log, "ab") as out:
        code = subprocess.run(
            command,
            cwd=_launch.REPO,
            env=bench_env(SKYSPOT_HOME=str(home)),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=provision + 600,
        ).returncode
    if code != 0:
        raise RuntimeError(f"{name}: launch exited {code} (log: {log})")
    run_dir = home / "runs" / name
    crash = [e for e in events(run_dir, "rank_crash_injected", rank=None)]
    if not crash:
        raise RuntimeError(f"{name}: no crash was injected")
    after = [e["ts"] for e in events(run_dir, "step", rank=0) if e["ts"] > crash[0]["ts"]]
    return min(after) - crash[0]["ts"]


def run(results: Results, quick: bool) -> None:
    ensure_shm_op(results)
    provision = QUICK_PROVISION_S if quick else PROVISION_S
    log = Path(tempfile.gettempdir()) / "skyspot-bench-inplace.log"
    log.write_bytes(b"")
    with tempfile.TemporaryDirectory(prefix="skyspot-bench-inplace-") as tmp:
        home = Path(tmp)
        started = time.time()
        in_place = _run("bench-in-place", home, provision, [], log)
        again = _run("bench-reprovisioned", home, provision, ["resilience.restarts_in_place=0"], log)
        print(
            f"   inplace: in place {in_place:.1f}s, re-provisioned {again:.1f}s ({time.time() - started:.0f}s)",
            file=sys.stderr,
            flush=True,
        )
    source = (
        "SkyPilot issue 3695's measured `sky launch` (Azure, mean of 5)"
        if not quick
        else f"--quick's {QUICK_PROVISION_S:g} s (the full run: {PROVISION_S:g} s)"
    )
    results.add(
        Figure(
            "inplace",
            "crash -> next step, restarted in place (2 nodes, tiny)",
            "s",
            [in_place],
            note="torchrun's agents restart every rank, resumed from the local checkpoint; "
            "includes the first restart's 5 s backoff",
        )
    )
    results.add(
        Figure(
            "inplace",
            f"crash -> next step, re-provisioned (--provision-delay {provision:g})",
            "s",
            [again],
            note=f"restarts_in_place=0; the delay is {source}",
        )
    )
    results.add(
        Figure(
            "inplace",
            "re-provisioned / in place",
            "x",
            [again / in_place],
            note=f"without the provisioning delay: {(again - provision) / in_place:.1f}x"
            + (
                ""
                if provision == PROVISION_S
                else f"; at {PROVISION_S:g} s: {(again - provision + PROVISION_S) / in_place:.1f}x"
            ),
        )
    )
