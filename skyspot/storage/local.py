"""The local backend: a directory on this machine's filesystem (a local disk, a shared
filesystem, or a SkyPilot bucket mount), written through the standard library only."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from skyspot.errors import StoreError
from skyspot.storage.store import DEFAULT_WORKERS
from skyspot.storage.stream import STREAM_PART_BYTES, Pipe, StreamUpload
from skyspot.storage.transfer import TEMP_RE, get_each, put_each, replace_into
from skyspot.storage.uri import check_key


class LocalStore:
    """A directory: a local disk, a shared filesystem, or a SkyPilot bucket mount.

    Writes go to a hidden temporary name, are fsynced, then renamed into place, so a
    reader never sees half a file. (On FUSE bucket mounts a rename is a copy; the
    object still appears whole, just not atomically with its temp name's removal.)
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.uri = str(self.root)

    def _path(self, key: str) -> Path:
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
                if TEMP_RE.match(name):
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
