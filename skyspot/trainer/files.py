"""Durable small-file writes: what a crash may leave behind is either the old file or the new one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory entry (a created, renamed or removed name) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str | os.PathLike, data: bytes) -> None:
    """Write a whole file and fsync it (not its directory entry: see fsync_dir)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace `path` atomically: write a sibling temp file, fsync, rename, fsync the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write_durably(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def read_json(path: str | os.PathLike) -> Optional[Any]:
    """The parsed file, or None when it is missing or not JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
