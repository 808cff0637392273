"""The GPU check: the trainer on one GPU, a Llama of about 1B parameters built from a config (no hub),
bf16, ZeRO-3. `scripts/gpu_check.sh` installs the node environment first and then runs this.

    python -m bench --gpu [--out DIR]                   # on a GPU machine; DIR defaults to ./gpu-check
    SKYSPOT_GPU_CHECK_CPU=1 python -m bench --gpu       # the same path on the CPU with `tiny` (the test)

Three checks, each on the trainer itself (supervise -> torchrun -> skyspot.trainer, one rank):

1. resume: one run trained uninterrupted; another SIGTERMed at the end of step PREEMPT_AT (emergency
   checkpoint, exit 75) and started again (exit 0). final/'s tensors and every step's loss must be
   equal bitwise; when they are not, the largest difference and how many tensors differ are reported.
2. checkpoint stall: bench/_ckpt_worker.py with the same model (CheckpointManager.save, as the loop
   calls it) against the floor, one copy of the same tensors into pinned host memory (the
   device-to-host copy), and against DeepSpeed's own synchronous save.
3. speed: the uninterrupted run's median step time against bench/_bare_worker.py's (a bare
   DeepSpeed loop on the same model, config and data), both after the first WARMUP steps.

Writes DIR/gpu_check.json (every figure) and DIR/gpu_check.md (a table to paste into
docs/benchmarks.md, with the card's name, its driver and the stack's versions), and each check's
log beside them (gpu_check.resume.log, .stall.log, .speed.log). Exit 0 when the
resume is bitwise, 1 otherwise or when a check fails to run. Disk: a checkpoint of the 1B model is
about 14 GB (bf16 weights, fp32 master and Adam's moments); each run keeps one, and each run's
directory is removed once measured.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from bench._launch import REPO, bench_env, events, kill_group, run_worker, trainer_command

CPU_ENV = "SKYSPOT_GPU_CHECK_CPU"
BUDGET_ENV = "SKYSPOT_GPU_CHECK_SECONDS"
WARMUP = 3
COMMON = [
    "checkpoint.every_steps=100000",
    "checkpoint.keep=1",
    "checkpoint.train_through_notice=false",
    "data.num_samples=1024",
]
# About 1.0B parameters (TinyLlama's shape, 22 layers of hidden 2048, grouped-query attention), on
# byte tokens so nothing is downloaded. lr is low enough that 20 steps of bf16 stay finite.
LLAMA_1B = [
    "model.config.hidden_size=2048",
    "model.config.intermediate_size=5632",
    "model.config.num_hidden_layers=22",
    "model.config.num_attention_heads=32",
    "model.config.num_key_value_heads=4",
    "model.config.max_position_embeddings=1024",
    "train.seq_len=512",
    "train.micro_batch_size=4",
    "train.lr=1.0e-4",
    "deepspeed.bf16=true",
]


def spec(cpu: bool) -> dict[str, Any]:
    """What to run: the 1B model on the GPU, or `tiny` on the CPU (the tests' path). Pure."""
    if cpu:
        return {
            "device": "cpu",
            "model": [],
            "steps": 8,
            "preempt_at": 4,
            "bare_steps": 12,
            "ckpt_repeats": 1,
            "env": {},
        }
    return {
        "device": "cuda",
        "model": LLAMA_1B,
        "steps": 20,
        "preempt_at": 8,
        "bare_steps": 20,
        "ckpt_repeats": 1,
        # The trainer's refusal to fall back to the CPU is part of what is checked (trainer/gpu.py).
        "env": {"SKYPILOT_NUM_GPUS_PER_NODE": "1"},
    }


def _overrides(s: dict[str, Any], steps: int) -> list[str]:
    return [*COMMON, *s["model"], f"train.steps={steps}", f"train.log_every={max(1, steps // 4)}"]


def _train(
    run_dir: Path, overrides: list[str], env: dict[str, str], log: Path, timeout: float, preempt_at: int | None = None
) -> int:
    """One start of the trainer, one rank; with `preempt_at`, SIGTERM while rank 0 pauses after that step."""
    faults = run_dir.parent / f"{run_dir.name}-faults"
    extra = dict(env)
    if preempt_at is not None:
        extra.update(SKYSPOT_FAULT=f"step_end@{preempt_at}/0:pause=2", SKYSPOT_FAULT_DIR=str(faults))
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            trainer_command(run_dir, overrides, nproc=1),
            cwd=REPO,
            env=bench_env(**extra),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        if preempt_at is not None:
            fired = faults / f"step_end@{preempt_at}.rank0"
            deadline = time.monotonic() + timeout
            while not fired.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the run ended or stalled before step {preempt_at} (see {log})")
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGTERM)  # the supervisor forwards it, as SkyPilot's SIGTERM
        return proc.wait(timeout)
    except BaseException:
        kill_group(proc)
        raise


def _tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(path))
    if not out:
        raise RuntimeError(f"no safetensors in {directory}")
    return out


