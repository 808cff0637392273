"""The node's Python environment: what `setup` installs on a fresh VM, from where, and for which CUDA.

    PYTHONPATH="$WHEEL" "$BOOT" -m skyspot.node_env setup --wheel "$WHEEL" [--store URI]

Run by the task's `setup` (task/render.py) with whatever `python3` the image has, from inside the
skyspot wheel (a wheel is a zip, which Python imports from): skyspot is not installed yet, so
everything before the install is the standard library, and it runs on any Python from 3.8 (GCP's
TCPX container and older images bring one that old).

**skyspot's own venv.** The environment setup is handed depends on the image: conda's base on
SkyPilot's images (it makes ~/sky-user-env only when no conda env is active, sky/skylet/constants.py),
SkyPilot's venv over /usr/bin/python3.10 on the DLAMI, whatever a custom Docker image has (SkyPilot
makes none there, sky/backends/backend_utils.py). None of them is trained in: setup makes a venv of
skyspot's own (`$SKYSPOT_VENV`, else ~/.skyspot/venv; `uv venv`, no packages of the image's) on the
interpreter it runs on when that is at least the wheel's Requires-Python (the oldest Python the
pinned stack supports: task/package.py python_floor; never below 3.10), else one `uv python find`
finds, else uv's managed Python (`uv python install`), and `run` uses that venv's python by path. docs/clouds.md has the
table per image kind.

**Why the node resolves for itself.** The wheel's requirements (task/package.py) pin the training
stack exactly (torch, DeepSpeed, transformers, peft, accelerate, safetensors: what decides the
numerics and the checkpoint format, all built for every Python from 3.10 on) and give everything
else its declared range, so uv, on the node, picks the newest build of each that exists for that
interpreter and platform (numpy 2.2.6 on 3.10, where the launching machine's 2.4.6 has no build).
Resolving locks per interpreter at launch (`uv pip compile --python-version ...`) was the other
way: it needs the index at every launch and render, a lock per Python x CUDA line, and still
cannot know the image's interpreter.

**Why a wheelhouse.** Every recovery is a new VM and SkyPilot runs setup again from scratch. The
first start of a run resolves (uv pip compile, for this exact interpreter), downloads and builds
every wheel once (`pip wheel`: DeepSpeed has only an sdist, built here once), installs from those
files with uv, and node 0 then keeps them in the run's store under
`<store>/<run>/wheelhouse/<key>/`, `WHEELHOUSE.json` (every file's size and sha256) written last.
Every later start reads them through the store's bucket mount (SkyPilot mounts it before setup
runs, so no SDK is needed yet), checks each file against the marker while it copies it to the
local disk, and installs with no index at all. The key is the interpreter, the platform (machine
and glibc), the CUDA line and a hash of the requirement set, so a different image or driver never
takes another's wheels. A wheelhouse without its marker, or with a file that does not match it, is
ignored with one line and the node installs from the index: it never fails a setup the index
could have served. The resolution is frozen for the run's life this way: a recovery a week later
trains with exactly the versions of its first start.

**CUDA that matches the driver, on a build that exists** (`cuda_lines`): torch's PyPI wheels for
Linux are CUDA builds; torch 2.13.0's is CUDA 13 (it depends on cuda-toolkit 13.0.x and
nvidia-nccl-cu13), which needs a driver >= 580.65.06. PyTorch's own index publishes other lines
per release (TORCH_LINES: 2.13 has cu126 and cu130, no cu128), with the local version label
(`torch==2.13.0+cu126`), so the release stays the one tested. Setup tries the lines the driver runs,
newest first, and falls back to the next when one does not resolve. No driver (a CPU node, or
nvidia-smi missing): PyPI's default. SKYSPOT_TORCH_INDEX names a mirror of PyTorch's index.

**A setup that cannot mend its node** ends with one line naming the driver, Python, image and
instance, exits 2 (never 75: SkyPilot retries a failed setup on a new cluster, the same image), and
leaves the record `status` shows (`<SKYSPOT_STORE_MOUNT>/<run>/setup/node-<rank>.json`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Tuple

# The wheelhouse's trust (signed marker, hashed lock) and what setup and the trainer both read about the
# node: standard library only, as this module.
from skyspot import wheelhouse
from skyspot.errors import EXIT_FAILURE, EXIT_USAGE
from skyspot.node_host import INSTALLED, VENV_ENV, driver_version, parse_driver, venv_path  # noqa: F401

MARKER = wheelhouse.MARKER
LOCK = wheelhouse.LOCK
PYTORCH_INDEX = "https://download.pytorch.org/whl"


class NodeEnvError(Exception):
    """Setup cannot install a working environment; the message is one line saying what to do."""


@dataclass(frozen=True)
class CudaLine:
    name: str
    """`pypi` (PyPI's own torch build) or PyTorch's index name for a CUDA line (`cu128`)."""
    min_driver: Tuple[int, ...]
    """The oldest NVIDIA driver the build runs on."""
    index_url: Optional[str]
    """The index the build comes from; None for PyPI."""

    @property
    def local_label(self) -> str:
        return "" if self.index_url is None else f"+{self.name}"


# Driver minimums from NVIDIA's CUDA release notes (Table 3, "CUDA Toolkit and Minimum Required Driver
# Version"): 13.0 needs 580.65.06; 12.8 GA shipped with 570.26; every CUDA 12.x build runs on >= 525.60.13
# under CUDA minor version compatibility (PyTorch's wheels carry their kernels as SASS for the GPUs they
# support, so nothing needs the driver's newer PTX JIT).
PYPI = CudaLine("pypi", (580, 65, 6), None)
CUDA_LINES = (
    PYPI,
    CudaLine("cu130", (580, 65, 6), f"{PYTORCH_INDEX}/cu130"),
    CudaLine("cu128", (570, 26), f"{PYTORCH_INDEX}/cu128"),
    CudaLine("cu126", (525, 60, 13), f"{PYTORCH_INDEX}/cu126"),
)
"""Every line skyspot knows, by its minimum driver; which of them exist depends on torch's version."""

TORCH_LINES = {
    # torch minor -> (the CUDA line of PyPI's own build, the lines PyTorch's index publishes besides it),
    # each newest first. 2.13: PyPI's build is CUDA 13.0 (it depends on cuda-toolkit 13.0.x and
    # nvidia-nccl-cu13); cu128 was dropped from the binary matrix in 2.12 (pytorch/pytorch RFC #178665,
    # PR #182849), so 2.13 is on cu126 and cu130 only (pytorch/FBGEMM PR #5976: "torch-2.13 has cu126=108
    # and cu130=108 wheels but cu128=0"). cu126 also keeps kernels for Volta (sm_70), the oldest GPUs on
    # 535-era images. Move this table with the torch pin (task/package.py).
    "2.13": ("cu130", ("cu126",)),
}
DEFAULT_TORCH = "2.13"


def torch_version(requirements: Sequence[str]) -> str:
    """The torch release the requirement set pins (`torch==2.13.0` -> '2.13.0'); DEFAULT_TORCH without a pin."""
    for requirement in requirements:
        match = re.fullmatch(r"\s*torch\s*==\s*([0-9][0-9a-zA-Z.]*)\s*", requirement)
        if match:
            return match.group(1)
    return DEFAULT_TORCH


def _line(name: str, index_base: str) -> CudaLine:
    known = next(line for line in CUDA_LINES if line.name == name)
    return known if known.index_url is None else replace(known, index_url=f"{index_base.rstrip('/')}/{name}")


def cuda_lines(driver: Optional[str], torch: str = DEFAULT_TORCH, index_base: str = PYTORCH_INDEX) -> List[CudaLine]:
    """The torch builds this driver runs, in the order setup tries them: PyPI's own build first where the
    driver runs it, then PyTorch's lines for this torch release, newest first (None: no driver, PyPI's)."""
    version = parse_driver(driver)
    if version is None:
        return [PYPI]
    pypi_cuda, published = TORCH_LINES.get(".".join(torch.split("+")[0].split(".")[:2]), TORCH_LINES[DEFAULT_TORCH])
    candidates = [PYPI] + [_line(name, index_base) for name in published if name != pypi_cuda]
    fits = [line for line in candidates if version >= line.min_driver]
    if fits:
        return fits
    oldest = min(candidates, key=lambda line: line.min_driver)
    raise NodeEnvError(
        f"the NVIDIA driver {driver.strip()} is older than any CUDA build of torch {torch} "
        f"(the oldest, {oldest.name}, needs >= {'.'.join(map(str, oldest.min_driver))}): use an image "
        "with a newer driver (SkyPilot's default GPU images; docs/clouds.md)"
    )


def cuda_line(driver: Optional[str], torch: str = DEFAULT_TORCH) -> CudaLine:
    """The torch build a node with this NVIDIA driver tries first (None: no driver, PyPI's default)."""
    return cuda_lines(driver, torch)[0]


def requirements_for(requirements: Sequence[str], line: CudaLine) -> list[str]:
    """The wheel's requirements with torch's exact pin moved to the line's build (`torch==2.13.0+cu128`)."""
    out = []
    for requirement in requirements:
        match = re.fullmatch(r"\s*torch\s*==\s*([0-9][0-9a-zA-Z.]*)\s*", requirement)
        out.append(f"torch=={match.group(1)}{line.local_label}" if match and line.local_label else requirement.strip())
    return out


def python_floor(wheel: Path) -> Tuple[int, int]:
    """The oldest Python the wheel's stack runs on: its METADATA's `Requires-Python: >=3.X` (task/package.py
    takes it from the pinned packages' own), never below MIN_PYTHON."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(name).decode()
    match = re.search(r"^Requires-Python:\s*>=\s*(\d+)\.(\d+)", text, re.MULTILINE)
    found = (int(match.group(1)), int(match.group(2))) if match else MIN_PYTHON
    return max(found, MIN_PYTHON)


def wheel_requirements(wheel: Path, extras: Sequence[str] = ()) -> list[str]:
    """The Requires-Dist lines of a wheel's METADATA: its own, and those of the `extras` asked for
    (`; extra == "wandb"` dropped, so they install like the rest); other extras' lines are left out."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(name).decode()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement, _, marker = line.split(":", 1)[1].strip().partition(";")
        extra = re.fullmatch(r"\s*extra\s*==\s*['\"]([^'\"]+)['\"]\s*", marker)
        if not marker or (extra and extra.group(1) in extras):
            out.append(requirement.strip())
        elif not extra:
            out.append(f"{requirement.strip()}; {marker.strip()}")
    return out


def interpreter_tag() -> str:
    """cp310-x86_64-glibc2.35: what decides which wheels fit this interpreter and machine."""
    libc, version = platform.libc_ver()
    implementation = "cp" if sys.implementation.name == "cpython" else sys.implementation.name
    return (
        f"{implementation}{sys.version_info[0]}{sys.version_info[1]}-{platform.machine() or 'unknown'}"
        f"-{libc or 'libc'}{version}"
    )


def wheelhouse_key(tag: str, line: CudaLine, requirements: Sequence[str]) -> str:
    """One name per interpreter + platform + CUDA line + requirement set."""
    digest = hashlib.sha256("\n".join([line.index_url or "pypi", *sorted(requirements)]).encode()).hexdigest()
    return f"{tag}-{line.name}-{digest[:16]}"


# ------------------------------------------------------------------ a wheelhouse (its trust: wheelhouse.py)


def manifest_for(local: Path, key: str, line: CudaLine, requirements: Sequence[str]) -> dict:
    """The marker for a wheelhouse built in `local` (signed and written into it last, by `save`)."""
    files = wheelhouse.files_of(local)
    return {
        "key": key,
        "interpreter": interpreter_tag(),
        "python": platform.python_version(),
        "cuda_line": line.name,
        "index_url": line.index_url,
        "requirements": list(requirements),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": files,
    }


# ------------------------------------------------------------------ installing


def find_uv(environ: Mapping[str, str] = os.environ) -> str:
    """uv as SkyPilot installs it on every node ($HOME/.local/bin/uv), or on PATH."""
    found = shutil.which("uv", path=environ.get("PATH"))
    home_uv = Path(environ.get("HOME", "~")).expanduser() / ".local" / "bin" / "uv"
    if found:
        return found
    if home_uv.is_file():
        return str(home_uv)
    raise NodeEnvError(
        "uv is not on this node (SkyPilot installs it in ~/.local/bin): install it "
        "(`pip install uv`) or use an image SkyPilot prepares"
    )


def _tool_env(environ: Mapping[str, str]) -> dict[str, str]:
    # The wheel is on PYTHONPATH for this process only; the tools must not import skyspot from it.
    # UV_LINK_MODE=copy as SkyPilot's own uv calls set it (sky/skylet/constants.py: hardlinks from a
    # cache on another filesystem fail, and clones strip execute bits on XFS).
    env = {k: v for k, v in environ.items() if k != "PYTHONPATH"}
    env.setdefault("UV_LINK_MODE", "copy")
    return env


def _run(args: list[str], environ: Mapping[str, str], what: str) -> None:
    proc = subprocess.run(
        args,
        env=_tool_env(environ),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        raise NodeEnvError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def _index_args(line: CudaLine) -> list[str]:
    # PyTorch's index beside PyPI, each package from whichever has the best match: what pip does with
    # --extra-index-url; torch's exact local version (+cu128) pins it to PyTorch's build.
    return (
        [] if line.index_url is None else ["--extra-index-url", line.index_url, "--index-strategy", "unsafe-best-match"]
    )


def build_from_index(
    python: str, uv: str, requirements: Sequence[str], line: CudaLine, local: Path, environ: Mapping[str, str]
) -> None:
    """Resolve for this interpreter, then download and build every wheel of the result into `local`."""
    if local.exists():
        shutil.rmtree(local)
    local.mkdir(parents=True)
    wanted = local / ".requirements.in"
    wanted.write_text("\n".join(requirements) + "\n")
    _run(
        [
            uv,
            "pip",
            "compile",
            "--quiet",
            "--no-config",
            "--python",
            python,
            "--generate-hashes",
            *_index_args(line),
            str(wanted),
            "-o",
            str(local / LOCK),
        ],
        environ,
        "resolving the node's requirements",
    )
    wanted.unlink()
    pip_index = [] if line.index_url is None else ["--extra-index-url", line.index_url]
    if (
        subprocess.run(
            [python, "-m", "pip", "--version"], env=_tool_env(environ), capture_output=True, stdin=subprocess.DEVNULL
        ).returncode
        != 0
    ):  # skyspot's venv is made without pip
        _run([uv, "pip", "install", "--quiet", "--no-config", "--python", python, "pip"], environ, "installing pip")
    # pip, not uv, fetches: uv has no `pip download`/`pip wheel`, and the wheelhouse needs the files
    # themselves (DeepSpeed built from its sdist once). The lock's hashes check every download.
    _run(
        [
            python,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--progress-bar",
            "off",
            "--disable-pip-version-check",
            "--no-deps",
            *pip_index,
            "-r",
            str(local / LOCK),
            "-w",
            str(local),
        ],
        environ,
        "downloading and building the node's wheels",
    )
    # The lock the node installs from names the files themselves: DeepSpeed's wheel built here has no
    # hash in the index's lock (that one is its sdist's), and hashes are required at every install.
    (local / LOCK).write_text(wheelhouse.hashed_lock(local))


def install_offline(python: str, uv: str, local: Path, wheel: Path, environ: Mapping[str, str]) -> None:
    """Install the lock from the wheelhouse's files only, with skyspot's own wheel, every file's hash required."""
    own = local / ".skyspot.in"
    own.write_text(wheelhouse.own_wheel_requirement(wheel))
    try:
        _run(
            [
                uv,
                "pip",
                "install",
                "--quiet",
                "--no-config",
                "--python",
                python,
                "--offline",
                "--no-index",
                "--find-links",
                str(local),
                "--require-hashes",
                "-r",
                str(local / LOCK),
                "-r",
                str(own),
            ],
            environ,
            "installing from the wheelhouse",
        )
    finally:
        own.unlink()


# ------------------------------------------------------------------ the setup step


@dataclass(frozen=True)
class NodeContext:
    run: Optional[str]
    node_rank: int
    store: Optional[str]
    store_on_node: Optional[Path]
    """The store's root as a path on this node: the bucket mount (SKYSPOT_STORE_MOUNT) or a local store."""

    @property
    def wheelhouses(self) -> Optional[Path]:
        return self.store_on_node / self.run / "wheelhouse" if self.store_on_node and self.run else None


def node_context(store: Optional[str], environ: Mapping[str, str]) -> NodeContext:
    run = next(
        (v.strip() for v in (environ.get("SKYSPOT_RUN_NAME"), environ.get("SKYPILOT_TASK_ID")) if v and v.strip()), None
    )  # the trainer's run id (trainer/cluster.py), hence its store prefix
    rank_text = environ.get("SKYPILOT_SETUP_NODE_RANK") or environ.get("SKYPILOT_NODE_RANK") or "0"
    try:
        rank = int(rank_text)
    except ValueError:
        rank = 0
    mount = environ.get("SKYSPOT_STORE_MOUNT")
    on_node = Path(mount) if mount else (Path(store).expanduser() if store and "://" not in store else None)
    return NodeContext(run=run, node_rank=rank, store=store, store_on_node=on_node)


def _say(text: str) -> None:
    print(f"skyspot node env: {text}", flush=True)


# ------------------------------------------------------------------ skyspot's own Python and venv

MIN_PYTHON = (3, 10)
"""torch 2.13 and the stack's pins are built for 3.10 on."""
MANAGED_PYTHON = "3.12"
"""What uv installs where the image has no Python new enough (uv's python-build-standalone build)."""


def _probe(python: str, environ: Mapping[str, str]) -> Optional[dict]:
    """The interpreter's version, tag and prefix, asked of it (None if it does not run)."""
    code = (
        "import json, platform, sys; libc, v = platform.libc_ver(); "
        "impl = 'cp' if sys.implementation.name == 'cpython' else sys.implementation.name; "
        "print(json.dumps({'version': platform.python_version(), 'info': list(sys.version_info[:2]), "
        "'tag': '%s%d%d-%s-%s%s' % (impl, sys.version_info[0], sys.version_info[1], "
        "platform.machine() or 'unknown', libc or 'libc', v), 'prefix': sys.prefix}))"
    )
    try:
        done = subprocess.run([python, "-c", code], env=_tool_env(environ), capture_output=True, text=True, timeout=60)
        return json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def find_python(uv: str, environ: Mapping[str, str], floor: Tuple[int, int] = MIN_PYTHON) -> Tuple[str, str]:
    """(an interpreter >= `floor`, the wheel's stack's oldest Python, and where it came from: 'image' or
    'uv-managed'): the one setup runs on where it is new enough, else the image's own (`uv python find`, which looks on PATH and in uv's own installs), else uv's managed
    Python, installed now (on a cloud node uv downloads it from python-build-standalone;
    UV_PYTHON_INSTALL_MIRROR / UV_PYTHON_DOWNLOADS_JSON_URL point it elsewhere)."""
    wanted = ">=%d.%d" % floor
    managed = max(MANAGED_PYTHON, "%d.%d" % floor, key=lambda v: tuple(map(int, v.split("."))))
    if sys.version_info[:2] >= floor:
        # The interpreter setup runs on: the image's python3 through SkyPilot's venv or conda's base, which
        # the venv only borrows the interpreter of (uv venv takes a venv's base; no site-packages of theirs).
        return sys.executable, "image"
    env = _tool_env(environ)
    env.pop("VIRTUAL_ENV", None)  # SkyPilot's or conda's env is not a request for that interpreter
    env.pop("CONDA_PREFIX", None)
    found = subprocess.run(
        [uv, "python", "find", "--no-project", "--system", wanted],
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    if found.returncode == 0 and found.stdout.strip():
        return found.stdout.strip().splitlines()[-1], "image"
    _say(f"no Python {wanted} on this image: installing uv's managed Python {managed}")
    _run([uv, "python", "install", "--no-bin", managed], environ, f"installing Python {managed} with uv")
    found = subprocess.run(
        [uv, "python", "find", "--no-project", "--managed-python", managed],
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    if found.returncode != 0 or not found.stdout.strip():
        raise NodeEnvError(f"uv installed Python {managed} but cannot find it: {found.stderr.strip()[-300:]}")
    return found.stdout.strip().splitlines()[-1], "uv-managed"


def make_venv(uv: str, venv: Path, environ: Mapping[str, str], floor: Tuple[int, int] = MIN_PYTHON) -> dict:
    """skyspot's own venv at `venv` (made again when it is missing or on a Python below 3.10), with none
    of the image's packages: conda's base or the image's site-packages
    are neither read nor written. Returns the venv's interpreter facts."""
    python = str(venv / "bin" / "python")
    facts = _probe(python, environ) if (venv / "bin" / "python").exists() else None
    if facts and tuple(facts["info"]) >= floor:
        return facts
    base, origin = find_python(uv, environ, floor)
    # No --seed: seeding pip needs the index, and a recovery installs from the wheelhouse with none
    # (build_from_index adds pip when it needs it).
    _run(
        [uv, "venv", "--quiet", "--clear", "--no-project", "--python", base, str(venv)],
        environ,
        f"making skyspot's venv at {venv}",
    )
    facts = _probe(python, environ)
    if not facts:
        raise NodeEnvError(f"skyspot's venv at {venv} (from {base}) has no working python")
    said = {"image": "the image's", "uv-managed": "uv's managed"}[origin]
    _say(f"made skyspot's venv {venv} on {said} Python {facts['version']} ({base})")
    return {**facts, "origin": origin}


def _previous_origin(installed: Path) -> Optional[str]:
    """How an earlier setup got the venv's interpreter (a venv kept from then does not say it again)."""
    try:
        return json.loads(installed.read_text()).get("python_origin")
    except (OSError, ValueError, AttributeError):
        return None


# ------------------------------------------------------------------ a setup that cannot mend the node


def _os_name(path: Path = Path("/etc/os-release")) -> Optional[str]:
    # By hand: platform.freedesktop_os_release() is 3.10+, and this runs on the image's Python, 3.8 on.
    try:
        for line in path.read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.partition("=")[2].strip().strip('"') or None
    except OSError:
        pass
    return None


def failure_facts(environ: Mapping[str, str], driver: Optional[str] = None) -> dict:
    """What a failure line names: the driver, the bootstrap Python, the image (SKYSPOT_IMAGE where the
    task says it, else the OS the image is: setup reads no metadata service) and the instance (SkyPilot's
    cluster info)."""
    instance = None
    try:
        info = json.loads(environ.get("SKYPILOT_CLUSTER_INFO") or "{}")
        if isinstance(info, dict) and info.get("instance_type"):
            instance = "%s %s" % (info.get("cloud") or "", info["instance_type"])
    except ValueError:
        pass
    return {
        "driver": driver or "none",
        "python": f"{platform.python_version()} ({sys.executable})",
        "image": environ.get("SKYSPOT_IMAGE") or _os_name() or "unknown",
        "instance": (instance or "unknown").strip(),
    }


def record_failure(error: str, environ: Mapping[str, str], driver: Optional[str]) -> str:
    """The one line a setup that cannot mend its node ends with; also kept as
    `<SKYSPOT_STORE_MOUNT>/<run>/setup/node-<rank>.json` where the store is mounted, so `status` can say why."""
    facts = failure_facts(environ, driver)
    line = (
        f"{error.splitlines()[0]} [node: driver {facts['driver']}, python {facts['python']}, "
        f"image {facts['image']}, instance {facts['instance']}]"
    )
    context = node_context(None, environ)
    if environ.get("SKYSPOT_STORE_MOUNT") and context.run:
        target = Path(environ["SKYSPOT_STORE_MOUNT"]) / context.run / "setup" / f"node-{context.node_rank}.json"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(
                json.dumps(
                    {
                        "type": "setup_failed",
                        "error": error,
                        "driver": facts["driver"],
                        "python": facts["python"],
                        "image": facts["image"],
                        "instance": facts["instance"],
                        "ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    }
                )
            )
        except OSError:
            pass  # a read-only mount: the line in the log still says it
    return line


# ------------------------------------------------------------------ the setup step


def setup(
    wheel: Path,
    store: Optional[str],
    environ: Mapping[str, str] = os.environ,
    python: Optional[str] = None,
    extras: Sequence[str] = (),
) -> str:
    """Install skyspot and its stack into skyspot's own venv (`python`: an interpreter whose environment
    to use instead, for tests and the GPU check), with the wheel's `extras` the recipe needs (wandb,
    mlflow: they are in the requirement set, so in the wheelhouse key); returns where it came from
    ('installed', 'wheelhouse' or 'index')."""
    from skyspot.libpath import clean_environ

    started = time.monotonic()
    environ = {**environ, "LD_LIBRARY_PATH": clean_environ(environ)}  # the tools and the venv see torch's own libs
    uv = find_uv(environ)
    if python is None:
        facts = make_venv(uv, venv_path(environ), environ, python_floor(wheel))
        python = str(venv_path(environ) / "bin" / "python")
    else:
        facts = _probe(python, environ)
        if not facts:
            raise NodeEnvError(f"{python} does not run")
    tag = facts["tag"]
    driver = driver_version()
    declared = wheel_requirements(wheel, extras)
    torch = torch_version(declared)
    lines = cuda_lines(driver, torch, environ.get("SKYSPOT_TORCH_INDEX") or PYTORCH_INDEX)
    plans = [(line, requirements_for(declared, line)) for line in lines]
    plans = [(line, reqs, wheelhouse_key(tag, line, reqs)) for line, reqs in plans]
    _say(
        f"Python {facts['version']} ({tag}) in {facts['prefix']}, NVIDIA driver {driver or 'none'}: torch {torch} "
        f"from {' then '.join('%s (%s)' % (ln.index_url or 'PyPI', ln.name) for ln, _, _ in plans)}"
    )
    installed = Path(facts["prefix"]) / INSTALLED
    try:
        done = json.loads(installed.read_text())
        if any((done.get("key"), done.get("wheel")) == (key, wheel.name) for _, _, key in plans):
            _say("already installed here")
            return "installed"
    except (OSError, ValueError):
        pass
    context = node_context(store, environ)
    cache = Path(environ.get("HOME", "~")).expanduser() / ".cache" / "skyspot" / "wheelhouse"
    source, problem, chosen = "index", None, plans[0]
    # A store root with nothing in it yet has no folder in a bucket mount either: "no wheelhouse" is
    # every first start's case and goes unsaid. Any line's whole wheelhouse will do (a first start that
    # fell back to the next line kept its own).
    if context.wheelhouses is not None:
        for plan in plans:
            line, requirements, key = plan
            try:
                _, problem = wheelhouse.fetch(context.wheelhouses / key, cache / key, key, wheelhouse.node_key(environ))
            except OSError as error:  # a read through the mount that fails half-way: the index can still serve
                problem = f"it could not be read ({error})"
            if problem is None:
                try:
                    install_offline(python, uv, cache / key, wheel, environ)
                    source, chosen = "wheelhouse", plan
                    break
                except NodeEnvError as error:
                    problem = f"it did not install ({str(error).splitlines()[0]})"
            if problem == "no wheelhouse":
                problem = None
            elif problem is not None:
                _say(
                    f"the run's wheelhouse is refused: {problem}; nothing from it is installed, installing "
                    f"from the index ({key})"
                )
                break
    if source == "index":
        for at, plan in enumerate(plans):
            line, requirements, key = plan
            try:
                build_from_index(python, uv, requirements, line, cache / key, environ)
            except NodeEnvError as error:
                if at + 1 == len(plans):
                    raise
                following = plans[at + 1][0]
                _say(
                    f"torch {torch} for {line.name} did not resolve from {line.index_url or 'PyPI'} "
                    f"({str(error).splitlines()[-1].strip()[:160]}); trying {following.name}, the next line "
                    f"driver {driver} runs"
                )
                continue
            chosen = plan
            install_offline(python, uv, cache / key, wheel, environ)
            break
    line, requirements, key = chosen
    # Read back by the node's facts (trainer/node_facts.py): where the stack and the interpreter came from.
    installed.write_text(
        json.dumps(
            {
                "key": key,
                "wheel": wheel.name,
                "source": source,
                "cuda_line": line.name,
                "python_origin": facts.get("origin") or _previous_origin(installed),
            }
        )
    )
    origin = "the run's wheelhouse" if source == "wheelhouse" else "the index"
    _say(f"installed from {origin} in {time.monotonic() - started:.1f}s: torch {torch} ({line.name}), wheelhouse {key}")
    if source == "index" and context.wheelhouses is not None and context.node_rank == 0 and store:
        # The installed skyspot writes it, through the store's SDK (durability explicit, as for checkpoints).
        proc = subprocess.run(
            [
                python,
                "-m",
                "skyspot.node_env",
                "save",
                "--store",
                store,
                "--run",
                context.run,
                "--key",
                key,
                "--local",
                str(cache / key),
                "--cuda-line",
                line.name,
                *(["--index-url", line.index_url] if line.index_url else []),
                *(["--replace"] if problem else []),
                *[a for r in requirements for a in ("--requirement", r)],
            ],
            env=_tool_env(environ),
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            _say("the wheelhouse was not kept (see above); later starts install from the index")
    return source


def save(
    store_uri: str, run: str, key: str, local: Path, line: CudaLine, requirements: Sequence[str], replace: bool = False
) -> None:
    """Keep a wheelhouse built in `local` in the run's store, its marker last (`replace`: one that was
    found broken goes, marker first). Runs in the installed venv."""
    from skyspot.storage import join_key, open_store

    started = time.monotonic()
    store = open_store(store_uri)
    prefix = join_key(run, "wheelhouse", key)
    if replace:
        store.delete([join_key(prefix, MARKER)])  # no reader trusts it while its files are replaced
    elif store.exists(join_key(prefix, MARKER)):
        _say("the run's wheelhouse is already there")
        return
    run_key = wheelhouse.node_key(os.environ)
    if run_key is None:  # unsigned, no node would take it
        raise NodeEnvError(f"this node has no wheelhouse key ({wheelhouse.KEY_ENV}): the wheelhouse is not kept")
    manifest = wheelhouse.sign(manifest_for(local, key, line, requirements), run_key)
    store.upload_dir(local, prefix, sorted(manifest["files"]))
    store.put_bytes(join_key(prefix, MARKER), json.dumps(manifest, indent=1, sort_keys=True).encode())
    size = sum(f["size"] for f in manifest["files"].values())
    _say(
        f"kept the wheelhouse in {store_uri.rstrip('/')}/{prefix}/ ({len(manifest['files'])} files, "
        f"{size / 1e9:.2f} GB) in {time.monotonic() - started:.1f}s"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m skyspot.node_env", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("setup", help="install skyspot and its stack (the task's setup runs this)")
    one.add_argument("--wheel", required=True, type=Path)
    one.add_argument("--store", default=None)
    one.add_argument("--extras", default="", help="the wheel's extras to install too, comma-separated (wandb,mlflow)")
    one.add_argument(
        "--python",
        default=None,
        help="install into this interpreter's environment instead of "
        "skyspot's own venv ($SKYSPOT_VENV, else ~/.skyspot/venv)",
    )
    keep = sub.add_parser("save", help="keep a wheelhouse in the run's store (setup runs this after an index install)")
    keep.add_argument("--store", required=True)
    keep.add_argument("--run", required=True)
    keep.add_argument("--key", required=True)
    keep.add_argument("--local", required=True, type=Path)
    keep.add_argument("--cuda-line", required=True, choices=[line.name for line in CUDA_LINES])
    keep.add_argument("--requirement", action="append", default=[])
    keep.add_argument(
        "--index-url", default=None, help="the line's index (a mirror's, where SKYSPOT_TORCH_INDEX set one)"
    )
    keep.add_argument("--replace", action="store_true", help="the wheelhouse there was found broken: replace it")
    args = parser.parse_args(argv)
    try:
        if args.command == "setup":
            setup(
                args.wheel,
                args.store,
                python=args.python,
                extras=[e.strip() for e in args.extras.split(",") if e.strip()],
            )
        else:
            line = next(line for line in CUDA_LINES if line.name == args.cuda_line)
            line = replace(line, index_url=args.index_url) if args.index_url and line.index_url else line
            save(args.store, args.run, args.key, args.local, line, args.requirement, args.replace)
    except NodeEnvError as error:
        if args.command == "setup":  # what setup cannot mend: one line naming the node, kept where status reads it
            if "\n" in str(error):
                print(str(error).split("\n", 1)[1], file=sys.stderr)  # the tool's own tail, above the line
            print(f"skyspot node env: {record_failure(str(error), os.environ, driver_version())}", file=sys.stderr)
            return EXIT_USAGE
        print(f"skyspot node env: {error}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as error:  # noqa: BLE001 - keeping the wheelhouse is an optimisation, never fatal
        if args.command == "setup":
            raise
        print(f"skyspot node env: the wheelhouse was not kept: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
