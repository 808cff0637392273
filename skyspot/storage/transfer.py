"""What every backend's bulk transfers share: a thread pool over files, and local writes that
appear whole or not at all (a hidden temporary sibling, fsync, rename)."""

from __future__ import annotations

import os
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from skyspot.storage.uri import join_key


def run_parallel(fn: Callable[[str], None], items: list[str], max_workers: int) -> None:
    """Run fn over items in a thread pool; the first error cancels what has not started and propagates."""
    if not items:
        return
    with ThreadPoolExecutor(
        max_workers=max(1, min(max_workers, len(items))), thread_name_prefix="skyspot-transfer"
    ) as pool:
        futures = [pool.submit(fn, item) for item in items]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def put_each(store, local_dir, prefix: str, files, max_workers: int) -> None:
    """`store.put_file(local_dir/F, prefix/F)` for each F, in parallel: `upload_dir` where the SDK has no bulk call."""
    run_parallel(lambda rel: store.put_file(Path(local_dir) / rel, join_key(prefix, rel)), list(files), max_workers)


def get_each(store, prefix: str, files, local_dir, max_workers: int) -> None:
    """`store.get_file(prefix/F, local_dir/F)` for each F, in parallel: `download_files` where the SDK has no bulk call."""
    run_parallel(lambda rel: store.get_file(join_key(prefix, rel), Path(local_dir) / rel), list(files), max_workers)


def temp_sibling(path: Path) -> Path:
    """A hidden name next to `path`: same filesystem, so os.replace is atomic."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.partial")


TEMP_RE = re.compile(r"^\..*\.[0-9a-f]{12}\.partial$")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (and FUSE bucket mounts) refuse fsync on a directory
    finally:
        os.close(fd)


def replace_into(write: Callable[[Path], None], target: Path, durable: bool = True) -> None:
    """Write via `write(temp)` then rename onto `target`, so a reader never sees half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_sibling(target)
    try:
        write(temp)
        if durable:
            with open(temp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(target.parent)
