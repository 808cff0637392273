"""The wheel `launch` ships to every node: what is in it, what it pins, and that pip installs it."""

from __future__ import annotations

import hashlib
import base64
import subprocess
import sys
import zipfile
from pathlib import Path

from skyspot import package as packaging
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


def test_the_stack_is_pinned_to_this_machine_and_a_cpu_torch_maps_to_its_release():
    pins = packaging.node_requirements(["torch>=2.4", "deepspeed==0.19.8", "skypilot==0.14.1", "matplotlib>=3.8",
                                        "pytest>=8; extra == 'test'", "not-installed-anywhere>=1.0"])
    import torch

    assert f"torch=={torch.__version__.split('+')[0]}" in pins and "+" not in "".join(pins)
    assert "deepspeed==0.19.8" in pins
    assert not [p for p in pins if p.startswith(("skypilot", "matplotlib", "pytest"))]  # not the node's stack
    assert "not-installed-anywhere>=1.0" in pins  # kept as declared


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
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--target", str(target), str(built.wheel)], check=True)
    shown = subprocess.run([sys.executable, "-c", "import skyspot, importlib.metadata as m; "
                            "print(skyspot.__file__); print(m.version('skyspot'))"],
                           env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout.split()
    assert Path(shown[0]).is_relative_to(target) and shown[1] == built.version
    assert (target / "bin" / "skyspot").exists()  # the console script
