"""Helpers to run the trainer end to end under torchrun (and the supervisor), as a node would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from skyspot.ports import free_port

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TORCHRUN = str(BIN / "torchrun")

# Small enough to train in seconds on 2 CPU ranks; checkpoints every 4 steps.
TINY = ["train.steps=16", "checkpoint.every_steps=4", "train.log_every=4", "checkpoint.keep=3"]


def trainer_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKYSPOT_", "SKYPILOT_", "PET_", "TORCH_ELASTIC"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def torchrun_command(
    run_dir: Path,
    overrides: list[str],
    nproc: int = 2,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    port: Optional[int] = None,
    recipe: str = "tiny",
    master_addr: str = "127.0.0.1",
    local_addr: Optional[str] = None,
) -> list[str]:
    nodes = ["--nnodes", str(nnodes), "--node_rank", str(node_rank)] if nnodes > 1 else []
    return [
        TORCHRUN,
        *nodes,
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        master_addr,
        "--master_port",
        str(port or free_port()),
        *(["--local_addr", local_addr] if local_addr else []),
        "-m",
        "skyspot.trainer",
        recipe,
        "--run-dir",
        str(run_dir),
        *overrides,
    ]


def start(
    run_dir: Path,
    overrides: list[str] = TINY,
    *,
    supervised: bool = True,
    log_name: str = "log",
    nproc: int = 2,
    recipe: str = "tiny",
    **env: str,
) -> subprocess.Popen:
    """Start a node: `supervise -- torchrun ... -m skyspot.trainer RECIPE`, in its own session."""
    command = torchrun_command(run_dir, overrides, nproc, recipe=recipe)
    if supervised:
        command = [sys.executable, "-m", "skyspot.trainer.supervise", "--run-dir", str(run_dir), "--", *command]
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"{run_dir.name}.{log_name}.txt", "wb")
    return subprocess.Popen(
        command, cwd=REPO, env=trainer_env(**env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def host_node(
    hosts, k: int, run_dir: Path, overrides: list[str], port: int, *, supervise: tuple[str, ...] = (), **env: str
) -> tuple[list[str], dict[str, str]]:
    """Node k of `hosts` (skyspot/executors/local/netns.py), one rank, on host k as on a cloud node: the
    command (`supervise SUPERVISE -- torchrun --nnodes N --node_rank k --local_addr <host k> ...`) and its
    environment (SKYPILOT_NODE_IPS the hosts' addresses, gloo on the namespace's interface)."""
    from skyspot.executors.local.netns import IFNAME

    torchrun = torchrun_command(
        run_dir,
        overrides,
        1,
        nnodes=hosts.n,
        node_rank=k,
        port=port,
        master_addr=hosts.addr(0),
        local_addr=hosts.addr(k),
    )
    command = [*hosts.exec_prefix(k), sys.executable, "-m", "skyspot.trainer.supervise", "--run-dir", str(run_dir)]
    environ = trainer_env(
        SKYPILOT_NODE_RANK=str(k),
        SKYPILOT_NUM_NODES=str(hosts.n),
        SKYPILOT_NODE_IPS="\n".join(hosts.addrs),
        GLOO_SOCKET_IFNAME=IFNAME,
        **env,
    )
    return [*command, *supervise, "--", *torchrun], environ


def start_nodes(
    run_dirs: list[Path], overrides: list[str] = TINY, *, log_name: str = "log", **env: str
) -> list[subprocess.Popen]:
    """Start one node per run directory, one rank each, as SkyPilot would on separate machines:
    each node has its own run directory (its own disk) and SKYPILOT_NODE_RANK / SKYPILOT_NUM_NODES."""
    port = free_port()
    procs = []
    for node, run_dir in enumerate(run_dirs):
        command = [
            sys.executable,
            "-m",
            "skyspot.trainer.supervise",
            "--run-dir",
            str(run_dir),
            "--",
            *torchrun_command(run_dir, overrides, 1, nnodes=len(run_dirs), node_rank=node, port=port),
        ]
        run_dir.mkdir(parents=True, exist_ok=True)
        log = open(run_dir.parent / f"{run_dir.name}.{log_name}.txt", "wb")
        procs.append(
            subprocess.Popen(
                command,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=trainer_env(
                    SKYPILOT_NODE_RANK=str(node),
                    SKYPILOT_NUM_NODES=str(len(run_dirs)),
                    SKYPILOT_NODE_IPS="\n".join(["127.0.0.1"] * len(run_dirs)),
                    **env,
                ),
            )
        )
    return procs


def finish(proc: subprocess.Popen, timeout: float = 240) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (code {proc.returncode}) before {path.name} appeared")
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear within {timeout} s")


def events(run_dir: Path, type: Optional[str] = None) -> list[dict]:
    out = []
    for path in sorted((run_dir / "events").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                event = json.loads(line)
                if type is None or event["type"] == type:
                    out.append(event)
    return sorted(out, key=lambda e: e["ts"])


def log_text(run_dir: Path, log_name: str = "log") -> str:
    path = run_dir.parent / f"{run_dir.name}.{log_name}.txt"
    return path.read_text(errors="replace") if path.exists() else ""
