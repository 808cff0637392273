"""The node's environment: the torch build each driver gets, the wheelhouse's key, and `setup` itself.

`setup` runs here for real, in new venvs, with real uv and pip, against a package index on this
disk (a PEP 503 folder holding one small wheel built here, standing for PyPI: tests/node_stack.py) and
the run's wheelhouse in a local store: a first start installs from the index and keeps the wheelhouse, a
second installs from it with the index unreachable, and a partial or corrupt one is ignored
while the index is up. The full stack on a Python 3.10 node is tests/executors/local/test_fresh_node.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from skyspot import node_env, wheelhouse
from skyspot.task import package as packaging
from skyspot.ports import free_port
from tests.node_stack import RUN_KEY, _imports_tinydep, _setup


@pytest.mark.parametrize(
    "driver, lines",
    [
        ("525.60.13", ["cu126"]),  # CUDA 12's minimum under minor version compatibility
        ("535.230.02", ["cu126"]),  # Azure's ubuntu-hpc:2204 fallback, SkyPilot's 535 images
        # Azure's HPC image as SkyPilot's catalog names it (ubuntu-hpc:2204:22.04.2023080201, Azure ND candidates):
        # azhpc-images tag ubuntu-hpc-20230803, ubuntu/common/install_nvidiagpudriver.sh (docs/clouds.md)
        ("535.54.03", ["cu126"]),
        ("580.126.16", ["pypi", "cu126"]),  # the current 22.04 HPC build (azhpc-images versions.json)
        ("550.90.07", ["cu126"]),
        ("570.172.08", ["cu126"]),  # the AWS DLAMI of August 2025: torch 2.13 has no cu128 build
        ("575.57.08", ["cu126"]),
        ("580.00", ["cu126"]),  # a 580 below CUDA 13's minimum
        ("580.65.06", ["pypi", "cu126"]),  # CUDA 13.0's minimum: PyPI's torch 2.13.0 is a CUDA 13 build
        ("580.95.05", ["pypi", "cu126"]),  # SkyPilot's -cuda13 images on AWS and GCP
        ("590.44.01", ["pypi", "cu126"]),
        (None, ["pypi"]),  # no GPU, or no nvidia-smi: PyPI's default
        ("", ["pypi"]),
    ],
)
def test_each_driver_gets_torch_213_lines_that_exist_in_the_order_setup_tries_them(driver, lines):
    chosen = node_env.cuda_lines(driver, "2.13.0")
    assert [line.name for line in chosen] == lines
    published = {"pypi", *node_env.TORCH_LINES["2.13"][1]}
    assert {line.name for line in chosen} <= published and "cu128" not in published
    assert all(
        line.index_url == (None if line.name == "pypi" else f"https://download.pytorch.org/whl/{line.name}")
        for line in chosen
    )
    assert node_env.cuda_line(driver).name == lines[0]


def test_a_driver_below_every_cuda_line_is_refused_in_one_line():
    with pytest.raises(node_env.NodeEnvError) as error:
        node_env.cuda_line("470.256.02")
    message = str(error.value)
    assert "\n" not in message and "470.256.02" in message and ">= 525.60.13" in message


def test_torch_moves_to_the_lines_build_and_nothing_else_changes():
    requirements = ["deepspeed==0.19.8", "numpy>=1.26", "torch==2.13.0"]
    assert node_env.torch_version(requirements) == "2.13.0"
    assert node_env.requirements_for(requirements, node_env.cuda_line("570.172.08")) == [
        "deepspeed==0.19.8",
        "numpy>=1.26",
        "torch==2.13.0+cu126",
    ]
    assert node_env.requirements_for(requirements, node_env.cuda_line(None)) == requirements
    assert node_env.requirements_for(["torch>=2.4"], node_env.cuda_line("535.1")) == ["torch>=2.4"]  # no exact pin


def test_the_wheelhouse_key_names_interpreter_platform_line_and_requirements():
    pypi, cu126 = node_env.cuda_line(None), node_env.cuda_line("535.183.01")
    key = node_env.wheelhouse_key("cp310-x86_64-glibc2.35", pypi, ["numpy>=1.26", "torch==2.13.0"])
    assert key.startswith("cp310-x86_64-glibc2.35-pypi-")
    assert key == node_env.wheelhouse_key("cp310-x86_64-glibc2.35", pypi, ["torch==2.13.0", "numpy>=1.26"])
    others = {
        node_env.wheelhouse_key("cp312-x86_64-glibc2.39", pypi, ["numpy>=1.26", "torch==2.13.0"]),
        node_env.wheelhouse_key("cp310-x86_64-glibc2.35", cu126, ["numpy>=1.26", "torch==2.13.0"]),
        node_env.wheelhouse_key("cp310-x86_64-glibc2.35", pypi, ["numpy>=2", "torch==2.13.0"]),
    }
    assert key not in others and len(others) == 3


def test_a_recipes_dashboards_join_the_node_requirements_and_the_wheelhouse_key(tmp_path):
    import zipfile

    shipped = packaging.node_requirements()
    assert {r.split(";")[1].strip() for r in shipped if "extra ==" in r} == {
        f"extra == '{name}'" for name in ("tensorboard", "wandb", "mlflow")
    }  # pyproject's extras, as extras
    wheel = tmp_path / "skyspot-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(
            "skyspot-0.1.0.dist-info/METADATA",
            "Name: skyspot\nRequires-Dist: numpy>=1.26\n"
            "Requires-Dist: wandb<0.27,>=0.22; extra == 'wandb'\n"
            'Requires-Dist: mlflow-skinny<4,>=3; extra == "mlflow"\n'
            "Requires-Dist: pytest>=8; extra == 'test'\n",
        )
    assert node_env.wheel_requirements(wheel) == ["numpy>=1.26"]
    wanted = node_env.wheel_requirements(wheel, ["wandb", "mlflow"])
    assert wanted == ["numpy>=1.26", "wandb<0.27,>=0.22", "mlflow-skinny<4,>=3"]
    pypi = node_env.cuda_line(None)
    assert node_env.wheelhouse_key("cp310", pypi, wanted) != node_env.wheelhouse_key("cp310", pypi, ["numpy>=1.26"])


@pytest.mark.slow  # asks PyPI
def test_the_node_stack_resolves_on_the_images_pythons_from_the_wheel_it_ships(tmp_path):
    """Every requirement the wheel ships has a build for Python 3.10 and 3.12 on x86_64 Linux (PyPI)."""
    uv = pytest.importorskip("uv").find_uv_bin()
    wanted = tmp_path / "node.in"
    wanted.write_text("\n".join(packaging.node_requirements()) + "\n")
    for version in ("3.10", "3.12"):
        done = subprocess.run(
            [
                uv,
                "pip",
                "compile",
                "--quiet",
                "--no-config",
                "--python-version",
                version,
                "--python-platform",
                "x86_64-manylinux_2_28",
                str(wanted),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        pins = dict(line.split("==", 1) for line in done.stdout.splitlines() if "==" in line and not line[0].isspace())
        assert pins["torch"] == packaging.node_requirements(["torch"])[0].split("==")[1]
        assert "awscrt" in pins  # boto3[crt]: streaming uploads go through the CRT client on every node


# ------------------------------------------------------------------ setup, for real, on a small stack


def test_a_first_start_keeps_a_wheelhouse_and_a_second_installs_from_it_with_no_index(
    small_stack, new_node, first_start, tmp_path
):
    root, index, wheel = small_stack
    first, store = first_start.done, first_start.store_for(tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "installed from the index" in first.stdout and "kept the wheelhouse" in first.stdout
    (marker,) = (store / "r1" / "wheelhouse").glob("*/WHEELHOUSE.json")
    manifest = json.loads(marker.read_text())
    assert {"tinydep-1.0-py3-none-any.whl", "requirements.lock"} <= set(manifest["files"])
    assert manifest["key"] == marker.parent.name and manifest["cuda_line"] == "pypi"

    closed = f"http://127.0.0.1:{free_port()}/simple"  # nothing listens: an unreachable index
    venv = new_node(tmp_path, "n2")
    second = _setup(venv, wheel, store, closed, tmp_path / "h2", UV_OFFLINE="1")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "installed from the run's wheelhouse" in second.stdout and "kept" not in second.stdout
    assert _imports_tinydep(venv)
    again = _setup(venv, wheel, store, closed, tmp_path / "h2", UV_OFFLINE="1")
    assert "already installed here" in again.stdout  # a rerun of setup on the same machine


def _torch_wheel(folder: Path, version: str) -> Path:
    """A stand-in torch wheel (`torch.__version__` says its build), so no GB moves in a unit test."""
    folder.mkdir(parents=True, exist_ok=True)
    public = version.split("+")[0]
    entries = {
        "torch/__init__.py": f"__version__ = {version!r}\n".encode(),
        f"torch-{public}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n".encode(),
        f"torch-{public}.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    wheel = folder / f"torch-{version}-py3-none-any.whl"
    wheel.write_bytes(packaging._wheel_bytes(entries))
    return wheel


def test_a_line_that_does_not_resolve_falls_back_to_the_next_line_the_driver_runs(small_stack, new_node, tmp_path):
    """Driver 590: PyPI's CUDA 13 build first, then cu126. The stand-in PyPI has no torch 2.13.0; a
    PyTorch-style index on loopback (SKYSPOT_TORCH_INDEX) has the cu126 build: setup says the first line
    did not resolve, installs from the second, and keeps that line's wheelhouse."""
    import functools
    import http.server
    import threading

    root, index, _ = small_stack
    whl = tmp_path / "whl"
    torch_wheel = _torch_wheel(tmp_path / "built", "2.13.0+cu126")
    project = whl / "cu126" / "torch"
    project.mkdir(parents=True)
    (project / torch_wheel.name).write_bytes(torch_wheel.read_bytes())
    href = torch_wheel.name.replace("+", "%2B")
    (project / "index.html").write_text(f'<a href="{href}">{torch_wheel.name}</a>\n')
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(tmp_path))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tools = tmp_path / "tools"
    tools.mkdir()
    smi = tools / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 590.44.01\n")
    smi.chmod(0o755)
    wheel = packaging.build(tmp_path / "packages", declared=["tinydep>=1.0", "torch==2.13.0"]).wheel
    venv = new_node(tmp_path, "n1")
    try:
        done = _setup(
            venv,
            wheel,
            tmp_path / "store",
            index,
            tmp_path / "h1",
            PATH=f"{tools}{os.pathsep}{os.environ['PATH']}",
            SKYSPOT_TORCH_INDEX=f"http://127.0.0.1:{server.server_address[1]}/whl",
        )
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "NVIDIA driver 590.44.01" in done.stdout
    assert "torch 2.13.0 for pypi did not resolve from PyPI" in done.stdout
    assert "trying cu126, the next line driver 590.44.01 runs" in done.stdout
    assert "installed from the index" in done.stdout and "torch 2.13.0 (cu126)" in done.stdout
    version = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert version.stdout.strip() == "2.13.0+cu126"
    (marker,) = (tmp_path / "store" / "r1" / "wheelhouse").glob("*/WHEELHOUSE.json")
    assert "-cu126-" in marker.parent.name and json.loads(marker.read_text())["cuda_line"] == "cu126"


