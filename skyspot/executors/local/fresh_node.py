"""A fresh node on this machine: a task's file mounts and `setup` the way SkyPilot runs them on a new VM.

A cloud VM starts from the cloud's image: no skyspot, none of its stack. Here that image is an
interpreter with nothing installed (the base interpreter, `sys._base_executable`, or one the
caller names, such as pyenv's 3.10 standing for Ubuntu 22.04's `python3`), and the node's Python
is the venv SkyPilot makes from it: `uv venv --seed --relocatable --system-site-packages --python
PYTHON` (sky/skylet/constants.py, SKY_USER_ENV_CREATION_COMMANDS). uv is on the node's PATH, as
SkyPilot puts it on every node; this machine's pip configuration is not (a VM has none of it). The
task's local file mounts are copied under the node's root, and `setup` runs in that environment.
Then the task's `run` finds only what `setup` installed. The local executor uses this for `launch
--local --fresh-node`, and tests use it to run the very task a cloud launch hands SkyPilot.

A bucket mount is emulated at its narrowest: SkyPilot mounts the bucket (FUSE) before setup runs;
here the key prefixes the caller names (`bucket_prefixes`, e.g. the run's wheelhouse, what setup
reads through the mount) are materialised through skyspot's Store under the mount's path on the
node, once, when the node is made: what a later write to the bucket adds is not seen, and nothing
written under the path goes back. The trainer reaches its store through the SDK either way.

Not emulated: the image's own packages (a cloud image has more than a bare interpreter; nothing of
ours may rely on them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Mapping, Optional, Sequence

from skyspot.errors import SkyspotError

TICK_SECONDS = 0.5  # how often run_setup's `tick` runs while the setup does


@dataclass(frozen=True)
class FreshNode:
    root: Path
    venv: Path
    mounts: dict[str, str]
    """Each file-mount target (a local copy, or an emulated bucket mount) -> its path under the node's root."""

    @property
    def skyspot_venv(self) -> Path:
        """skyspot's own venv, which setup makes (node_env.py; ~/.skyspot/venv on a cloud node, here under the root)."""
        return self.root / "skyspot-venv"

    @property
    def bin(self) -> Path:
        """What SkyPilot puts on a node besides the image: uv."""
        return self.root / "bin"

    def path_on_node(self, value: str) -> str:
        """A path under a mount target, pointed at the node's copy (e.g. SKYSPOT_STORE_MOUNT)."""
        for target, copy in self.mounts.items():
            if value == target or value.startswith(target.rstrip("/") + "/"):
                return copy + value[len(target) :]
        return value

    def env(self, base: Mapping[str, str], task_envs: Mapping[str, str]) -> dict[str, str]:
        """The node's environment: the venv first on PATH, then uv; task variables that name a path under
        a mount target pointed at its copy (e.g. SKYSPOT_PACKAGE_DIR); none of this machine's pip or uv
        configuration."""
        env = {k: v for k, v in _without_launcher_config(base).items() if k not in ("PYTHONHOME", "PYTHONPATH")}
        env["PIP_CONFIG_FILE"] = os.devnull  # pip reads no /etc/pip.conf or ~/.config/pip: a VM has none of ours
        env.update({k: self.path_on_node(v) for k, v in task_envs.items()})
        env["VIRTUAL_ENV"] = str(self.venv)
        env.pop("SKYSPOT_PYTHON", None)
        env["SKYSPOT_VENV"] = str(self.skyspot_venv)
        env["PATH"] = os.pathsep.join([str(self.venv / "bin"), str(self.bin), _without_venvs(base.get("PATH", ""))])
        return env


def _without_venvs(path: str) -> str:
    """PATH without the launching environment's own bin folder (the node must not see our skyspot)."""
    ours = str(Path(sys.executable).parent)
    return os.pathsep.join(p for p in path.split(os.pathsep) if p and p != ours)


