"""The wheel `launch` ships to every node: what is in it, what it pins, and that pip installs it."""

from __future__ import annotations

import hashlib
import base64
import subprocess
import sys
import zipfile
from pathlib import Path

from skyspot.task import package as packaging
from tests.conftest import REPO


def test_the_wheel_holds_the_running_package_and_a_valid_record(tmp_path):
    built = packaging.build(tmp_path)
    with zipfile.ZipFile(built.wheel) as wheel:
        names = wheel.namelist()
        assert "skyspot/trainer/loop.py" in names and "skyspot/recipes/llama70b.yaml" in names
        assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
        record = wheel.read(f"skyspot-{built.version}.dist-info/RECORD").decode().splitlines()
        for line in record:
            name, digest, size = line.rsplit(",", 2)
            if not digest:
                continue
            data = wheel.read(name)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert (digest, int(size)) == (f"sha256={expected}", len(data)), name
        assert sorted(line.rsplit(",", 2)[0] for line in record) == sorted(names)


def test_the_training_stack_is_pinned_to_this_machine_and_the_rest_keeps_its_range():
    pins = packaging.node_requirements(
        [
            "torch>=2.4",
            "deepspeed>=0.19",
            "transformers>=4.57,<5",
            "numpy>=1.26",
            "typer>=0.15,<0.30",
            "boto3[crt]>=1.34",
            "skypilot==0.14.1",
            "matplotlib>=3.8",
            "uv>=0.5",
            "pytest>=8; extra == 'test'",
        ]
    )
    import deepspeed
    import torch
    import transformers

    assert f"torch=={torch.__version__.split('+')[0]}" in pins and "+" not in "".join(pins)  # a CPU build's release
    assert f"deepspeed=={deepspeed.__version__}" in pins and f"transformers=={transformers.__version__}" in pins
    # The node resolves these for its own Python: numpy 2.4.6 and typer 0.29.2 have no 3.10 build.
    assert {"numpy>=1.26", "typer>=0.15,<0.30", "boto3[crt]>=1.34"} <= set(pins)
    assert not [p for p in pins if p.startswith(("skypilot", "matplotlib", "pytest", "uv"))]  # not the node's stack


def test_the_same_content_reuses_the_wheel_and_a_change_makes_a_new_one(tmp_path):
    source = tmp_path / "skyspot"
    subprocess.run(["cp", "-r", str(REPO / "skyspot"), str(source)], check=True)
    first = packaging.build(tmp_path / "cache", source=source, declared=[])
    assert packaging.build(tmp_path / "cache", source=source, declared=[]).wheel == first.wheel
    (source / "trainer" / "loop.py").write_text((source / "trainer" / "loop.py").read_text() + "\n# changed\n")
    second = packaging.build(tmp_path / "cache", source=source, declared=[])
    assert second.wheel != first.wheel and second.version != first.version
    assert first.wheel.read_bytes() != second.wheel.read_bytes()


def test_pip_installs_the_wheel_and_it_imports_as_the_version_built(tmp_path):
    built = packaging.build(tmp_path / "cache")
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--target",
            str(target),
            str(built.wheel),
        ],
        check=True,
    )
    shown = subprocess.run(
        [
            sys.executable,
            "-c",
            "import skyspot, importlib.metadata as m; print(skyspot.__file__); print(m.version('skyspot'))",
        ],
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert Path(shown[0]).is_relative_to(target) and shown[1] == built.version
    assert (target / "bin" / "skyspot").exists()  # the console script


def test_the_wheel_ships_the_allow_list_and_never_a_dotfile_a_swap_file_or_a_link(tmp_path):
    source = tmp_path / "skyspot"
    subprocess.run(["cp", "-r", str(REPO / "skyspot"), str(source)], check=True)
    planted = {
        ".env": "HF_TOKEN=hf_canary_value\n",
        "trainer/.loop.py.swp": "b0VIM 9.0",
        "trainer/loop.py.orig": "x",
        "trainer/loop.py~": "x",
        "recipes/.tiny.yaml.swp": "x",
        "recipes/tiny.yaml.orig": "x",
        ".ipynb_checkpoints/loop-checkpoint.py": "x = 1",
        "notes.txt": "x",
        "pricing/pricing_data/.secret.csv": "x",
        "cli/.hidden/mod.py": "x = 1",
    }
    for name, text in planted.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text(text)
    (source / "leak.py").symlink_to("/etc/hostname")
    built = packaging.build(tmp_path / "cache", source=source, declared=[])
    with zipfile.ZipFile(built.wheel) as wheel:
        names = set(wheel.namelist())
        payload = b"".join(wheel.read(n) for n in names)
    shipped = {n[len("skyspot/") :] for n in names if n.startswith("skyspot/")}
    assert not set(planted) & shipped and "leak.py" not in shipped
    assert b"hf_canary_value" not in payload
    assert not [n for n in shipped if any(part.startswith(".") for part in n.split("/"))]
    expected = {
        p.relative_to(REPO / "skyspot").as_posix()
        for p in (REPO / "skyspot").rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and (p.suffix == ".py" or p.parent.name in ("recipes", "pricing_data"))
    }
    assert (
        expected <= shipped and "recipes/llama70b.yaml" in shipped and "pricing/pricing_data/gpu_prices.csv" in shipped
    )


class _Dist:
    def __init__(self, version, requires_python):
        self.version, self.metadata = version, ({"Requires-Python": requires_python} if requires_python else {})


def test_the_node_wheel_asks_for_the_oldest_python_its_pinned_stack_supports(monkeypatch, tmp_path):
    """accelerate 1.16.0 needs Python >= 3.11: a wheel pinned from a machine that has it says so, and node_env
    then makes skyspot's venv on a 3.11 or newer, never on a 3.10 image's own interpreter."""
    from importlib import metadata

    from skyspot import node_env

    installed = {
        "accelerate": _Dist("1.16.0", ">=3.11.0"),
        "torch": _Dist("2.13.0+cu130", ">=3.10"),
        "deepspeed": _Dist("0.19.8", None),
    }

    def distribution(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(packaging.metadata, "distribution", distribution)
    assert packaging.python_floor(["torch==2.13.0", "deepspeed==0.19.8", "numpy>=1.26"]) == "3.10"
    assert packaging.python_floor(["torch==2.13.0", "accelerate==1.16.0"]) == "3.11"
    assert packaging.python_floor(["accelerate==1.15.0"]) == "3.10"  # pinned to another version than installed
    installed["accelerate"] = _Dist("1.16.0", ">=3.13,<3.14")
    assert packaging.python_floor(["accelerate==1.16.0"]) == "3.13"

    built = packaging.build(tmp_path, declared=["accelerate>=0.26"])  # this machine's accelerate: pinned, its floor
    assert node_env.python_floor(built.wheel) == tuple(
        int(p) for p in packaging.python_floor(built.requirements).split(".")
    )
    installed["accelerate"] = _Dist("1.16.0", ">=3.11.0")
    monkeypatch.setattr(packaging.metadata, "version", lambda name: installed[name].version)
    strict = packaging.build(tmp_path / "strict", declared=["accelerate>=0.26"])
    assert "accelerate==1.16.0" in strict.requirements and node_env.python_floor(strict.wheel) == (3, 11)
