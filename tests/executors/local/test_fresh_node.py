"""The task a cloud launch hands SkyPilot, run on fresh Python 3.10 nodes: its `setup` installs skyspot, its `run` trains.

SkyPilot's control plane cannot be reached from here, so it is faked at the SDK seam
(`FakeSkyJobs`, tests/executors/sky/test_sky_seam.py) only to capture the sky.Task that
`skyspot launch` submits. What SkyPilot does with it on a new VM is done for real: the node's
`python3` is pyenv's 3.10 (Ubuntu 22.04's, which SkyPilot's default GPU images boot), its Python
the venv SkyPilot makes from it (`uv venv --seed --relocatable --system-site-packages`), the
task's local file mounts are copied onto it, and its `setup` runs there: node_env picks PyPI's
torch (no driver here), resolves the stack for 3.10 with uv, downloads and builds every wheel
from the index, installs them and keeps them as the run's wheelhouse in the bucket, on moto's S3
server; DeepSpeed's op is prepared. Then its `run` trains with the environment variables SkyPilot
sets on node 0 of 1, into the bucket. `status` and `cost-report` show that run, finished, under
the launched name.

A second start of the same run, on a second fresh node, is a recovery: SkyPilot's bucket mount is
emulated by materialising the run's wheelhouse prefix through skyspot's Store (executors/
executors/local/fresh_node.py), and setup runs with no network at all (`unshare --net`, and the indexes pointed
at a closed loopback port with UV_OFFLINE for good measure): it installs from the wheelhouse.

The first start downloads about 3 GB from PyPI (torch's CUDA build and its NVIDIA libraries); the
module shares it across its tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.executors.local import fresh_node
from skyspot.ports import free_port
from skyspot.storage import open_store
from tests.executors.sky.test_sky_seam import FakeSkyJobs, launched

pytestmark = pytest.mark.slow
runner = CliRunner()

# Ubuntu 22.04's python3, as pyenv builds it here; SKYSPOT_TEST_NODE_PYTHON names another.
NODE_PYTHON = os.environ.get("SKYSPOT_TEST_NODE_PYTHON", "/root/.pyenv/versions/3.10.13/bin/python3.10")
SETUP_TIMEOUT = 1500  # a cold first start here: ~3 GB from PyPI, DeepSpeed built, installed, kept in moto


def skypilot_node_env(name: str) -> dict[str, str]:
    """What SkyPilot sets for the `setup` and `run` of node 0 of a 1-node managed job (docs: 'Environment variables')."""
    return {
        "SKYPILOT_NODE_RANK": "0",
        "SKYPILOT_SETUP_NODE_RANK": "0",
        "SKYPILOT_NODE_IPS": "127.0.0.1",
        "SKYPILOT_NUM_NODES": "1",
        "SKYPILOT_NUM_GPUS_PER_NODE": "0",
        "SKYPILOT_TASK_ID": f"sky-managed-2026-11-30-12-00-00-000000_{name}_1-0",
        "SKYPILOT_CLUSTER_INFO": json.dumps(
            {
                "cluster_name": f"{name}-1",
                "cloud": "AWS",
                "region": "us-east-2",
                "zone": "us-east-2a",
                "num_nodes": 1,
                "instance_type": "m6i.large",
                "use_spot": True,
            }
        ),
        "SKYSPOT_MASTER_PORT": str(free_port()),
    }


def _can_cut_the_network() -> bool:
    return (
        shutil.which("unshare") is not None
        and subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0
    )


class Run:
    """One launched run and the nodes it started on."""

    def __init__(self, root: Path, task, name: str, store: str, home: Path, fake: FakeSkyJobs):
        self.root, self.task, self.name, self.store, self.home, self.fake = root, task, name, store, home, fake
        self.setup_seconds: dict[str, float] = {}
        self.made: list[Path] = []

    def node(self, label: str):
        # sky.Task keeps bucket mounts apart from file mounts; the fresh node takes them as the task's YAML has them.
        mounts = {
            **self.task.file_mounts,
            **{
                target: {"source": storage.source, "mode": storage.mode.value}
                for target, storage in self.task.storage_mounts.items()
            },
        }
        node = fresh_node.make(
            self.root / label, mounts, python=NODE_PYTHON, bucket_prefixes=[f"{self.store}/{self.name}/wheelhouse/"]
        )
        self.made.append(node.root)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SKYSPOT_", "SKYPILOT_"))}
        env = {
            **node.env({**base, "HOME": str(self.root / label / "home")}, self.task.envs),
            **skypilot_node_env(self.name),
            # SkyPilot puts the task's secrets in the node's environment: the run's wheelhouse key among them.
            **{k: v.get_secret_value() for k, v in self.task.secrets.items()},
        }
        return node, env

    def setup(self, label: str, node, env, *, network: bool = True) -> str:
        log = self.root / f"{label}.setup.log"
        started = time.monotonic()
        with open(log, "w") as handle:
            if network:
                code = fresh_node.run_setup(node, self.task.setup, env, handle, timeout=SETUP_TIMEOUT)
            else:
                code = subprocess.run(
                    ["unshare", "--net", "bash", "-c", self.task.setup],
                    cwd=node.root,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=handle,
                    stderr=subprocess.STDOUT,
                    timeout=SETUP_TIMEOUT,
                ).returncode
        self.setup_seconds[label] = time.monotonic() - started
        # uv's cache on the node (its downloads, ~3 GB on a first start) is not needed once setup is done:
        # a cloud VM's disk goes with it, this machine's stays, and CI once ran out of it here.
        shutil.rmtree(Path(env["HOME"]) / ".cache", ignore_errors=True)
        text = log.read_text()
        assert code == 0, text[-4000:]
        print(
            f"\n{label}: setup took {self.setup_seconds[label]:.0f} s\n"
            + "\n".join(line for line in text.splitlines() if line.startswith("skyspot "))
        )
        return text

    def train(self, node, env) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", self.task.run], env=env, cwd=node.root, capture_output=True, text=True, timeout=900
        )


@pytest.fixture(scope="module")
def run(tmp_path_factory, s3_server):
    if not os.access(NODE_PYTHON, os.X_OK):
        pytest.skip(f"no Python 3.10 to stand for the images' python3 at {NODE_PYTHON} (SKYSPOT_TEST_NODE_PYTHON)")
    root = tmp_path_factory.mktemp("fresh-node")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SKYSPOT_HOME", str(root / "skyspot-home"))
        fake = FakeSkyJobs(mp)
        store = s3_server.bucket() + "/runs"
        result = runner.invoke(
            app,
            [
                "launch",
                "tiny",
                "--cloud",
                "-y",
                "-d",
                "-n",
                "fresh-run",
                "--store",
                store,
                "train.steps=8",
                "checkpoint.every_steps=4",
                "train.log_every=4",
            ],
        )
        assert result.exit_code == 0, result.output
        ((task, name),) = launched(fake)
        assert name == "fresh-run"
        started = Run(root, task, name, store, root / "skyspot-home", fake)
        node, env = started.node("node-1")
        started.first_log = started.setup("node-1", node, env)
        started.first = (node, env)
        started.first_run = started.train(node, env)
        try:
            yield started
        finally:  # the first node (~5 GB) and the run's wheelhouse (~3 GB); pytest keeps its last 3 temp roots
            for node_root in root.glob("node-*/"):
                shutil.rmtree(node_root, ignore_errors=True)
            bucket = open_store(store)
            for prefix in (f"{name}/wheelhouse/", f"{name}-conda/", f"{name}-py38/"):
                bucket.delete(bucket.list(prefix))


@pytest.fixture(autouse=True)
def _each_tests_nodes_removed_after_it(run):
    """Each node holds ~5 GB (skyspot's venv, the mount's copy of the wheelhouse): a test's own nodes go
    when it ends, the first start's (which later tests compare against) with the module."""
    kept = len(run.made)
    yield
    for node_root in run.made[kept:]:
        shutil.rmtree(node_root, ignore_errors=True)
    del run.made[kept:]


