"""A killed op build's lock is removed; a live builder's, or one just released, is never (trainer/ext_lock.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from skyspot.trainer import ext_lock


def _lock(root, name):
    path = root / "py311_cpu" / name / "lock"
    path.parent.mkdir(parents=True)
    fd = os.open(path, os.O_CREAT | os.O_EXCL)  # as torch's FileBaton.try_acquire makes it
    os.close(fd)
    return path


def test_only_a_lock_no_process_holds_and_older_than_an_instant_is_stale(tmp_path):
    dead = _lock(tmp_path, "deepspeed_shm_comm")
    fresh = _lock(tmp_path, "cpu_adam")
    held = _lock(tmp_path, "fused_adam")
    old = time.time() - 3600
    os.utime(dead, (old, old))
    os.utime(held, (old, old))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, time; fd = os.open({str(held)!r}, os.O_RDONLY); print('open', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        said = []
        removed = ext_lock.clear_stale(tmp_path, say=said.append)
        assert removed == [dead] and not dead.exists() and fresh.exists() and held.exists()
        assert said and "removed a stale op-build lock no process holds" in said[0]
    finally:
        holder.kill()
        holder.wait()
    assert ext_lock.clear_stale(tmp_path) == [held]  # its builder gone: now it is stale too


def test_the_extensions_root_is_torchs():
    assert str(ext_lock.extensions_root({"TORCH_EXTENSIONS_DIR": "/x/ext"})) == "/x/ext"
    assert str(ext_lock.extensions_root({"HOME": "/home/u"})) == "/home/u/.cache/torch_extensions"
    assert ext_lock.clear_stale(ext_lock.extensions_root({"TORCH_EXTENSIONS_DIR": "/nonexistent/ext"})) == []


def test_prepare_clears_a_stale_lock_before_it_builds(tmp_path, monkeypatch):
    """The hang of issue 31, item 5: a cancel during prepare's build left the lock; the next start waited forever."""
    from skyspot.trainer import prepare

    dead = _lock(tmp_path, "deepspeed_shm_comm")
    os.utime(dead, (time.time() - 3600,) * 2)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    seen = []
    monkeypatch.setattr(prepare, "build_ops", lambda recipe=None: seen.append(dead.exists()) or [])
    monkeypatch.setattr(prepare, "_say_node", lambda: None)
    assert prepare.main([]) == 0 and seen == [False]