def _step_losses(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(run_dir, "step")}


def _median_step_s(seconds: list[float]) -> float:
    kept = seconds[WARMUP:] or seconds
    return statistics.median(kept)


def check_resume(work: Path, s: dict[str, Any], log: Path, timeout: float) -> dict[str, Any]:
    """Check 1, and the uninterrupted run's step times for check 3."""
    import torch

    overrides = _overrides(s, s["steps"])
    plain, resumed = work / "uninterrupted", work / "preempted"
    started = time.monotonic()
    end = started + timeout

    def left() -> float:
        return max(10.0, end - time.monotonic())

    if _train(plain, overrides, s["env"], log, left()) != 0:
        raise RuntimeError(f"the uninterrupted run failed (see {log})")
    plain_s = time.monotonic() - started
    step_seconds = [e["step_seconds"] for e in sorted(events(plain, "step"), key=lambda e: e["step"])]
    shutil.rmtree(plain / "checkpoints", ignore_errors=True)  # disk: only final/ is compared
    codes = [_train(resumed, overrides, s["env"], log, left(), preempt_at=s["preempt_at"])]
    codes.append(_train(resumed, overrides, s["env"], log, left()))
    if codes != [75, 0]:
        raise RuntimeError(f"the preempted run exited {codes}, expected [75, 0] (see {log})")
    emergency = events(resumed, "emergency_checkpoint")
    resume = events(resumed, "resume")
    ours, theirs = _tensors(resumed / "final"), _tensors(plain / "final")
    differing = [name for name in theirs if name not in ours or not torch.equal(ours[name], theirs[name])]
    max_diff = max(
        (float((ours[n].float() - theirs[n].float()).abs().max()) for n in differing if n in ours), default=0.0
    )
    losses_plain, losses_resumed = _step_losses(plain), _step_losses(resumed)
    params = sum(t.numel() for t in theirs.values())
    for directory in (plain, resumed):
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "steps": s["steps"],
        "preempted_at": s["preempt_at"],
        "parameters": params,
        "bitwise": not differing and losses_plain == losses_resumed,
        "tensors": len(theirs),
        "tensors_differing": len(differing),
        "max_abs_diff": max_diff,
        "losses_equal": losses_plain == losses_resumed,
        "emergency_bytes": emergency[-1]["bytes"] if emergency else None,
        "resume_load_s": resume[-1]["load_seconds"] if resume else None,
        "uninterrupted_run_s": round(plain_s, 1),
        "trainer_step_s": _median_step_s(step_seconds),
    }


def check_stall(work: Path, s: dict[str, Any], log: Path, timeout: float) -> dict[str, Any]:
    """Check 2: bench/_ckpt_worker.py on the same model, one rank."""
    run_dir = work / "ckpt"
    args = ["--run-dir", str(run_dir), "--repeats", str(s["ckpt_repeats"]), *COMMON, *s["model"], "train.steps=1000000"]
    out = run_worker("bench._ckpt_worker", args, timeout=timeout, log=log, env=bench_env(**s["env"]), nproc=1)
    shutil.rmtree(run_dir, ignore_errors=True)
    rounds = out["rounds"]
    ours, floor, sync = (statistics.median(rounds[k][1:] or rounds[k]) for k in ("skyspot", "floor", "sync"))
    return {
        "state_bytes": out["state_bytes_rank0"],
        "node_bytes": out["node_bytes"],
        "stall_s": ours,
        "floor_s": floor,
        "stall_vs_floor": ours / floor if floor else None,
        "sync_save_s": sync,
        "stall_vs_sync": ours / sync if sync else None,
        "first_stall_s": rounds["skyspot"][0],
        "background_write_s": statistics.median(rounds["write"][1:] or rounds["write"]),
        "d2h_floor_gbps": out["state_bytes_rank0"] / floor / 1e9 if floor else None,
        "disk_write_gbps": out["write_bps"] / 1e9 if out.get("write_bps") else None,
        "emergency_signal_to_commit_s": (out.get("emergency") or {}).get("signal_to_commit_seconds"),
    }


def check_speed(s: dict[str, Any], trainer_step_s: float, log: Path, timeout: float) -> dict[str, Any]:
    """Check 3: the bare DeepSpeed loop's median step time against the trainer's."""
    args = ["--steps", str(s["bare_steps"]), *COMMON, *s["model"]]
    out = run_worker("bench._bare_worker", args, timeout=timeout, log=log, env=bench_env(**s["env"]), nproc=1)
    stamps = out["step_ts"]
    bare_step_s = _median_step_s([b - a for a, b in zip(stamps, stamps[1:])])
    return {
        "trainer_steps_per_s": 1.0 / trainer_step_s,
        "bare_steps_per_s": 1.0 / bare_step_s,
        "trainer_vs_bare": bare_step_s / trainer_step_s,
    }


