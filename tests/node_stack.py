"""The small stack `node_env setup` runs on for real (tests/test_node_env.py, tests/test_wheelhouse.py).

A PEP 503 index on this disk holding one small wheel built here (standing for PyPI), skyspot's wheel
declaring it, new venvs with pip standing for skyspot's venv on a node, and `setup` itself in a subprocess.

Fixtures (session-scoped, shared by both modules, each made on first use): `small_stack`; `new_node`, which
makes a node's venv by copying one made once with `python -m venv` (about 4 s of CPU each: pip's install and
bytecode), its own paths rewritten; `first_start`, node n1's first start of run r1 against the index, which
keeps the wheelhouse every later node of these tests reads (each test changes a copy of its store).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import pytest

from skyspot.task import package as packaging

RUN_KEY = "ab" * 32  # the run's wheelhouse key, as the launch makes it (wheelhouse.py) and SkyPilot passes it


def _simple_index(root: Path, wheel: Path) -> str:
    """A PEP 503 index on disk with one project."""
    project = root / "simple" / "tinydep"
    project.mkdir(parents=True)
    (project / wheel.name).write_bytes(wheel.read_bytes())
    (project / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>\n')
    (root / "simple" / "index.html").write_text('<a href="tinydep/">tinydep</a>\n')
    return (root / "simple").as_uri()


def _tinydep_wheel(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    entries = {
        "tinydep/__init__.py": b"VALUE = 42\n",
        "tinydep-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinydep\nVersion: 1.0\n",
        "tinydep-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    wheel = folder / "tinydep-1.0-py3-none-any.whl"
    wheel.write_bytes(packaging._wheel_bytes(entries))
    return wheel


@pytest.fixture(scope="session")
def small_stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("node-env")
    index = _simple_index(root / "index", _tinydep_wheel(root / "built"))
    skyspot_wheel = packaging.build(root / "packages", declared=["tinydep>=1.0"]).wheel
    return root, index, skyspot_wheel


@pytest.fixture(scope="session")
def new_node(tmp_path_factory) -> Callable[[Path, str], Path]:
    """`new_node(root, name)`: a new venv at `root / name` with pip (as `uv venv --seed` makes it)."""
    template = tmp_path_factory.mktemp("node-venv") / "venv"
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", str(template)], check=True)

    def make(root: Path, name: str) -> Path:
        venv = root / name
        shutil.copytree(template, venv, symlinks=True)
        # What names the venv's own path: pyvenv.cfg, the activate scripts and pip's shebangs. The
        # interpreter finds its prefix from where pyvenv.cfg is, so nothing else needs to move (the .pyc
        # files still name the template in their tracebacks; no check reads them).
        for path in [venv / "pyvenv.cfg", *(venv / "bin").iterdir()]:
            if path.is_file() and not path.is_symlink():
                path.write_bytes(path.read_bytes().replace(bytes(template), bytes(venv)))
        return venv

    return make


def _setup(venv: Path, wheel: Path, store: Path, index: str, home: Path, **extra: str):
    """setup with `venv` as skyspot's venv (SKYSPOT_VENV; it is there, on a Python >= 3.10, so setup keeps it)."""
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "SKYSPOT_RUN_NAME": "r1",
        "SKYPILOT_SETUP_NODE_RANK": "0",
        "SKYSPOT_VENV": str(venv),
        "SKYSPOT_WHEELHOUSE_KEY": RUN_KEY,
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": index,
        "UV_INDEX_URL": index,
        "UV_NO_CACHE": "1",
        "PYTHONPATH": str(wheel),
        **extra,
    }
    return subprocess.run(
        [str(venv / "bin" / "python"), "-m", "skyspot.node_env", "setup", "--wheel", str(wheel), "--store", str(store)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _imports_tinydep(venv: Path) -> bool:
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import tinydep, skyspot; print(tinydep.VALUE)"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        cwd="/",
    )
    return done.stdout.strip() == "42"


class FirstStart(NamedTuple):
    done: subprocess.CompletedProcess
    """Its setup, run: the tests assert on its exit and output."""
    store: Path
    """The local store it kept the wheelhouse in, shared by the session: never given to setup or changed;
    `store_for` gives a test its own copy."""

    def store_for(self, tmp_path: Path) -> Path:
        """The store as the first start left it, copied to `tmp_path / "store"`: the test's own to change."""
        return Path(shutil.copytree(self.store, tmp_path / "store"))


@pytest.fixture(scope="session")
def first_start(small_stack, new_node, tmp_path_factory) -> FirstStart:
    """Node n1's first start of run r1 with the index up: it installs from the index and keeps the wheelhouse."""
    root, index, wheel = small_stack
    folder = tmp_path_factory.mktemp("first-start")
    store = folder / "store"
    return FirstStart(_setup(new_node(folder, "n1"), wheel, store, index, folder / "h1"), store)
