"""A fresh node on this machine: a task's file mounts and `setup` the way SkyPilot runs them on a new VM.

A cloud VM starts from the cloud's image: no skyspot, none of its stack. Here that image is a
new virtual environment made from the base interpreter (`sys._base_executable`, which has no
skyspot), the task's local file mounts are copied under the node's root, and `setup` runs in
that environment. Then the task's `run` finds only what `setup` installed. The local executor
uses this for `launch --local --fresh-node`, and tests use it to run the very task a cloud
launch hands SkyPilot.

What is not emulated: bucket mounts (the trainer reaches its store through the SDK, pointed at
a loopback server in tests), and the image's own packages (a cloud image has more than a bare
venv; nothing of ours may rely on them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Mapping, Optional

from skyspot.errors import SkyspotError


@dataclass(frozen=True)
class FreshNode:
    root: Path
    venv: Path
    mounts: dict[str, str]
    """Each local file-mount target -> its copy under the node's root."""

    def env(self, base: Mapping[str, str], task_envs: Mapping[str, str]) -> dict[str, str]:
        """The node's environment: the venv first on PATH, and task variables that name a mount
        target pointed at its copy (e.g. SKYSPOT_PACKAGE_DIR)."""
        env = {k: v for k, v in base.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")}
        env.update({k: self.mounts.get(v, v) for k, v in task_envs.items()})
        env["VIRTUAL_ENV"] = str(self.venv)
        env["PATH"] = str(self.venv / "bin") + os.pathsep + _without_venvs(base.get("PATH", ""))
        return env


def _without_venvs(path: str) -> str:
    """PATH without the launching environment's own bin folder (the node must not see our skyspot)."""
    ours = str(Path(sys.executable).parent)
    return os.pathsep.join(p for p in path.split(os.pathsep) if p and p != ours)


def make(root: Path, file_mounts: Mapping[str, object]) -> FreshNode:
    """Create (or reuse) the node's venv and copy the task's local file mounts into `root`."""
    root.mkdir(parents=True, exist_ok=True)
    venv = root / "venv"
    if not (venv / "bin" / "python").exists():
        base = getattr(sys, "_base_executable", None) or sys.executable
        result = subprocess.run([base, "-m", "venv", str(venv)], capture_output=True, text=True)
        if result.returncode != 0:
            raise SkyspotError(f"cannot create the fresh node's virtual environment at {venv}: "
                               f"{(result.stderr or result.stdout).strip().splitlines()[-1:]}")
    mounts = {}
    for target, source in file_mounts.items():
        if not isinstance(source, str) or "://" in source:
            continue  # a bucket mount: the trainer talks to the store itself
        copy = root / "mounts" / target.lstrip("/")
        if copy.exists():
            shutil.rmtree(copy) if copy.is_dir() else copy.unlink()
        copy.parent.mkdir(parents=True, exist_ok=True)
        if Path(source).is_dir():
            shutil.copytree(source, copy)
        else:
            shutil.copy2(source, copy)
        mounts[target] = str(copy)
    return FreshNode(root=root, venv=venv, mounts=mounts)


def run_setup(node: FreshNode, setup: str, env: Mapping[str, str], log: Optional[IO[str]] = None,
              cwd: Optional[Path] = None) -> int:
    """Run the task's `setup` on the node; its output goes to `log` (or is captured and dropped)."""
    proc = subprocess.run(["bash", "-c", setup], cwd=cwd or node.root, env=dict(env), stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if log is not None:
        log.write(proc.stdout)
        log.flush()
    return proc.returncode