def _imports(python: Path, module: str) -> bool:
    return (
        subprocess.run(
            [str(python), "-c", f"import {module}"], capture_output=True, env={"PATH": "/usr/bin:/bin"}, cwd="/"
        ).returncode
        == 0
    )


def _a_system_library() -> str:
    """A real shared library that is not NCCL (zlib): loaded as libnccl.so.2 it lacks every nccl* symbol."""
    for candidate in ("/lib/x86_64-linux-gnu/libz.so.1", "/usr/lib/x86_64-linux-gnu/libz.so.1", "/lib64/libz.so.1"):
        if os.path.exists(candidate):
            return candidate
    pytest.skip("no libz.so.1 to make a decoy libnccl.so.2 from")


def _events(run) -> list[dict]:
    from skyspot.events import read_events_store

    return read_events_store(open_store(run.store), run.name).events


def test_a_cloud_launch_sets_up_on_a_python_310_node_trains_into_the_bucket_and_is_reported(run, monkeypatch):
    monkeypatch.setenv("SKYSPOT_HOME", str(run.home))  # the module's launch, not this test's empty home
    node, env = run.first
    where = subprocess.run(
        [
            str(node.skyspot_venv / "bin" / "python"),
            "-c",
            "import sys, skyspot, numpy, torch, importlib.metadata as m; "
            "print(sys.version_info[:2] == (3, 10), skyspot.__file__, m.version('skyspot'), "
            "numpy.__version__, torch.__version__)",
        ],
        env=env,
        cwd=node.root,
        capture_output=True,
        text=True,
    )
    is_310, path, version, numpy_version, torch_version = where.stdout.split()
    assert is_310 == "True", where.stdout + where.stderr
    # skyspot's own venv, on the image's 3.10, not SkyPilot's (which setup leaves as it found it)
    assert path.startswith(str(node.skyspot_venv)) and version.startswith("0.1.0+")  # the wheel, not this checkout
    assert not _imports(node.venv / "bin" / "python", "skyspot")
    assert "made skyspot's venv" in run.first_log and "on the image's Python 3.10" in run.first_log
    assert numpy_version.startswith("2.2.")  # the newest numpy built for 3.10, not this machine's 2.4
    assert torch_version == "2.13.0+cu130"  # PyPI's build (CUDA 13): this node has no NVIDIA driver
    assert "installed from the index" in run.first_log and "kept the wheelhouse" in run.first_log

    done = run.first_run
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    markers = [k for k in open_store(run.store).list(f"{run.name}/wheelhouse/") if k.endswith("/WHEELHOUSE.json")]
    assert len(markers) == 1 and "/cp310-" in markers[0]

    run.fake.records[:] = [
        {"job_id": 42, "status": "SUCCEEDED", "recovery_count": 0, "cloud": "AWS", "region": "us-east-2"}
    ]
    status = runner.invoke(app, ["status", "--json", "-a"])
    (row,) = json.loads(status.stdout)
    assert (row["name"], row["status"], row["step"], row["total_steps"]) == ("fresh-run", "SUCCEEDED", 8, 8)
    assert row["last_checkpoint"] == 8 and row["last_checkpoint_durable"] is True
    report = runner.invoke(app, ["cost-report", "fresh-run", "--json"])
    assert report.exit_code == 0, report.output
    (entry,) = json.loads(report.stdout)
    assert entry["name"] == "fresh-run" and entry["status"] == "SUCCEEDED"
    # What it ran on, from the node event: skyspot's venv on 3.10, PyPI's torch, torch's own NCCL.
    (kind,) = row["node_kinds"]
    assert entry["node_kinds"] == row["node_kinds"]
    facts = kind["facts"]
    assert facts["python"]["venv"] == "skyspot" and facts["python"]["version"].startswith("3.10.")
    assert facts["python"]["origin"] == "image" and facts["setup"]["source"] == "index"
    assert facts["torch"]["version"] == "2.13.0+cu130" and facts["torch"]["line"] == "cu130"  # PyPI's: CUDA 13
    assert facts["nccl"]["library"].startswith(str(node.skyspot_venv)), facts["nccl"]
    assert "/site-packages/nvidia/nccl" in facts["nccl"]["library"] and facts["nccl"]["version"]
    assert facts["driver"] is None and facts["gpus"]["count"] == 0
    text = runner.invoke(app, ["cost-report", "fresh-run"], terminal_width=400)
    assert f"nodes: {kind['kind']}" in text.stdout, text.stdout  # one line per kind of node


