"""Starting trainer processes for the benchmarks: environment, torchrun, worker JSON, events.

Workers (bench/_*_worker.py) run under torchrun and print one line `BENCH_JSON {...}` on
global rank 0; `run_worker` returns that object. Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from skyspot.ports import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
JSON_PREFIX = "BENCH_JSON "
EXTENSIONS_DIR = Path.home() / ".cache" / "skyspot-bench" / "torch_extensions"

# The large state of benchmarks 1 and 2: a Llama of about 103M parameters (8 layers, hidden 1024).
# ZeRO-3 in fp32 checkpoints 12 bytes per parameter (weights and Adam's two moments), about
# 1.24 GB per node on 2 ranks. One micro-batch of 32 tokens keeps a step short on 2 CPU cores.
LARGE = [
    "model.config.hidden_size=1024",
    "model.config.intermediate_size=2816",
    "model.config.num_hidden_layers=8",
    "model.config.num_attention_heads=16",
    "model.config.num_key_value_heads=16",
    "train.micro_batch_size=1",
    "train.seq_len=32",
]
# --quick: 2 layers, about 26M parameters, 0.31 GB.
LARGE_QUICK = [
    o if not o.startswith("model.config.num_hidden_layers") else "model.config.num_hidden_layers=2" for o in LARGE
]


def bench_env(**extra: str) -> dict[str, str]:
    """This environment without skyspot/SkyPilot/torchrun settings that would change what runs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKYSPOT_", "SKYPILOT_", "PET_", "TORCH_ELASTIC"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["AWS_EC2_METADATA_DISABLED"] = "true"  # no SDK may look for a real metadata service
    env["PYTHONUNBUFFERED"] = "1"
    env["NO_COLOR"] = "1"
    # A build cache of our own for DeepSpeed's JIT ops (see ensure_shm_op): other processes on a
    # shared machine, with another ninja or flags, cannot make a measured start recompile.
    env["TORCH_EXTENSIONS_DIR"] = str(EXTENSIONS_DIR)
    env.update(extra)
    return env


def torchrun(module: str, args: list[str], nproc: int = 2) -> list[str]:
    # In a venv made with --system-site-packages (a node's, scripts/gpu_check.sh's) torch's `torchrun`
    # script is the base interpreter's, not in the venv's bin: then torchrun's own module.
    script = BIN / "torchrun"
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [
        *launcher,
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        module,
        *args,
    ]


def trainer_command(
    run_dir: Path,
    overrides: list[str],
    *,
    fresh: bool = False,
    module: str = "skyspot.trainer",
    recipe: str = "tiny",
    nproc: int = 2,
) -> list[str]:
    """The real trainer entry, as a node runs it: supervise -- torchrun -m skyspot.trainer."""
    return [
        sys.executable,
        "-m",
        "skyspot.trainer.supervise",
        "--run-dir",
        str(run_dir),
        "--",
        *torchrun(module, [recipe, "--run-dir", str(run_dir), *(["--fresh"] if fresh else []), *overrides], nproc),
    ]


def run_worker(
    module: str,
    args: list[str],
    *,
    timeout: float,
    log: Optional[Path] = None,
    env: Optional[dict[str, str]] = None,
    cpus: Optional[set[int]] = None,
    nproc: int = 2,
) -> dict[str, Any]:
    """Run a torchrun worker script to the end (on `cpus` only, when given); its BENCH_JSON object."""
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.run(
        torchrun(module, args, nproc),
        cwd=REPO,
        env=env or bench_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=pin,
    )
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    found = [line[len(JSON_PREFIX) :] for line in proc.stdout.splitlines() if line.startswith(JSON_PREFIX)]
    if proc.returncode != 0 or not found:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        raise RuntimeError(f"{module} exited {proc.returncode} without a result:\n{tail}")
    return json.loads(found[-1])


def emit_result(obj: dict[str, Any]) -> None:
    print(JSON_PREFIX + json.dumps(obj), flush=True)


def events(run_dir: Path, type: Optional[str] = None, rank: Optional[int] = 0) -> list[dict]:
    """Events of every attempt (rank 0's by default), oldest first."""
    out = []
    for path in sorted((Path(run_dir) / "events").glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if (type is None or event.get("type") == type) and (rank is None or event.get("rank") == rank):
                out.append(event)
    return sorted(out, key=lambda e: e.get("ts", 0))


def wait_for_event(run_dir: Path, proc: subprocess.Popen, match, timeout: float) -> dict:
    """Poll the events until `match(event)` holds; the first such event."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in events(run_dir, rank=None):
            if match(event):
                return event
        if proc.poll() is not None:
            raise RuntimeError(f"the trainer exited ({proc.returncode}) before the awaited event")
        time.sleep(0.05)
    raise TimeoutError(f"no matching event within {timeout:.0f} s")


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a process we started in its own session, and reap it (workers die with it: PDEATHSIG)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def disk_bandwidth(directory: Path, nbytes: int) -> tuple[float, float]:
    """(write, read) bytes/s in `directory`: write + fsync a file of `nbytes`, then read it back.

    The read comes from the page cache, as a resume right after a save does here; a fresh VM
    reads its disk or the store instead.
    """
    chunk = os.urandom(64 << 20)
    path = Path(directory) / ".bench-bandwidth"
    written = 0
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        while written < nbytes:
            n = min(len(chunk), nbytes - written)
            f.write(memoryview(chunk)[:n])
            written += n
        os.fsync(f.fileno())
    write_bps = written / (time.perf_counter() - start)
    buf = bytearray(len(chunk))
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read_bps = written / (time.perf_counter() - start)
    path.unlink()
    return write_bps, read_bps


# What earlier benchmarks learnt about this machine, for later ones in the same `python -m bench`
# (recovery fills it; lost_work sizes its run from it): seconds from launch to the first step of
# `tiny`, and seconds per step.
CALIBRATION: dict[str, float] = {"startup_s": 20.0, "step_s": 0.17}


_SHM_READY: list[float] = []


def ensure_shm_op(results=None) -> float:
    """Build DeepSpeed's CPU shared-memory comm op now, in the benchmarks' environment, so no
    measured start pays its JIT compile (a minute or more on 2 cores), and warm the page cache
    with the trainer's imports. Seconds it took.

    DeepSpeed builds it in ~/.cache/torch_extensions by default, shared by every process of the
    user; one that finds another `ninja` first on its PATH (the venv's or /usr/bin's) finds the
    other's build log unreadable and rebuilds. On this shared machine that happened between
    measured starts, so the benchmarks build into their own EXTENSIONS_DIR (bench_env sets it,
    and it reaches the nodes of the local executor through the environment).
    """
    if _SHM_READY:
        return 0.0
    start = time.perf_counter()
    code = (
        "from deepspeed.accelerator import get_accelerator\n"
        "b = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
        "import deepspeed.ops\n"
        "b is not None and deepspeed.ops.__compatible_ops__.get(b.NAME, False) and b.load()\n"
        # and read what every trainer start imports, so the first measured start is not the
        # only one that reads it from disk
        "from transformers import AutoModelForCausalLM, LlamaForCausalLM\n"
    )
    subprocess.run([sys.executable, "-c", code], env=bench_env(), capture_output=True, timeout=900)
    seconds = time.perf_counter() - start
    _SHM_READY.append(seconds)
    if seconds > 20 and results is not None:
        results.notes.append(
            f"DeepSpeed's CPU shm comm op was compiled before measuring ({seconds:.0f} s, not counted)"
        )
    return seconds