def machine(device: str) -> dict[str, Any]:
    import deepspeed
    import torch

    from skyspot.trainer.gpu import driver_version

    card = torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else "none (CPU path)"
    return {
        "card": card,
        "driver": driver_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "deepspeed": deepspeed.__version__,
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def markdown(report: dict[str, Any]) -> str:
    m, r, st, sp = (report.get(k) or {} for k in ("machine", "resume", "stall", "speed"))

    def f(value, unit="", digits=3):
        return "n/a" if value is None else f"{value:.{digits}g}{unit}"

    lines = [
        f"GPU check: {m.get('card')}, {m.get('driver')}, torch {m.get('torch')} (CUDA {m.get('cuda')}), "
        f"DeepSpeed {m.get('deepspeed')}, {m.get('date')}; `{report.get('command')}` "
        f"({f(report.get('seconds'), ' s', 4)})",
        "",
        "| check | figure | value |",
        "|---|---|---|",
    ]
    if r:
        size = f"{r['parameters'] / 1e9:.2f}B" if r["parameters"] >= 1e8 else f"{r['parameters'] / 1e6:.2f}M"
        lines += [
            f"| resume | {size} parameters, SIGTERM at step {r['preempted_at']} of "
            f"{r['steps']}: bitwise equal to the uninterrupted run | {'yes' if r['bitwise'] else 'NO'} "
            f"({r['tensors_differing']} of {r['tensors']} tensors differ, max {f(r['max_abs_diff'])}; "
            f"losses {'equal' if r['losses_equal'] else 'differ'}) |",
            f"| resume | load on resume ({f((r['emergency_bytes'] or 0) / 1e9, ' GB')} emergency checkpoint) | "
            f"{f(r['resume_load_s'], ' s')} |",
        ]
    if st:
        lines += [
            f"| stall | checkpoint stall, skyspot | {f(st['stall_s'], ' s')} ({f(st['stall_vs_floor'], 'x')} "
            f"the floor, {f(st['stall_vs_sync'], 'x')} DeepSpeed's sync save) |",
            f"| stall | floor: one copy into existing host buffers (pinned on a GPU: the device-to-host copy) | {f(st['floor_s'], ' s')} "
            f"({f(st['state_bytes'] / 1e9, ' GB')}, {f(st['d2h_floor_gbps'], ' GB/s')}) |",
            f"| stall | DeepSpeed save_checkpoint + fsync | {f(st['sync_save_s'], ' s')} |",
            f"| stall | background write + commit | {f(st['background_write_s'], ' s')} (disk "
            f"{f(st['disk_write_gbps'], ' GB/s')}) |",
            f"| stall | emergency checkpoint, SIGTERM mid-step to commit | "
            f"{f(st['emergency_signal_to_commit_s'], ' s')} |",
        ]
    if sp:
        lines += [
            f"| speed | steps/s, trainer against a bare DeepSpeed loop | {f(sp['trainer_steps_per_s'])} against "
            f"{f(sp['bare_steps_per_s'])} ({f(sp['trainer_vs_bare'], 'x')}) |"
        ]
    lines += [f"| error | {e} | |" for e in report.get("errors", [])]
    return "\n".join(lines) + "\n"


def main(out: Path, environ=os.environ) -> int:
    cpu = environ.get(CPU_ENV, "").strip() not in ("", "0")
    s = spec(cpu)
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    # SKYSPOT_GPU_CHECK_SECONDS: what is left of the 8 minutes (scripts/gpu_check.sh counts its install);
    # a check that would run past it is stopped and reported, and the figures so far are still written.
    budget = float(environ.get(BUDGET_ENV, "").strip() or (1200 if cpu else 480))
    deadline = started + budget

    def left() -> float:
        return max(10.0, deadline - time.monotonic())

    report: dict[str, Any] = {
        "command": "python -m bench --gpu" + (f" ({CPU_ENV}=1)" if cpu else ""),
        "machine": machine(s["device"]),
        "errors": [],
    }
    with tempfile.TemporaryDirectory(prefix="skyspot-gpu-check-") as tmp:
        work = Path(tmp)
        logs = {name: out / f"gpu_check.{name}.log" for name in ("resume", "stall", "speed")}
        for name, fn in (
            ("resume", lambda: check_resume(work, s, logs["resume"], left())),
            ("stall", lambda: check_stall(work, s, logs["stall"], left())),
            ("speed", lambda: check_speed(s, report["resume"]["trainer_step_s"], logs["speed"], left())),
        ):
            if name == "speed" and "resume" not in report:
                continue
            print(f"== gpu check: {name}", file=sys.stderr, flush=True)
            try:
                report[name] = fn()
            except Exception as err:  # one failed check must not hide the others' figures
                traceback.print_exc()
                report["errors"].append(f"{name}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    report["seconds"] = round(time.monotonic() - started, 1)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (out / "gpu_check.md").write_text(text)
    print(text)
    return 0 if not report["errors"] and report.get("resume", {}).get("bitwise") else 1
