"""The node's Python environment: what `setup` installs on a fresh VM, from where, and for which CUDA.

    PYTHONPATH="$WHEEL" python -m skyspot.node_env setup --wheel "$WHEEL" [--store URI]

Run by the task's `setup` (task/render.py) with the node's own interpreter, from inside the skyspot wheel
(a wheel is a zip, which Python imports from): skyspot is not installed yet, so everything before
the install is the standard library, and it runs on every Python a cloud image has (3.10 on the
Ubuntu 22.04 images SkyPilot boots, 3.12 on 24.04).

**Why the node resolves for itself.** SkyPilot runs setup in a venv it makes from the image's
`python3` (`uv venv --seed --relocatable --system-site-packages --python "$(command -v python3)"`,
sky/skylet/constants.py), so the node's interpreter is whatever the image has, not the launching
machine's. The wheel's requirements (task/package.py) pin the training stack exactly (torch, DeepSpeed,
transformers, peft, accelerate, safetensors: what decides the numerics and the checkpoint format,
all built for every Python from 3.10 on) and give everything else its declared range, so uv, on
the node, picks the newest build of each that exists for that interpreter and platform (numpy
2.2.6 on 3.10, where the launching machine's 2.4.6 has no build). Resolving locks per interpreter
at launch (`uv pip compile --python-version ...`) was the other way: it needs the index at every
launch and render, a lock per Python x CUDA line, and still cannot know the image's interpreter.

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

**CUDA that matches the driver** (`cuda_line`): torch's PyPI wheels for Linux are CUDA builds;
torch 2.13.0's is CUDA 13 (it depends on cuda-toolkit 13.0.x and nvidia-nccl-cu13), which needs a
driver >= 580.65.06. Older drivers get a CUDA 12 build from PyTorch's own index, with the local
version label (`torch==2.13.0+cu128`), so the release stays the one tested. No driver (a CPU node,
or nvidia-smi missing): PyPI's default.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

MARKER = "WHEELHOUSE.json"
"""Written last into a wheelhouse: without it (or with a file it does not vouch for) the wheelhouse does not exist."""
LOCK = "requirements.lock"
INSTALLED = "skyspot-node-env.json"
"""In the venv: the key and wheel it holds, so a rerun of setup on the same machine installs nothing."""
PYTORCH_INDEX = "https://download.pytorch.org/whl"


class NodeEnvError(Exception):
    """Setup cannot install a working environment; the message is one line saying what to do."""


@dataclass(frozen=True)
class CudaLine:
    name: str
    """`pypi` (PyPI's own torch build) or PyTorch's index name for a CUDA line (`cu128`)."""
    min_driver: tuple[int, ...]
    """The oldest NVIDIA driver the build runs on."""
    index_url: Optional[str]
    """The index the build comes from; None for PyPI."""

    @property
    def local_label(self) -> str:
        return "" if self.index_url is None else f"+{self.name}"


# Newest first. Driver minimums from NVIDIA's CUDA release notes (Table 3, "CUDA Toolkit and Minimum
# Required Driver Version"): 13.0 needs 580.65.06; 12.8 GA shipped with 570.26; every CUDA 12.x build
# runs on >= 525.60.13 under CUDA minor version compatibility (PyTorch's wheels carry their kernels
# as SASS for the GPUs they support, so nothing needs the driver's newer PTX JIT). The lines are the
# ones PyTorch publishes beside PyPI's CUDA 13 build (cu126, cu128, cu130 since 2.9; its
# .github/scripts/generate_binary_build_matrix.py, CUDA_ARCHES); move this table with the torch pin.
PYPI = CudaLine("pypi", (580, 65, 6), None)
CUDA_LINES = (
    PYPI,
    CudaLine("cu128", (570, 26), f"{PYTORCH_INDEX}/cu128"),
    # cu126 rather than cu128 below 570: the 12.6 builds still carry kernels for Volta (sm_70), the
    # oldest GPUs on 535-era images, and are the nearest line to those drivers.
    CudaLine("cu126", (525, 60, 13), f"{PYTORCH_INDEX}/cu126"),
)


def parse_driver(text: Optional[str]) -> Optional[tuple[int, ...]]:
    """'535.183.01' -> (535, 183, 1); None or anything unparsable -> None."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", text or "")
    return tuple(int(p) for p in match.group(1).split(".")) if match else None


