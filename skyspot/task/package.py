"""The skyspot a cloud node installs: a wheel of the skyspot that is running here, and what it requires.

A node starts from the cloud's image with nothing of ours on it, and skyspot is on no
package index. So `launch` packages the running skyspot (an editable checkout or an
installed wheel alike) into a wheel, cached under `$SKYSPOT_HOME/packages/<hash>/`, and
the task mounts that folder at PACKAGE_MOUNT; the task's `setup` installs exactly that
file (node_env.py says how, and from where).

The wheel's requirements pin the training stack (TRAINING_STACK: torch, DeepSpeed,
transformers, peft, accelerate, safetensors) to the versions installed here, so every node
trains with the numerics and checkpoint format tested on the launching machine; every other
requirement keeps its declared range, so the node resolves it for its own interpreter (the
images' Python is not this machine's: numpy 2.4.6 and typer 0.29.2 have no Python 3.10 build).
A local build of torch (`2.13.0+cpu`) is pinned without its local label (`torch==2.13.0`): the
node picks the CUDA build its driver runs (node_env.cuda_line).

The wheel holds an allow-list of what the package reads (PACKAGE_FILES: its Python modules, the
recipes, the price snapshot), never a dotfile, a dot-folder or a link: an editable checkout's
`.env`, `.ipynb_checkpoints/`, `*.orig` or an editor's swap file stays on this machine.

The wheel is written here rather than by `pip wheel` / `python -m build`: those need a
build backend in the environment (or the network, for build isolation), and an installed
skyspot has no source tree to build from. A wheel is a zip with three metadata files
(PEP 427, PEP 376), written from the package files that are running, the same way in
both cases; fixed timestamps and sorted entries make it reproducible, so its content
hash names the cache entry and a rebuilt, unchanged skyspot reuses it.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import io
import os
import re
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterable, Optional

import skyspot

PACKAGE_MOUNT = "/skyspot/package"
"""Where the wheel's folder is mounted on every node (the task's `file_mounts`)."""

PLACEHOLDER = "<skyspot wheel folder, built by `skyspot launch`>"
"""The mount source in rendered tasks (tasks/*.yaml, `render`): the real folder exists only at launch."""

# What the node does not need: SkyPilot (the node runs under SkyPilot's own runtime; it never
# launches jobs), plotting (cost-report runs where the user is) and uv (SkyPilot puts it on every node).
NOT_ON_NODES = {"skypilot", "matplotlib", "uv"}

# The extras a recipe may need on its nodes (the dashboards' libraries, metrics.backends): in the wheel's
# metadata as extras, installed by node_env only for a recipe that names them (task/render.py).
NODE_EXTRAS = ("tensorboard", "wandb", "mlflow")
TRAINING_STACK = {"torch", "deepspeed", "transformers", "peft", "accelerate", "safetensors"}
"""Pinned to this machine's versions on every node: what decides the numerics and the checkpoint format."""

PACKAGE_FILES = {"recipes": ("*.yaml",), "pricing/pricing_data": ("*.csv", "*.md")}
"""Besides every module (`*.py`), the data files the package reads, per folder of the package."""

_FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest zip timestamp: the same bytes on every build


@dataclass(frozen=True)
class Package:
    wheel: Path
    """The wheel file, inside its own cache folder (the folder is what the task mounts)."""
    version: str
    requirements: tuple[str, ...]

    @property
    def folder(self) -> Path:
        return self.wheel.parent


def _package_files(root: Path) -> list[Path]:
    """The files of the package folder `root` that the wheel ships: the allow-list, never a dotfile or a link."""
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if (
            any(part.startswith(".") for part in rel.parts)
            or "__pycache__" in rel.parts
            or path.is_symlink()
            or not path.is_file()
        ):
            continue
        folder = rel.parent.as_posix()
        if path.suffix == ".py" or any(fnmatch.fnmatchcase(rel.name, p) for p in PACKAGE_FILES.get(folder, ())):
            files.append(path)
    return files


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def node_requirements(declared: Optional[Iterable[str]] = None) -> tuple[str, ...]:
    """skyspot's declared requirements for a node: the training stack pinned to the version installed
    here, the rest as declared.

    `declared` defaults to pyproject.toml's dependencies when skyspot runs from its checkout (an
    editable install's metadata is only as new as its last `pip install -e`), else to the
    installed skyspot's metadata. A training-stack requirement not installed here keeps its range.
    """
    if declared is None:
        declared = _checkout_dependencies() or metadata.requires("skyspot") or []
    pinned = []
    for requirement in declared:
        if ";" in requirement and "extra ==" in requirement:
            if _extra_of(requirement) in NODE_EXTRAS:
                pinned.append(requirement.strip())  # installed on a node only when its recipe asks (node_env --extras)
            continue  # the other extras (test, clouds) are not the node's stack
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
        if not match:
            continue
        name = match.group(1)
        if _canonical(name) in NOT_ON_NODES:
            continue
        if _canonical(name) not in TRAINING_STACK:
            pinned.append(requirement.strip())
            continue
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            pinned.append(requirement.strip())
            continue
        pinned.append(f"{name}=={version.split('+', 1)[0]}")
    return tuple(sorted(pinned, key=str.lower))


NODE_PYTHONS = ("3.10", "3.11", "3.12", "3.13", "3.14")
"""The Pythons a node may end on, oldest first (node_env.py makes skyspot's venv on one of them)."""


def python_floor(requirements: Iterable[str]) -> str:
    """The oldest Python every pinned package of `requirements` (`name==version`, installed here) supports,
    from each one's own Requires-Python: what the node wheel's Requires-Python says, and so the oldest
    interpreter node_env makes skyspot's venv on. (accelerate 1.16.0 needs 3.11: pinned from a machine
    that has it, a 3.10 image's own Python cannot install the stack.)"""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    specs = []
    for requirement in requirements:
        name, sep, version = requirement.partition("==")
        if not sep or ";" in requirement:
            continue
        try:
            dist = metadata.distribution(name.strip())
            if dist.version.split("+", 1)[0] != version.strip():
                continue  # pinned, but not to what is installed here: nothing to read
            spec = dist.metadata.get("Requires-Python")
            if spec:
                specs.append(SpecifierSet(spec))
        except (metadata.PackageNotFoundError, InvalidSpecifier):
            continue
    for candidate in NODE_PYTHONS:
        if all(spec.contains(f"{candidate}.0") or spec.contains(f"{candidate}.99") for spec in specs):
            return candidate
    return NODE_PYTHONS[-1]


def _extra_of(requirement: str) -> Optional[str]:
    match = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", requirement)
    return match.group(1) if match else None


def _checkout_dependencies() -> Optional[list[str]]:
    pyproject = Path(skyspot.__file__).resolve().parent.parent / "pyproject.toml"
    try:
        import tomllib

        project = tomllib.loads(pyproject.read_text()).get("project", {})
    except (ImportError, OSError, ValueError):
        return None
    if project.get("name") != "skyspot":
        return None
    extras = project.get("optional-dependencies") or {}
    return list(project.get("dependencies") or []) + [
        f"{r}; extra == '{name}'" for name in NODE_EXTRAS for r in extras.get(name, [])
    ]


def _metadata_files(version: str, requirements: tuple[str, ...]) -> dict[str, bytes]:
    dist_info = f"skyspot-{version}.dist-info"
    meta = [
        "Metadata-Version: 2.1",
        "Name: skyspot",
        f"Version: {version}",
        f"Requires-Python: >={python_floor(requirements)}",
        *(f"Provides-Extra: {e}" for e in NODE_EXTRAS if any(_extra_of(r) == e for r in requirements)),
        *(f"Requires-Dist: {r}" for r in requirements),
    ]
    wheel = [
        "Wheel-Version: 1.0",
        f"Generator: skyspot {skyspot.__version__}",
        "Root-Is-Purelib: true",
        "Tag: py3-none-any",
    ]
    entry_points = ["[console_scripts]", "skyspot = skyspot.cli.main:main"]
    return {
        f"{dist_info}/METADATA": ("\n".join(meta) + "\n").encode(),
        f"{dist_info}/WHEEL": ("\n".join(wheel) + "\n").encode(),
        f"{dist_info}/entry_points.txt": ("\n".join(entry_points) + "\n").encode(),
    }


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _wheel_bytes(entries: dict[str, bytes]) -> bytes:
    dist_info = next(name.split("/")[0] for name in entries if name.endswith(".dist-info/WHEEL"))
    record_name = f"{dist_info}/RECORD"
    record = "\n".join([*(_record_line(n, d) for n, d in sorted(entries.items())), f"{record_name},,"]) + "\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in [*sorted(entries.items()), (record_name, record.encode())]:
            info = zipfile.ZipInfo(name, date_time=_FIXED_TIME)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    return buffer.getvalue()


def build(
    cache_root: Optional[Path] = None, *, source: Optional[Path] = None, declared: Optional[Iterable[str]] = None
) -> Package:
    """The wheel of the running skyspot (or of `source`, a `skyspot` package folder), built once per content."""
    from skyspot.ledger import skyspot_home

    root = Path(source) if source else Path(skyspot.__file__).resolve().parent
    requirements = node_requirements(declared)
    files = {f"skyspot/{p.relative_to(root).as_posix()}": p.read_bytes() for p in _package_files(root)}
    content = hashlib.sha256()
    for name, data in sorted(files.items()):
        content.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    content.update("\n".join(requirements).encode())
    digest = content.hexdigest()[:16]
    version = f"{skyspot.__version__}+{digest}"  # a local version label: this exact build
    folder = (cache_root or skyspot_home() / "packages") / digest
    wheel = folder / f"skyspot-{version}-py3-none-any.whl"
    if not wheel.is_file():
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        data = _wheel_bytes({**files, **_metadata_files(version, requirements)})
        partial = folder / f".{wheel.name}.{os.getpid()}.partial"
        partial.write_bytes(data)
        os.replace(partial, wheel)  # a concurrent launch sees the whole file or none
    return Package(wheel=wheel, version=version, requirements=requirements)
