"""The local backend: a directory on this machine's filesystem (a local disk, a shared
filesystem, or a SkyPilot bucket mount), written through the standard library only."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from skyspot.errors import StoreError
from skyspot.storage.store import DEFAULT_WORKERS, PreconditionFailed
from skyspot.storage.stream import STREAM_PART_BYTES, Pipe, StreamUpload
from skyspot.storage.transfer import TEMP_RE, get_each, put_each, replace_into
from skyspot.storage.uri import check_key

LOCK_NAME = ".skyspot-cas.lock"
"""The hidden file in the store's root that conditional writes lock (never listed, never a key)."""


class LocalStore:
    """A directory: a local disk, a shared filesystem, or a SkyPilot bucket mount.

    Writes go to a hidden temporary name, are fsynced, then renamed into place, so a
    reader never sees half a file. (On FUSE bucket mounts a rename is a copy; the
    object still appears whole, just not atomically with its temp name's removal.)

    Conditional writes (`put_if`) compare and swap under an exclusive `flock` on
    LOCK_NAME in the root, so they are atomic among the processes of one machine (flock
    is not coherent across machines on NFS or a bucket mount). The version token is
    `sha256(content):st_mtime_ns:st_ino`: the inode changes with every write (each is a
    new file renamed into place) and `put_if` sets the mtime strictly above the previous
    version's, so two writes of the same bytes still get different tokens. Only `put_if`
    takes the lock: a key written with `put_if` should not also be written with
    `put_bytes`, which would not wait for it.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.uri = str(self.root)

    def _path(self, key: str) -> Path:
        if key == LOCK_NAME:
            raise ValueError(f"invalid store key {key!r}: the local store's lock file")
        return self.root / check_key(key)

    def _os_error(self, error: OSError, key: str) -> StoreError:
        return StoreError(f"cannot use {self.root / key}: {error.strerror or error}")

    def put_file(self, local_path, key):
        try:
            replace_into(lambda temp: shutil.copyfile(local_path, temp), self._path(key))
        except FileNotFoundError:
            raise
        except OSError as error:
            raise self._os_error(error, key) from None

    def put_bytes(self, key, data):
        try:
            replace_into(lambda temp: temp.write_bytes(data), self._path(key))
        except OSError as error:
            raise self._os_error(error, key) from None

    def get_file(self, key, local_path):
        source = self._path(key)
        if not source.is_file():
            raise FileNotFoundError(errno.ENOENT, "not found in store", f"{self.uri}/{key}")
        try:
            replace_into(lambda temp: shutil.copyfile(source, temp), Path(local_path), durable=False)
        except FileNotFoundError:
            raise
        except OSError as error:
            raise self._os_error(error, key) from None

    def get_bytes(self, key, limit=None):
        try:
            if limit is not None:
                with open(self._path(key), "rb") as handle:
                    return handle.read(limit + 1)
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except OSError as error:
            raise self._os_error(error, key) from None

    def get_versioned(self, key):
        try:
            return _read_versioned(self._path(key))
        except OSError as error:
            raise self._os_error(error, key) from None

    def put_if(self, key, data, version):
        target = self._path(key)
        try:
            with self._cas_lock():
                current = _read(target)
                seen = None if current is None else _token(*current)
                if seen != version:
                    state = "exists" if version is None else "is gone" if seen is None else "changed"
                    raise PreconditionFailed(f"cannot write {self.uri}/{key}: it {state} since it was read")
                floor = 0 if current is None else current[1].st_mtime_ns + 1

                def write(temp: Path) -> None:
                    temp.write_bytes(data)
                    mtime = max(time.time_ns(), floor)  # strictly after the version it replaces
                    os.utime(temp, ns=(mtime, mtime))

                replace_into(write, target)
                return _token(data, os.stat(target))
        except OSError as error:
            raise self._os_error(error, key) from None

    @contextmanager
    def _cas_lock(self) -> Iterator[None]:
        """Held by one conditional write at a time, across threads and processes (a fresh open file
        description per call: flock excludes other descriptions, even in this process)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def exists(self, key):
        return self._path(key).is_file()

    def list(self, prefix=""):
        # Walk only the deepest directory the prefix names, then filter by string prefix like S3 does.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / base if base else self.root
        keys = []
        for dirpath, _dirs, names in os.walk(start):
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            for name in names:
                if TEMP_RE.match(name) or (rel_dir == "." and name == LOCK_NAME):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, keys):
        for key in keys:
            path = self._path(key)
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as error:
                raise self._os_error(error, key) from None
            # Prune directories left empty, so a deleted checkpoint leaves no step_N/ behind.
            parent = path.parent
            while parent != self.root and self.root in parent.parents:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent

    def upload_dir(self, local_dir, prefix, files, max_workers=DEFAULT_WORKERS):
        put_each(self, local_dir, prefix, files, max_workers)

    def download_files(self, prefix, files, local_dir, max_workers=DEFAULT_WORKERS):
        get_each(self, prefix, files, local_dir, max_workers)

    def open_stream(self, key, source=None):
        target = self._path(key)

        def send(pipe: Pipe) -> None:
            def write(temp: Path) -> None:
                with open(temp, "wb") as f:
                    shutil.copyfileobj(pipe, f, STREAM_PART_BYTES)

            try:
                replace_into(write, target)  # a hidden name until the end: a reader never sees half of it
            except OSError as error:
                raise self._os_error(error, key) from None

        return StreamUpload(self.uri, key, send, source)


def _token(data: bytes, stat: os.stat_result) -> str:
    return f"{hashlib.sha256(data).hexdigest()}:{stat.st_mtime_ns}:{stat.st_ino}"


def _read(path: Path) -> tuple[bytes, os.stat_result] | None:
    """Bytes and stat from one open file: writers rename new files into place and never write
    in place, so what this descriptor reads and stats is one version."""
    try:
        with open(path, "rb") as handle:
            stat = os.fstat(handle.fileno())
            return handle.read(), stat
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def _read_versioned(path: Path) -> tuple[bytes | None, str | None]:
    current = _read(path)
    return (None, None) if current is None else (current[0], _token(*current))