def find_uv() -> str:
    """The launcher's uv (the `uv` package, a dependency of skyspot), which the fresh node gets as SkyPilot's."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found:
            return found
    raise SkyspotError("a fresh node needs uv, as SkyPilot puts it on every node: pip install uv")


def make(
    root: Path, file_mounts: Mapping[str, object], *, python: Optional[str] = None, bucket_prefixes: Sequence[str] = ()
) -> FreshNode:
    """Create (or reuse) the node's venv the way SkyPilot makes it from `python` (default: the base
    interpreter), copy the task's local file mounts into `root`, and materialise `bucket_prefixes`
    (store URIs such as `s3://bucket/runs/r1/wheelhouse/`) under the bucket mounts they fall in."""
    root.mkdir(parents=True, exist_ok=True)
    venv = root / "venv"
    uv = find_uv()
    (root / "bin").mkdir(exist_ok=True)
    link = root / "bin" / "uv"
    if not link.exists():
        link.symlink_to(uv)
    if not (venv / "bin" / "python").exists():
        base = python or getattr(sys, "_base_executable", None) or sys.executable
        result = subprocess.run(
            [uv, "venv", "--quiet", "--seed", "--relocatable", "--system-site-packages", "--python", base, str(venv)],
            capture_output=True,
            text=True,
            env={**_without_launcher_config(os.environ), "UV_PYTHON_DOWNLOADS": "never"},
        )
        if result.returncode != 0:
            raise SkyspotError(
                f"cannot create the fresh node's virtual environment at {venv}: "
                f"{(result.stderr or result.stdout).strip().splitlines()[-1:]}"
            )
    mounts = {}
    for target, source in file_mounts.items():
        if isinstance(source, dict):
            copy = _materialise(root, target, source, bucket_prefixes)
            if copy:
                mounts[target] = copy
            continue
        if not isinstance(source, str) or "://" in source:
            continue
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


def _without_launcher_config(environ: Mapping[str, str]) -> dict[str, str]:
    """This machine's environment without its pip and uv settings (its index, find-links, caps) or its venv."""
    return {k: v for k, v in environ.items() if not k.startswith(("PIP_", "UV_", "VIRTUAL_ENV"))}


def _materialise(root: Path, target: str, mount: Mapping[str, object], prefixes: Sequence[str]) -> Optional[str]:
    """The emulated bucket mount at `target`: the named prefixes of its bucket, downloaded once."""
    from dataclasses import replace

    from skyspot.storage import mount_source, open_store, parse_store_uri

    source = mount.get("source")
    mine = [parse_store_uri(p) for p in prefixes if isinstance(source, str) and mount_source(p) == source]
    if not mine:
        return None
    copy = root / "mounts" / target.lstrip("/")
    if copy.exists():
        shutil.rmtree(copy)
    copy.mkdir(parents=True)
    for uri in mine:
        bucket = open_store(replace(uri, prefix=""))  # the mount shows the whole bucket, keys as paths
        keys = bucket.list(uri.prefix + "/" if uri.prefix else "")
        if keys:
            bucket.download_files("", keys, copy)
    return str(copy)


def run_setup(
    node: FreshNode,
    setup: str,
    env: Mapping[str, str],
    log: Optional[IO[str]] = None,
    cwd: Optional[Path] = None,
    timeout: Optional[float] = None,
    tick: Callable[[], None] = lambda: None,
) -> int:
    """Run the task's `setup` on the node; its output goes to `log` (or is captured and dropped). `tick`
    runs every TICK_SECONDS while it does (the controller judges its deadline there)."""
    with subprocess.Popen(
        ["bash", "-c", setup],
        cwd=cwd or node.root,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        ends = None if timeout is None else time.monotonic() + timeout
        while True:
            try:  # communicate() may be called again after its timeout, losing no output
                output, _ = proc.communicate(timeout=TICK_SECONDS)
                break
            except subprocess.TimeoutExpired:
                if ends is not None and time.monotonic() >= ends:
                    proc.kill()
                    proc.communicate()
                    raise subprocess.TimeoutExpired(proc.args, timeout) from None
                tick()
    if log is not None:
        log.write(output)
        log.flush()
    return proc.returncode
