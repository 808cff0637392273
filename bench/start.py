"""Benchmark 15: what a start costs. Every preemption, restart in place and new attempt starts every rank
again, so a start's CPU is paid once per recovery on every node (and, on 2 cores, per fault of a soak).

- Imports, A/B in one run (alternating): a rank's imports as they were (`import deepspeed`, the Muon
  module ZeRO imports, transformers' Llama) against lean_imports.import_deepspeed() and the same others:
  CPU seconds of a fresh interpreter (its rusage, by os.wait4), with mlflow installed as on the node of a
  recipe with an mlflow dashboard (DeepSpeed's autotuner imports it wherever it is).
- One start as a node runs it (supervise -- torchrun, 2 ranks of `tiny`, 24 steps, a checkpoint each
  step to a local-directory store): the CPU seconds of the whole process tree, and the wall time to the
  first step and to the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import _launch
from bench._launch import bench_env, ensure_shm_op, events, trainer_command
from bench.common import Figure, Results

BEFORE = "import deepspeed, deepspeed.runtime.zero.muon.muon_optimizer; from transformers import LlamaForCausalLM"
LEAN = (
    "from skyspot.trainer.lean_imports import import_deepspeed; import_deepspeed(); "
    "import deepspeed.runtime.zero.muon.muon_optimizer; from transformers import LlamaForCausalLM"
)
STEPS = 24


def _cpu(command: list[str], env: dict, timeout: float = 600) -> tuple[float, float]:
    """(CPU seconds of the command and every child it waited for, wall seconds); raises on failure or
    past `timeout` (the command's process group killed). Its output goes to a file: a pipe nobody reads
    while os.wait4 waits would stall it once full."""
    with tempfile.TemporaryFile() as output:
        began = time.perf_counter()
        proc = subprocess.Popen(
            command, cwd=_launch.REPO, env=env, stdout=output, stderr=output, start_new_session=True
        )
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - began > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                os.wait4(proc.pid, 0)
                raise RuntimeError(f"{command[:4]} ran past {timeout:g} s")
            time.sleep(0.05)
        wall = time.perf_counter() - began
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            output.seek(0)
            raise RuntimeError(f"{command[:4]} exited {proc.returncode}: {output.read().decode()[-500:]}")
    return usage.ru_utime + usage.ru_stime, wall


def run(results: Results, quick: bool) -> None:
    ensure_shm_op(results)
    env = bench_env()
    pairs = 3 if quick else 5
    before, lean = [], []
    for _ in range(pairs):  # alternating, so a burst of other load falls on both
        before.append(_cpu([sys.executable, "-c", BEFORE], env)[0])
        lean.append(_cpu([sys.executable, "-c", LEAN], env)[0])
    starts, firsts, ends = [], [], []
    with tempfile.TemporaryDirectory(prefix="skyspot-bench-start-") as tmp:
        for i in range(1 if quick else 3):
            run_dir = Path(tmp) / f"run-{i}"
            overrides = [f"storage.store={Path(tmp) / 'store'}", f"train.steps={STEPS}", "checkpoint.every_steps=1"]
            began = time.time()
            cpu, wall = _cpu(trainer_command(run_dir, overrides), env)
            steps = [e["ts"] for e in events(run_dir, "step")]
            starts.append(cpu)
            firsts.append(min(steps) - began)
            ends.append(wall)
    print(
        f"     start: imports {min(before):.1f} -> {min(lean):.1f} CPU-s, a start {min(starts):.1f} CPU-s",
        file=sys.stderr,
    )
    results.add(Figure("start", "a rank's imports, as before (DeepSpeed whole)", "CPU-s", before))
    results.add(
        Figure(
            "start",
            "a rank's imports, lean (no mlflow, no TorchInductor)",
            "CPU-s",
            lean,
            note=f"alternating with the row above, {pairs} pairs",
        )
    )
    results.add(Figure("start", "lean / as before", "x", [b / a for a, b in zip(before, lean)]))
    results.add(
        Figure(
            "start",
            f"one start: supervise + torchrun + 2 ranks, {STEPS} steps",
            "CPU-s",
            starts,
            note="the whole process tree's rusage; a checkpoint every step",
        )
    )
    results.add(Figure("start", "one start: launch -> first step", "s", firsts))
    results.add(Figure("start", f"one start: launch -> exit after {STEPS} steps", "s", ends))