def test_a_second_start_installs_from_the_runs_wheelhouse_with_the_index_unreachable(run):
    node, env = run.node("node-2")
    closed = f"http://127.0.0.1:{free_port()}/simple"  # nothing listens there
    env.update({"UV_INDEX_URL": closed, "PIP_INDEX_URL": closed, "UV_OFFLINE": "1"})
    assert Path(node.path_on_node(env["SKYSPOT_STORE_MOUNT"]), run.name, "wheelhouse").is_dir()  # the emulated mount
    log = run.setup("node-2", node, env, network=not _can_cut_the_network())
    assert "installed from the run's wheelhouse" in log and "refused" not in log and "kept" not in log
    versions = subprocess.run(
        [
            str(node.skyspot_venv / "bin" / "python"),
            "-c",
            "import torch, deepspeed, numpy, skyspot.trainer.loop; "
            "print(torch.__version__, deepspeed.__version__, numpy.__version__)",
        ],
        env=env,
        cwd=node.root,
        capture_output=True,
        text=True,
    )
    first = subprocess.run(
        [
            str(run.first[0].skyspot_venv / "bin" / "python"),
            "-c",
            "import torch, deepspeed, numpy; print(torch.__version__, deepspeed.__version__, numpy.__version__)",
        ],
        env=run.first[1],
        cwd=run.first[0].root,
        capture_output=True,
        text=True,
    )
    assert versions.returncode == 0, versions.stderr[-2000:]
    # the recovery trains with exactly the first start's stack (the last line: DeepSpeed logs above it)
    assert versions.stdout.splitlines()[-1] == first.stdout.splitlines()[-1]
    # The image's LD_LIBRARY_PATH names a folder with another libnccl.so.2 (as the DLAMI's and the TCPX
    # container's do): a decoy that is a valid library but not NCCL, which breaks torch if it is loaded.
    decoy = run.root / "decoy-lib"
    decoy.mkdir(exist_ok=True)
    shutil.copy(_a_system_library(), decoy / "libnccl.so.2")
    env["LD_LIBRARY_PATH"] = f"{decoy}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    done = run.train(node, env)  # the recovery's run: the finished run's newest checkpoint is step 8
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    node_event = [e for e in _events(run) if e["type"] == "node"][-1]
    assert node_event["nccl"]["library"].startswith(str(node.skyspot_venv)), node_event["nccl"]
    assert str(decoy) not in json.dumps(node_event) and node_event["setup"]["source"] == "wheelhouse"
    print(
        f"\nsetup seconds: first start {run.setup_seconds['node-1']:.0f}, "
        f"recovery from the wheelhouse {run.setup_seconds['node-2']:.0f}"
    )


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` with its size and mtime: a listing two snapshots of an untouched tree share."""
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")}


def _train_as(run, node, env, name: str) -> list[dict]:
    """The task's `run` on this node as a run of its own (SKYSPOT_RUN_NAME), trained into the bucket; its events."""
    from skyspot.events import read_events_store

    done = run.train(node, {**env, "SKYSPOT_RUN_NAME": name})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return read_events_store(open_store(run.store), name).events


def _delete_run(run, name: str) -> None:
    """A test's own run (its events and checkpoints, in moto's spool under /tmp), once read."""
    bucket = open_store(run.store)
    bucket.delete(bucket.list(f"{name}/"))


def test_a_conda_like_base_is_left_as_it_was_and_skyspot_trains_from_its_own_venv(run):
    """SkyPilot's own images auto-activate Miniconda's base and then make no venv of their own
    (sky/skylet/constants.py: ~/sky-user-env only when no conda env is active): `python3` is conda's.
    Here a 3.10 environment marked as conda's base (conda-meta/) stands for it; setup must install
    nothing into it, and the recovery installs from the run's wheelhouse with no index."""
    node, env = run.node("node-3")
    base = node.root / "miniconda3"
    subprocess.run([NODE_PYTHON, "-m", "venv", "--without-pip", str(base)], check=True)
    (base / "conda-meta").mkdir()
    (base / "conda-meta" / "history").write_text("==> 2025-08-01 00:00:00 <==\n# cmd: conda create\n")
    before = _tree(base)
    env = {k: v for k, v in env.items() if k != "VIRTUAL_ENV"}
    env.update(
        {
            "CONDA_PREFIX": str(base),
            "CONDA_DEFAULT_ENV": "base",
            "CONDA_SHLVL": "1",
            "PATH": os.pathsep.join([str(base / "bin"), str(node.bin), env["PATH"].split(os.pathsep, 1)[1]]),
        }
    )
    closed = f"http://127.0.0.1:{free_port()}/simple"
    env.update({"UV_INDEX_URL": closed, "PIP_INDEX_URL": closed, "UV_OFFLINE": "1"})
    log = run.setup("node-3", node, env, network=not _can_cut_the_network())
    assert "installed from the run's wheelhouse" in log
    assert _tree(base) == before and not _imports(base / "bin" / "python", "skyspot")  # conda's base untouched
    events = _train_as(run, node, env, "fresh-run-conda")
    _delete_run(run, "fresh-run-conda")
    assert max(e["step"] for e in events if e["type"] == "step") == 8
    (node_event,) = [e for e in events if e["type"] == "node"]
    assert node_event["python"]["venv"] == "skyspot" and node_event["python"]["prefix"] == str(node.skyspot_venv)
    assert node_event["python"]["version"].startswith("3.10.")


class _Quiet(__import__("http.server").server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _managed_python_mirror(root: Path):
    """uv's managed Python served from loopback the way uv fetches python-build-standalone: a release
    tarball (`python/` inside: here pyenv's 3.12, standing for it) and the download list naming it with
    its sha256 (UV_PYTHON_DOWNLOADS_JSON_URL; uv checks the hash)."""
    import functools
    import hashlib
    import http.server
    import tarfile
    import threading

    source = Path(os.environ.get("SKYSPOT_TEST_MANAGED_PYTHON", "/root/.pyenv/versions/3.12.1"))
    if not (source / "bin" / "python3.12").exists():
        pytest.skip(f"no Python 3.12 at {source} to serve as uv's managed Python (SKYSPOT_TEST_MANAGED_PYTHON)")
    root.mkdir(parents=True, exist_ok=True)
    archive = root / "cpython-3.12.1+test-x86_64-unknown-linux-gnu-install_only.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        tar.add(
            source,
            arcname="python",
            filter=lambda info: (
                None if "/site-packages/" in info.name or info.name.endswith("/test") or "/test/" in info.name else info
            ),
        )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    (root / "downloads.json").write_text(
        json.dumps(
            {
                "cpython-3.12.1-linux-x86_64-gnu": {
                    "name": "cpython",
                    "arch": {"family": "x86_64", "variant": None},
                    "os": "linux",
                    "libc": "gnu",
                    "major": 3,
                    "minor": 12,
                    "patch": 1,
                    "prerelease": "",
                    "url": f"{url}/{archive.name}",
                    "sha256": digest,
                    "variant": None,
                    "build": "test",
                }
            }
        )
    )
    return server, f"{url}/downloads.json"


def test_an_image_whose_python_is_38_gets_uvs_managed_python_and_trains(run):
    """GCP's TCPX container stands here: SkyPilot makes no user environment in a custom Docker image
    (sky/backends/backend_utils.py) and the image brings an old Python: `python` and `python3` are pyenv's
    3.8, and no Python >= 3.10 is on PATH. setup gets uv's managed 3.12 (from a loopback mirror),
    makes skyspot's venv on it, installs from the index (a 3.12 wheelhouse: none yet) and the run trains."""
    node, env = run.node("node-4")
    image_bin = node.root / "image-bin"  # the image's /usr/bin, without any Python but 3.8
    image_bin.mkdir()
    for folder in ("/usr/local/bin", "/usr/bin"):
        for tool in Path(folder).iterdir():
            if (
                not tool.name.startswith(("python", "pydoc", "pip", "2to3", "idle"))
                and not (image_bin / tool.name).exists()
            ):
                (image_bin / tool.name).symlink_to(tool)
    old = "/root/.pyenv/versions/3.8.18/bin/python3.8"
    if not os.access(old, os.X_OK):
        pytest.skip(f"no Python 3.8 at {old} to stand for the container's python")
    for name in ("python", "python3"):
        (image_bin / name).symlink_to(old)
    server, downloads = _managed_python_mirror(run.root / "python-mirror")
    try:
        env = {k: v for k, v in env.items() if k != "VIRTUAL_ENV"}
        env.update(
            {"PATH": os.pathsep.join([str(node.bin), str(image_bin)]), "UV_PYTHON_DOWNLOADS_JSON_URL": downloads}
        )
        log = run.setup("node-4", node, env)
    finally:
        server.shutdown()
    assert "no Python >=3.10 on this image: installing uv's managed Python 3.12" in log
    assert "on uv's managed Python 3.12.1" in log and "installed from the index" in log
    assert not (Path(env["HOME"]) / ".local" / "bin" / "python3.12").exists()  # --no-bin: nothing on the image's PATH
    events = _train_as(run, node, env, "fresh-run-py38")
    _delete_run(run, "fresh-run-py38")
    bucket = open_store(run.store)  # the 3.12 wheelhouse this start kept beside the run's 3.10 one
    bucket.delete([k for k in bucket.list(f"{run.name}/wheelhouse/") if "/cp312-" in k])
    assert max(e["step"] for e in events if e["type"] == "step") == 8
    (node_event,) = [e for e in events if e["type"] == "node"]
    assert node_event["python"]["version"] == "3.12.1" and node_event["python"]["origin"] == "uv-managed"
    assert node_event["python"]["venv"] == "skyspot" and node_event["setup"]["source"] == "index"