def cuda_line(driver: Optional[str]) -> CudaLine:
    """Which torch build a node with this NVIDIA driver version installs (None: no driver, PyPI's default)."""
    version = parse_driver(driver)
    if version is None:
        return PYPI
    for line in CUDA_LINES:
        if version >= line.min_driver:
            return line
    oldest = ".".join(map(str, CUDA_LINES[-1].min_driver))
    raise NodeEnvError(f"the NVIDIA driver {driver.strip()} is older than any CUDA build of torch skyspot installs "
                       f"(the oldest, {CUDA_LINES[-1].name}, needs >= {oldest}): use an image with a newer driver "
                       "(SkyPilot's default GPU images; docs/clouds.md)")


def driver_version() -> Optional[str]:
    """The first GPU's driver version as nvidia-smi reports it; None without a GPU or nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return lines[0] if out.returncode == 0 and lines and parse_driver(lines[0]) else None


def requirements_for(requirements: Sequence[str], line: CudaLine) -> list[str]:
    """The wheel's requirements with torch's exact pin moved to the line's build (`torch==2.13.0+cu128`)."""
    out = []
    for requirement in requirements:
        match = re.fullmatch(r"\s*torch\s*==\s*([0-9][0-9a-zA-Z.]*)\s*", requirement)
        out.append(f"torch=={match.group(1)}{line.local_label}" if match and line.local_label else requirement.strip())
    return out


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
    return (f"{implementation}{sys.version_info[0]}{sys.version_info[1]}-{platform.machine() or 'unknown'}"
            f"-{libc or 'libc'}{version}")


def wheelhouse_key(tag: str, line: CudaLine, requirements: Sequence[str]) -> str:
    """One name per interpreter + platform + CUDA line + requirement set."""
    digest = hashlib.sha256("\n".join([line.index_url or "pypi", *sorted(requirements)]).encode()).hexdigest()
    return f"{tag}-{line.name}-{digest[:16]}"


# ------------------------------------------------------------------ reading a wheelhouse


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_marker(folder: Path) -> tuple[Optional[dict], Optional[str]]:
    """(the marker, None) when the wheelhouse's marker is there and every file it names has its size; else (None, why)."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        files = marker["files"]
        if not isinstance(files, dict) or LOCK not in files:
            raise ValueError("no file list")
    except FileNotFoundError:
        return None, "no wheelhouse" if not folder.exists() else f"no {MARKER} (a first start that did not finish)"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"{MARKER} unreadable ({error})"
    for name, entry in files.items():
        if "/" in name or name.startswith(".") or not isinstance(entry, dict):
            return None, f"{MARKER} names {name!r} as {entry!r}"
        try:
            size = (folder / name).stat().st_size
        except OSError:
            return None, f"{name} is missing"
        if size != entry.get("size"):
            return None, f"{name} has {size} bytes, {MARKER} says {entry.get('size')}"
    return marker, None


def fetch(folder: Path, local: Path) -> tuple[Optional[dict], Optional[str]]:
    """Copy a wheelhouse (read through the bucket mount) to `local`, checking every file's sha256 on the way."""
    marker, problem = read_marker(folder)
    if marker is None:
        return None, problem
    if local.exists():
        shutil.rmtree(local)
    local.mkdir(parents=True)
    for name, entry in sorted(marker["files"].items()):
        h = hashlib.sha256()
        with open(folder / name, "rb") as src, open(local / name, "wb") as dst:
            for chunk in iter(lambda: src.read(8 << 20), b""):
                h.update(chunk)
                dst.write(chunk)
        if h.hexdigest() != entry.get("sha256"):
            shutil.rmtree(local, ignore_errors=True)
            return None, f"{name} does not match its sha256 in {MARKER}"
    return marker, None


def manifest_for(local: Path, key: str, line: CudaLine, requirements: Sequence[str]) -> dict:
    """The marker for a wheelhouse built in `local` (written into it last, by `save`)."""
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(local.iterdir()) if p.is_file() and not p.name.startswith(".") and p.name != MARKER}
    return {"key": key, "interpreter": interpreter_tag(), "python": platform.python_version(),
            "cuda_line": line.name, "index_url": line.index_url, "requirements": list(requirements),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "files": files}


# ------------------------------------------------------------------ installing