class _QuietHandler(__import__("http.server").server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.mark.slow  # 10-17 s of real installs: the ten-minute set keeps the tamper test (tests/test_wheelhouse.py)
def test_a_partial_or_corrupt_wheelhouse_is_ignored_while_the_index_is_up(small_stack, new_node, first_start, tmp_path):
    root, index, wheel = small_stack
    store = first_start.store_for(tmp_path)
    assert first_start.done.returncode == 0, first_start.done.stdout + first_start.done.stderr
    (marker,) = (store / "r1" / "wheelhouse").glob("*/WHEELHOUSE.json")
    kept = marker.parent / "tinydep-1.0-py3-none-any.whl"
    data = bytearray(kept.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    kept.write_bytes(bytes(data))

    venv = new_node(tmp_path, "n2")
    corrupt = _setup(venv, wheel, store, index, tmp_path / "h2")
    assert corrupt.returncode == 0, corrupt.stdout + corrupt.stderr
    assert "wheelhouse is refused: tinydep-1.0-py3-none-any.whl does not match its sha256" in corrupt.stdout
    assert "installed from the index" in corrupt.stdout and _imports_tinydep(venv)
    assert "kept the wheelhouse" in corrupt.stdout  # a whole one replaces it

    marker.unlink()  # a first start that died before its marker
    partial = _setup(new_node(tmp_path, "n3"), wheel, store, index, tmp_path / "h3")
    assert partial.returncode == 0, partial.stdout + partial.stderr
    assert "refused: no WHEELHOUSE.json" in partial.stdout and "installed from the index" in partial.stdout
    # ...and that start keeps a whole one again
    assert (marker.parent / "WHEELHOUSE.json").is_file()


@pytest.mark.slow  # 10-17 s of real installs: the ten-minute set keeps the tamper test (tests/test_wheelhouse.py)
def test_a_corrupt_wheelhouse_with_the_index_down_fails_setup_in_a_line_that_says_so(
    small_stack, new_node, first_start, tmp_path
):
    root, index, wheel = small_stack
    store = first_start.store_for(tmp_path)
    assert first_start.done.returncode == 0, first_start.done.stdout + first_start.done.stderr
    (marker,) = (store / "r1" / "wheelhouse").glob("*/WHEELHOUSE.json")
    marker.write_text("{not json")
    closed = f"http://127.0.0.1:{free_port()}/simple"
    failed = _setup(new_node(tmp_path, "n2"), wheel, store, closed, tmp_path / "h2", UV_OFFLINE="1")
    assert failed.returncode == 2
    assert "WHEELHOUSE.json unreadable" in failed.stdout
    assert "skyspot node env: resolving the node's requirements failed" in failed.stderr
    assert "Traceback" not in failed.stderr


def _resign(folder: Path, marker: dict) -> None:
    """A marker the run's key signed (what only a holder of the key can write)."""
    (folder / "WHEELHOUSE.json").write_text(json.dumps(wheelhouse.sign(marker, bytes.fromhex(RUN_KEY))))


@pytest.mark.parametrize(
    "damage, said",
    [
        (lambda d, m: (d / "WHEELHOUSE.json").unlink(), "no WHEELHOUSE.json"),
        (lambda d, m: (d / "a.whl").unlink(), "a.whl is missing"),
        (lambda d, m: (d / "a.whl").write_bytes(b"short"), "a.whl has 5 bytes"),
        (lambda d, m: _resign(d, {**m, "files": {**m["files"], "../x": m["files"]["a.whl"]}}), "names '../x'"),
        (lambda d, m: _resign(d, {**m, "files": {"requirements.lock": 7}}), "names"),
        (
            lambda d, m: (d / "WHEELHOUSE.json").write_text(
                json.dumps({**m, "files": {**m["files"], "b.whl": m["files"]["a.whl"]}})
            ),
            "does not match its signature",
        ),
        (lambda d, m: (d / "WHEELHOUSE.json").write_text("[]"), "unreadable"),
    ],
)
def test_a_wheelhouse_whose_marker_does_not_vouch_for_its_files_is_not_used(tmp_path, damage, said):
    folder = tmp_path / "wheelhouse" / "key"
    folder.mkdir(parents=True)
    (folder / "a.whl").write_bytes(b"wheel bytes")
    (folder / "requirements.lock").write_text("a==1\n")
    key = bytes.fromhex(RUN_KEY)
    marker = wheelhouse.sign(node_env.manifest_for(folder, "key", node_env.PYPI, ["a==1"]), key)
    (folder / "WHEELHOUSE.json").write_text(json.dumps(marker))
    assert wheelhouse.fetch(folder, tmp_path / "local", "key", key)[1] is None  # whole, it is used
    damage(folder, marker)
    found, problem = wheelhouse.fetch(folder, tmp_path / "again", "key", key)
    assert found is None and said in problem
    assert not (tmp_path / "again").exists()  # nothing copied from a wheelhouse that is not used
