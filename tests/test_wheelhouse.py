"""Only what the launching machine vouched for runs on a node: a bucket writer's wheel is never installed.

The attack of issue 31: someone who can write the run's bucket (but has not the run's key) plants a
wheel carrying a `.pth` file (Python runs it at every start), names it in the lock and reseals the
marker with every size and sha256 right. `node_env setup` runs for real in a new venv with real uv
(tests/node_stack.py's small stack: a PEP 503 index on disk standing for PyPI). It must refuse the
wheelhouse in one line, install nothing from it, and no Python start afterwards may run the payload.
"""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path

from skyspot import wheelhouse
from skyspot.ports import free_port
from skyspot.task import package as packaging
from tests.node_stack import RUN_KEY, _imports_tinydep, _setup


def _evil_wheel(folder: Path, canary: Path) -> Path:
    """evilpkg: a `.pth` that writes `canary` whenever any Python starts in the venv it is installed in."""
    payload = f"import pathlib; pathlib.Path({str(canary)!r}).write_text('ran')\n".encode()
    entries = {
        "evilpkg.pth": payload,
        "evilpkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: evilpkg\nVersion: 1.0\n",
        "evilpkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    wheel = folder / "evilpkg-1.0-py3-none-any.whl"
    wheel.write_bytes(packaging._wheel_bytes(entries))
    return wheel


def _plant(folder: Path, canary: Path) -> None:
    """What a bucket writer without the key can do best: add the wheel, its lock line, and reseal the marker."""
    _evil_wheel(folder, canary)
    lock = folder / wheelhouse.LOCK
    lock.write_text(lock.read_text() + wheelhouse.hashed_lock(folder).splitlines()[0] + "\n")
    marker = json.loads((folder / wheelhouse.MARKER).read_text())
    marker["files"] = wheelhouse.files_of(folder)
    (folder / wheelhouse.MARKER).write_text(json.dumps(marker))


def _python_starts(venv: Path) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-c", "pass"], env={"PATH": "/usr/bin:/bin"}, cwd="/", check=True)


def test_a_planted_wheel_in_a_resealed_wheelhouse_is_never_installed(small_stack, new_node, first_start, tmp_path):
    root, index, wheel = small_stack
    first, store = first_start.done, first_start.store_for(tmp_path)
    assert first.returncode == 0 and "kept the wheelhouse" in first.stdout, first.stdout + first.stderr
    (marker,) = (store / "r1" / "wheelhouse").glob("*/WHEELHOUSE.json")
    canary = tmp_path / "payload-ran"
    _plant(marker.parent, canary)
    assert "evilpkg" in (marker.parent / wheelhouse.LOCK).read_text()

    closed = f"http://127.0.0.1:{free_port()}/simple"  # offline: the node has nowhere else to turn
    venv = new_node(tmp_path, "n2")
    refused = _setup(venv, wheel, store, closed, tmp_path / "h2", UV_OFFLINE="1")
    said = [line for line in refused.stdout.splitlines() if "wheelhouse is refused" in line]
    assert said == [
        "skyspot node env: the run's wheelhouse is refused: WHEELHOUSE.json does not match its "
        "signature (not written by this run's nodes); nothing from it is installed, installing from "
        f"the index ({marker.parent.name})"
    ], refused.stdout
    assert refused.returncode == 2 and "Traceback" not in refused.stderr  # offline: fails in its own line
    assert "skyspot node env: resolving the node's requirements failed" in refused.stderr
    assert not list(venv.glob("lib/python*/site-packages/evilpkg*"))
    _python_starts(venv)
    assert not canary.exists()

    # The index up: the node installs from it, never from the planted files, and node 0 replaces them.
    venv = new_node(tmp_path, "n3")
    served = _setup(venv, wheel, store, index, tmp_path / "h3")
    assert served.returncode == 0, served.stdout + served.stderr
    assert "installed from the index" in served.stdout and _imports_tinydep(venv)
    assert not list(venv.glob("lib/python*/site-packages/evilpkg*"))
    _python_starts(venv)
    assert not canary.exists()
    assert "kept the wheelhouse" in served.stdout
    assert "evilpkg" not in (marker.parent / wheelhouse.LOCK).read_text()


def test_a_good_wheelhouse_still_installs_offline_with_every_hash_required(
    small_stack, new_node, first_start, tmp_path
):
    root, index, wheel = small_stack
    store = first_start.store_for(tmp_path)
    assert first_start.done.returncode == 0, first_start.done.stdout + first_start.done.stderr
    (marker,) = (store / "r1" / "wheelhouse").glob("*/WHEELHOUSE.json")
    sealed = json.loads(marker.read_text())
    assert sealed[wheelhouse.SIGNATURE] == wheelhouse.sign(sealed, bytes.fromhex(RUN_KEY))[wheelhouse.SIGNATURE]
    lock = (marker.parent / wheelhouse.LOCK).read_text()
    digest = wheelhouse.sha256_of(marker.parent / "tinydep-1.0-py3-none-any.whl")
    assert lock == f"tinydep==1.0 --hash=sha256:{digest}\n"  # the file's own hash, one line per wheel

    closed = f"http://127.0.0.1:{free_port()}/simple"
    venv = new_node(tmp_path, "n2")
    second = _setup(venv, wheel, store, closed, tmp_path / "h2", UV_OFFLINE="1")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "installed from the run's wheelhouse" in second.stdout and _imports_tinydep(venv)


def test_a_node_without_the_key_or_another_runs_key_refuses_the_wheelhouse(
    small_stack, new_node, first_start, tmp_path
):
    root, index, wheel = small_stack
    store = first_start.store_for(tmp_path)
    assert first_start.done.returncode == 0, first_start.done.stdout + first_start.done.stderr
    closed = f"http://127.0.0.1:{free_port()}/simple"
    keyless = _setup(
        new_node(tmp_path, "n2"), wheel, store, closed, tmp_path / "h2", UV_OFFLINE="1", SKYSPOT_WHEELHOUSE_KEY=""
    )
    assert keyless.returncode == 2
    assert "refused: this node has no wheelhouse key (SKYSPOT_WHEELHOUSE_KEY)" in keyless.stdout
    other = _setup(
        new_node(tmp_path, "n3"),
        wheel,
        store,
        closed,
        tmp_path / "h3",
        UV_OFFLINE="1",
        SKYSPOT_WHEELHOUSE_KEY="cd" * 32,
    )
    assert other.returncode == 2 and "does not match its signature" in other.stdout


def test_an_unsigned_marker_of_an_older_skyspot_is_refused(tmp_path):
    folder = tmp_path / "key"
    folder.mkdir()
    (folder / "requirements.lock").write_text("a==1\n")
    (folder / "WHEELHOUSE.json").write_text(json.dumps({"key": "key", "files": wheelhouse.files_of(folder)}))
    found, problem = wheelhouse.fetch(folder, tmp_path / "local", "key", bytes.fromhex(RUN_KEY))
    assert found is None and problem == "WHEELHOUSE.json is not signed with the run's key"
    assert not (tmp_path / "local").exists()


def test_a_signed_wheelhouse_moved_under_another_name_is_refused(tmp_path):
    key = bytes.fromhex(RUN_KEY)
    folder = tmp_path / "cp312-key"
    folder.mkdir()
    (folder / "requirements.lock").write_text("a==1\n")
    (folder / "WHEELHOUSE.json").write_text(
        json.dumps(wheelhouse.sign({"key": "cp310-key", "files": wheelhouse.files_of(folder)}, key))
    )
    found, problem = wheelhouse.fetch(folder, tmp_path / "local", "cp312-key", key)
    assert found is None and "is the wheelhouse 'cp310-key', found under 'cp312-key'" in problem


def test_the_run_key_is_private_to_the_launching_user_and_kept_for_resume(tmp_path):
    made = wheelhouse.new_key(tmp_path, "r1")
    path = wheelhouse.key_path(tmp_path, "r1")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(bytes.fromhex(made)) == wheelhouse.KEY_BYTES
    assert wheelhouse.run_key(tmp_path, "r1") == made  # resume reuses it
    assert wheelhouse.new_key(tmp_path, "r1") != made  # a new launch of that name gets its own
    assert wheelhouse.node_key({wheelhouse.KEY_ENV: made}) == bytes.fromhex(made)
    assert wheelhouse.node_key({wheelhouse.KEY_ENV: "short"}) is None and wheelhouse.node_key({}) is None