def find_uv(environ: Mapping[str, str] = os.environ) -> str:
    """uv as SkyPilot installs it on every node ($HOME/.local/bin/uv), or on PATH."""
    found = shutil.which("uv", path=environ.get("PATH"))
    home_uv = Path(environ.get("HOME", "~")).expanduser() / ".local" / "bin" / "uv"
    if found:
        return found
    if home_uv.is_file():
        return str(home_uv)
    raise NodeEnvError("uv is not on this node (SkyPilot installs it in ~/.local/bin): install it "
                       "(`pip install uv`) or use an image SkyPilot prepares")


def _tool_env(environ: Mapping[str, str]) -> dict[str, str]:
    # The wheel is on PYTHONPATH for this process only; the tools must not import skyspot from it.
    # UV_LINK_MODE=copy as SkyPilot's own uv calls set it (sky/skylet/constants.py: hardlinks from a
    # cache on another filesystem fail, and clones strip execute bits on XFS).
    env = {k: v for k, v in environ.items() if k != "PYTHONPATH"}
    env.setdefault("UV_LINK_MODE", "copy")
    return env


def _run(args: list[str], environ: Mapping[str, str], what: str) -> None:
    proc = subprocess.run(args, env=_tool_env(environ), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        raise NodeEnvError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def _index_args(line: CudaLine) -> list[str]:
    # PyTorch's index beside PyPI, each package from whichever has the best match: what pip does with
    # --extra-index-url; torch's exact local version (+cu128) pins it to PyTorch's build.
    return [] if line.index_url is None else ["--extra-index-url", line.index_url,
                                              "--index-strategy", "unsafe-best-match"]


def build_from_index(python: str, uv: str, requirements: Sequence[str], line: CudaLine, local: Path,
                     environ: Mapping[str, str]) -> None:
    """Resolve for this interpreter, then download and build every wheel of the result into `local`."""
    if local.exists():
        shutil.rmtree(local)
    local.mkdir(parents=True)
    wanted = local / ".requirements.in"
    wanted.write_text("\n".join(requirements) + "\n")
    _run([uv, "pip", "compile", "--quiet", "--no-config", "--python", python, "--generate-hashes",
          *_index_args(line), str(wanted), "-o", str(local / LOCK)], environ, "resolving the node's requirements")
    wanted.unlink()
    pip_index = [] if line.index_url is None else ["--extra-index-url", line.index_url]
    # pip, not uv, fetches: uv has no `pip download`/`pip wheel`, and the wheelhouse needs the files
    # themselves (DeepSpeed built from its sdist once). The lock's hashes check every download.
    _run([python, "-m", "pip", "wheel", "--quiet", "--progress-bar", "off", "--disable-pip-version-check",
          "--no-deps", *pip_index, "-r", str(local / LOCK), "-w", str(local)], environ,
         "downloading and building the node's wheels")


def install_offline(python: str, uv: str, local: Path, wheel: Path, environ: Mapping[str, str]) -> None:
    """Install the lock from the wheelhouse's files only, with skyspot's own wheel."""
    # Hashes are not verified again here: the lock's are the sdist's for DeepSpeed (built here), and
    # every file was checked against the wheelhouse's marker on its way to this disk.
    _run([uv, "pip", "install", "--quiet", "--no-config", "--python", python, "--offline", "--no-index",
          "--find-links", str(local), "--no-verify-hashes", "-r", str(local / LOCK), str(wheel)], environ,
         "installing from the wheelhouse")


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
    run = next((v.strip() for v in (environ.get("SKYSPOT_RUN_NAME"), environ.get("SKYPILOT_TASK_ID"))
                if v and v.strip()), None)  # the trainer's run id (trainer/cluster.py), hence its store prefix
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


def setup(wheel: Path, store: Optional[str], environ: Mapping[str, str] = os.environ,
          python: str = sys.executable, extras: Sequence[str] = ()) -> str:
    """Install skyspot and its stack into this interpreter's environment, with the wheel's `extras`
    the recipe needs (wandb, mlflow: they are in the requirement set, so in the wheelhouse key);
    returns where it came from ('installed', 'wheelhouse' or 'index')."""
    started = time.monotonic()
    driver = driver_version()
    line = cuda_line(driver)
    requirements = requirements_for(wheel_requirements(wheel, extras), line)
    key = wheelhouse_key(interpreter_tag(), line, requirements)
    _say(f"Python {platform.python_version()} ({interpreter_tag()}), NVIDIA driver {driver or 'none'}: torch from "
         f"{line.index_url or 'PyPI'} ({line.name}); wheelhouse {key}")
    installed = Path(sys.prefix) / INSTALLED
    record = {"key": key, "wheel": wheel.name}
    try:
        if json.loads(installed.read_text()) == record:
            _say("already installed here")
            return "installed"
    except (OSError, ValueError):
        pass
    uv = find_uv(environ)
    context = node_context(store, environ)
    local = Path(environ.get("HOME", "~")).expanduser() / ".cache" / "skyspot" / "wheelhouse" / key
    source, problem = "index", None
    # A store root with nothing in it yet has no folder in a bucket mount either: "no wheelhouse" is
    # every first start's case and goes unsaid.
    if context.wheelhouses is not None:
        try:
            _, problem = fetch(context.wheelhouses / key, local)
        except OSError as error:  # a read through the mount that fails half-way: the index can still serve
            problem = f"it could not be read ({error})"
        if problem is None:
            try:
                install_offline(python, uv, local, wheel, environ)
                source = "wheelhouse"
            except NodeEnvError as error:
                problem = f"it did not install ({str(error).splitlines()[0]})"
        if problem == "no wheelhouse":
            problem = None
        elif problem is not None:
            _say(f"the run's wheelhouse is ignored: {problem}; installing from the index")
    if source == "index":
        build_from_index(python, uv, requirements, line, local, environ)
        install_offline(python, uv, local, wheel, environ)
    installed.write_text(json.dumps(record))
    origin = "the run's wheelhouse" if source == "wheelhouse" else "the index"
    _say(f"installed from {origin} in {time.monotonic() - started:.1f}s")
    if source == "index" and context.wheelhouses is not None and context.node_rank == 0 and store:
        # The installed skyspot writes it, through the store's SDK (durability explicit, as for checkpoints).
        proc = subprocess.run([python, "-m", "skyspot.node_env", "save", "--store", store, "--run", context.run,
                               "--key", key, "--local", str(local), "--cuda-line", line.name,
                               *(["--replace"] if problem else []),
                               *[a for r in requirements for a in ("--requirement", r)]],
                              env=_tool_env(environ), stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            _say("the wheelhouse was not kept (see above); later starts install from the index")
    return source


def save(store_uri: str, run: str, key: str, local: Path, line: CudaLine, requirements: Sequence[str],
         replace: bool = False) -> None:
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
    manifest = manifest_for(local, key, line, requirements)
    store.upload_dir(local, prefix, sorted(manifest["files"]))
    store.put_bytes(join_key(prefix, MARKER), json.dumps(manifest, indent=1, sort_keys=True).encode())
    size = sum(f["size"] for f in manifest["files"].values())
    _say(f"kept the wheelhouse in {store_uri.rstrip('/')}/{prefix}/ ({len(manifest['files'])} files, "
         f"{size / 1e9:.2f} GB) in {time.monotonic() - started:.1f}s")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m skyspot.node_env", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("setup", help="install skyspot and its stack (the task's setup runs this)")
    one.add_argument("--wheel", required=True, type=Path)
    one.add_argument("--store", default=None)
    one.add_argument("--extras", default="", help="the wheel's extras to install too, comma-separated (wandb,mlflow)")
    keep = sub.add_parser("save", help="keep a wheelhouse in the run's store (setup runs this after an index install)")
    keep.add_argument("--store", required=True)
    keep.add_argument("--run", required=True)
    keep.add_argument("--key", required=True)
    keep.add_argument("--local", required=True, type=Path)
    keep.add_argument("--cuda-line", required=True, choices=[line.name for line in CUDA_LINES])
    keep.add_argument("--requirement", action="append", default=[])
    keep.add_argument("--replace", action="store_true", help="the wheelhouse there was found broken: replace it")
    args = parser.parse_args(argv)
    try:
        if args.command == "setup":
            setup(args.wheel, args.store, extras=[e.strip() for e in args.extras.split(",") if e.strip()])
        else:
            line = next(line for line in CUDA_LINES if line.name == args.cuda_line)
            save(args.store, args.run, args.key, args.local, line, args.requirement, args.replace)
    except NodeEnvError as error:
        print(f"skyspot node env: {error}", file=sys.stderr)
        return 2 if args.command == "setup" else 1
    except Exception as error:  # noqa: BLE001 - keeping the wheelhouse is an optimisation, never fatal
        if args.command == "setup":
            raise
        print(f"skyspot node env: the wheelhouse was not kept: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
