"""Where a run's durable state lives: a tiny storage protocol over string URIs.

A run root is `s3://BUCKET/PREFIX`, `gs://BUCKET/PREFIX`, `az://ACCOUNT/CONTAINER/PREFIX`
or a local directory (which may be a SkyPilot bucket mount). `gs://…` is not a `Path`, so
everything above this module speaks in *keys*: `/`-separated names relative to the
store's root, e.g. `run-1/checkpoints/step_100/COMMITTED`.

    store = open_store("s3://my-bucket/runs")
    store.put_bytes("run-1/run.json", b"{}")
    store.list("run-1/checkpoints/")   # -> ["run-1/checkpoints/step_100/COMMITTED", ...]

`parse_store_uri` runs at CLI start-up, so this module imports no cloud SDK at import
time: boto3, google-cloud-storage and azure-storage-blob are imported inside the
backends, on first use.

Credentials come from each cloud's standard chain only (environment, shared config
files, instance or workload identity); endpoints can be redirected to emulators with
`AWS_ENDPOINT_URL`, `STORAGE_EMULATOR_HOST` and an `AZURE_STORAGE_CONNECTION_STRING`
whose `BlobEndpoint` names the emulator. SDK failures become `StoreError`s with
one line that says what is wrong; `TransientStoreError` marks the ones worth retrying
(unreachable endpoint, throttling, 5xx), which `with_retries` does with backoff.
"""

from __future__ import annotations

import errno
import io
import ipaddress
import os
import random
import re
import shutil
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol, TypeVar, runtime_checkable

from skyspot.errors import StoreError, UsageError

T = TypeVar("T")

FORMS = {"s3": "s3://BUCKET/PREFIX", "gs": "gs://BUCKET/PREFIX", "az": "az://ACCOUNT/CONTAINER/PREFIX"}
EXPECTED_FORMS = ", ".join(FORMS.values()) + " or a local path"

# One parallel transfer per file; each S3 file is itself split into parallel parts.
DEFAULT_WORKERS = 8


class TransientStoreError(StoreError):
    """The store could not be reached or asked us to slow down; the same call may work later."""


# --------------------------------------------------------------------------- URIs


@dataclass(frozen=True)
class StoreURI:
    """A parsed, validated store location."""

    scheme: str
    """"s3", "gs", "az" or "file"."""
    bucket: str
    """Bucket (container for Azure); empty for local paths."""
    prefix: str
    """Key prefix inside the bucket, without leading or trailing `/`; the absolute directory for "file"."""
    account: str = ""
    """Azure storage account that holds the container; empty for other schemes."""

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

    def __str__(self) -> str:
        if self.is_local:
            return self.prefix
        account = f"{self.account}/" if self.account else ""
        return f"{self.scheme}://{account}{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")


_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def parse_store_uri(uri: str | os.PathLike) -> StoreURI:
    """Validate a store location; raise `UsageError` with one line saying what is wrong and what is expected."""
    text = os.fspath(uri)
    if not text.strip():
        raise UsageError(f"empty store location; expected {EXPECTED_FORMS}")
    match = _SCHEME_RE.match(text)
    if match is None:
        return StoreURI("file", "", os.path.abspath(os.path.expanduser(text)))
    scheme = match.group(1).lower()
    rest = text[match.end():]
    if scheme == "file":
        host, slash, path = rest.partition("/")
        if host not in ("", "localhost") or not slash:
            raise UsageError(f"store {text!r} is not a local file URI; expected file:///ABSOLUTE/PATH")
        return StoreURI("file", "", os.path.abspath("/" + path))
    if scheme not in ("s3", "gs", "az"):
        raise UsageError(f"unsupported store scheme '{scheme}://' in {text!r}; expected {EXPECTED_FORMS}")
    form = FORMS[scheme]
    account = ""
    if scheme == "az":
        account, _, rest = rest.partition("/")
        if not account:
            raise UsageError(f"store {text!r} has no storage account; expected {form}")
        problem = _azure_account_problem(account)
        if problem:
            raise UsageError(f"invalid Azure storage account name {account!r} in {text!r}: {problem}; "
                             f"expected {form}")
    bucket, _, prefix = rest.partition("/")
    noun = "container" if scheme == "az" else "bucket"
    if not bucket:
        raise UsageError(f"store {text!r} has no {noun}; expected {form}")
    problem = _BUCKET_CHECKS[scheme](bucket)
    if problem:
        raise UsageError(f"invalid {_CLOUD[scheme]} {noun} name {bucket!r} in {text!r}: {problem}; "
                         f"expected {form}")
    prefix = prefix.rstrip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise UsageError(f"store {text!r} has an empty, '.' or '..' path segment; expected {form}")
    return StoreURI(scheme, bucket, prefix, account)


_CLOUD = {"s3": "S3", "gs": "GCS", "az": "Azure"}


def _looks_like_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _s3_bucket_problem(name: str) -> str | None:
    # https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html
    if not 3 <= len(name) <= 63:
        return f"must be 3-63 characters long, not {len(name)}"
    if not re.fullmatch(r"[a-z0-9.-]+", name):
        return "may contain only lowercase letters, digits, dots and hyphens"
    if not (name[0].isalnum() and name[-1].isalnum()):
        return "must start and end with a letter or digit"
    if ".." in name:
        return "must not contain two adjacent dots"
    if _looks_like_ip(name):
        return "must not be an IP address"
    if name.startswith(("xn--", "sthree-")) or name.endswith(("-s3alias", "--ol-s3")):
        return "uses a prefix or suffix S3 reserves (xn--, sthree-, -s3alias, --ol-s3)"
    return None


def _gcs_bucket_problem(name: str) -> str | None:
    # https://cloud.google.com/storage/docs/buckets#naming
    limit = 222 if "." in name else 63
    if not 3 <= len(name) <= limit:
        return f"must be 3-63 characters long (up to 222 with dots), not {len(name)}"
    if not re.fullmatch(r"[a-z0-9._-]+", name):
        return "may contain only lowercase letters, digits, dots, hyphens and underscores"
    if not (name[0].isalnum() and name[-1].isalnum()):
        return "must start and end with a letter or digit"
    if any(not 1 <= len(part) <= 63 for part in name.split(".")):
        return "each dot-separated part must be 1-63 characters long"
    if _looks_like_ip(name):
        return "must not be an IP address"
    if name.startswith("goog") or "google" in name:
        return "must not start with 'goog' or contain 'google'"
    return None


def _azure_account_problem(name: str) -> str | None:
    # https://learn.microsoft.com/azure/azure-resource-manager/management/resource-name-rules#microsoftstorage
    if not 3 <= len(name) <= 24:
        return f"must be 3-24 characters long, not {len(name)}"
    if not re.fullmatch(r"[a-z0-9]+", name):
        return "may contain only lowercase letters and digits"
    return None


def _azure_container_problem(name: str) -> str | None:
    # https://learn.microsoft.com/rest/api/storageservices/naming-and-referencing-containers--blobs--and-metadata
    if not 3 <= len(name) <= 63:
        return f"must be 3-63 characters long, not {len(name)}"
    if not re.fullmatch(r"[a-z0-9-]+", name):
        return "may contain only lowercase letters, digits and hyphens"
    if not (name[0].isalnum() and name[-1].isalnum()) or "--" in name:
        return "must start and end with a letter or digit and not contain '--'"
    return None


_BUCKET_CHECKS = {"s3": _s3_bucket_problem, "gs": _gcs_bucket_problem, "az": _azure_container_problem}


# SkyPilot 0.14 mounts an Azure container only by its endpoint URL; it rejects az://
# (sky/data/data_utils.py AZURE_CONTAINER_URL, is_az_container_endpoint).
_AZURE_CONTAINER_URL = "https://{account}.blob.core.windows.net/{container}"


def mount_source(uri: str | os.PathLike | StoreURI) -> str:
    """The bucket-level `source` SkyPilot 0.14 mounts for a store (`file_mounts`, `mode: MOUNT`).

    `s3://BUCKET`, `gs://BUCKET`, or `https://ACCOUNT.blob.core.windows.net/CONTAINER`. Never
    the prefix: in MOUNT mode SkyPilot refuses an s3:// or gs:// source with a path in it.
    """
    parsed = uri if isinstance(uri, StoreURI) else parse_store_uri(uri)
    if parsed.is_local:
        raise ValueError(f"{parsed} is a local path, not a bucket to mount")
    if parsed.scheme == "az":
        return _AZURE_CONTAINER_URL.format(account=parsed.account, container=parsed.bucket)
    return f"{parsed.scheme}://{parsed.bucket}"


def join_key(*parts: str) -> str:
    """Join key parts with `/`, ignoring empty parts (an empty run prefix means the store root)."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in key.split("/")):
        raise ValueError(f"invalid store key {key!r}: keys are relative, '/'-separated, without '.' or '..'")
    return key


# --------------------------------------------------------------------------- protocol


@runtime_checkable
class Store(Protocol):
    """What the trainer and the ledger need from a store. Keys are relative to `uri`."""

    uri: str

    def put_file(self, local_path: str | os.PathLike, key: str) -> None: ...

    def put_bytes(self, key: str, data: bytes) -> None: ...

    def get_file(self, key: str, local_path: str | os.PathLike) -> None:
        """Download to `local_path` (written whole or not at all); FileNotFoundError if the key is missing."""

    def get_bytes(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str = "") -> list[str]:
        """Every key starting with `prefix` (recursive), sorted."""

    def delete(self, keys: Iterable[str]) -> None:
        """Delete keys; missing keys are not an error."""

    def upload_dir(self, local_dir: str | os.PathLike, prefix: str, files: list[str],
                   max_workers: int = DEFAULT_WORKERS) -> None:
        """Upload `local_dir/F` to `prefix/F` for each relative path F, in parallel."""

    def download_files(self, prefix: str, files: list[str], local_dir: str | os.PathLike,
                       max_workers: int = DEFAULT_WORKERS) -> None:
        """Download `prefix/F` to `local_dir/F` for each F, in parallel.

        A missing key raises FileNotFoundError whose `filename` is `<uri>/<key>`."""

    def open_stream(self, key: str, source: str | os.PathLike | None = None) -> "StreamUpload":
        """Start uploading `key` from bytes written to the returned stream as they are produced, many
        parts in parallel; the object appears whole at `finish`, or never (`abort`). `source` is
        the local file the producer writes the same bytes to first, read back after `release`."""


def open_store(uri: str | os.PathLike | StoreURI) -> Store:
    """Open the store at a URI. Cheap: no network and no SDK import until the first call."""
    parsed = uri if isinstance(uri, StoreURI) else parse_store_uri(uri)
    if parsed.scheme == "file":
        return LocalStore(parsed.prefix)
    if parsed.scheme == "s3":
        return S3Store(parsed.bucket, parsed.prefix)
    if parsed.scheme == "gs":
        return GCSStore(parsed.bucket, parsed.prefix)
    return AzureStore(parsed.account, parsed.bucket, parsed.prefix)


# --------------------------------------------------------------------------- retries


def backoff_delay(attempt: int, base_delay: float, max_delay: float) -> float:
    """Exponential backoff with "equal jitter": half the capped delay fixed, half random.

    Jitter spreads out many nodes retrying the same bucket after an outage; keeping half
    fixed means a retry never comes back immediately
    (https://aws.amazon.com/blogs/architecture/exponential-backoff-and-jitter/).
    """
    capped = min(max_delay, base_delay * 2 ** (attempt - 1))
    return capped / 2 + random.uniform(0, capped / 2)


def with_retries(fn: Callable[[], T], *, attempts: int | None = 5, base_delay: float = 0.5,
                 max_delay: float = 30.0,
                 on_retry: Callable[[int, BaseException, float], None] | None = None,
                 retry_on: tuple[type[BaseException], ...] = (TransientStoreError,),
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """Call `fn` until it succeeds, retrying `retry_on` errors with exponential backoff and jitter.

    `attempts=None` retries forever (the uploader ends that loop by raising from `sleep`).
    `on_retry(attempt, error, delay)` runs before each sleep, e.g. to warn once.
    Anything else raised by `fn`, or the last error once attempts run out, propagates.
    """
    attempt = 1
    while True:
        try:
            return fn()
        except retry_on as error:
            if attempts is not None and attempt >= attempts:
                raise
            delay = backoff_delay(attempt, base_delay, max_delay)
            if on_retry is not None:
                on_retry(attempt, error, delay)
            sleep(delay)
            attempt += 1


# --------------------------------------------------------------------------- parallel helpers


def _run_parallel(fn: Callable[[str], None], items: list[str], max_workers: int) -> None:
    """Run fn over items in a thread pool; the first error cancels what has not started and propagates."""
    if not items:
        return
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(items))),
                            thread_name_prefix="skyspot-transfer") as pool:
        futures = [pool.submit(fn, item) for item in items]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def _temp_sibling(path: Path) -> Path:
    """A hidden name next to `path`: same filesystem, so os.replace is atomic."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.partial")


_TEMP_RE = re.compile(r"^\..*\.[0-9a-f]{12}\.partial$")


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


def _replace_into(write: Callable[[Path], None], target: Path, durable: bool = True) -> None:
    """Write via `write(temp)` then rename onto `target`, so a reader never sees half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = _temp_sibling(target)
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


# --------------------------------------------------------------------------- streaming uploads

# What a checkpoint file streams in: parts of this size, this many in flight per file (S3
# multipart parts, GCS composite parts, Azure blocks). 8 ranks per node x 8 parts x 16 MiB keeps
# about 1 GiB in flight per node, which is what saturating a 100 Gbit/s NIC to S3 takes at
# ~80 ms per part request (S3 performance guidelines: 8-16 MB parts, many connections).
STREAM_PART_BYTES = 16 * 1024 * 1024
STREAM_CONCURRENCY = 8
# Chunks below this are copied as they pass (zip headers, pickles); larger ones are kept as views
# of the caller's memory until `release()` (the snapshot buffers: no copy at all).
_STREAM_COPY_BELOW = 1 << 20


class StreamAborted(StoreError):
    """The stream was aborted (superseded, past its deadline, or the writer failed); nothing was committed."""


class _Pipe(io.RawIOBase):
    """Bytes from a producer (the checkpoint writer) to an SDK's reader thread, never blocking the producer.

    Large chunks are kept as views of the producer's memory, small ones copied. `release()` turns
    every chunk not yet read into a range of `source` (the local file the producer writes first,
    so it holds those bytes), after which the producer's memory may be reused. `abort()` makes the
    reader fail, so the SDK never completes the object.
    """

    def __init__(self, source: str | os.PathLike | None):
        super().__init__()
        self._source = os.fspath(source) if source is not None else None
        self._cv = threading.Condition()
        self._segments: deque = deque()  # [memoryview] or [(offset, length)] for file ranges
        self._written = 0
        self._read = 0
        self._eof = False
        self._aborted: str | None = None
        self._fd: int | None = None

    # producer side
    def feed(self, data) -> None:
        view = memoryview(data).cast("B")
        if not len(view):
            return
        with self._cv:
            if self._aborted:
                return
            self._segments.append(view if len(view) >= _STREAM_COPY_BELOW else memoryview(bytes(view)))
            self._written += len(view)
            self._cv.notify_all()

    def end(self) -> None:
        with self._cv:
            self._eof = True
            self._cv.notify_all()

    def release(self) -> None:
        """From now on, read what is left from `source`, not from the producer's memory."""
        with self._cv:
            if self._source is None:
                self._segments = deque(memoryview(bytes(s)) if isinstance(s, memoryview) else s
                                       for s in self._segments)
                return
            offset = self._read
            ranges: deque = deque()
            for segment in self._segments:
                length = len(segment) if isinstance(segment, memoryview) else segment[1]
                ranges.append((offset, length))
                offset += length
            self._segments = ranges

    def abort(self, reason: str) -> None:
        with self._cv:
            self._aborted = reason
            self._segments.clear()
            self._cv.notify_all()

    @property
    def written(self) -> int:
        return self._written

    @property
    def aborted(self) -> str | None:
        return self._aborted

    @property
    def consumed(self) -> int:
        return self._read

    # reader side (the SDK)
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readinto(self, buffer) -> int:
        out = memoryview(buffer).cast("B")
        with self._cv:
            self._cv.wait_for(lambda: self._segments or self._eof or self._aborted)
            if self._aborted:
                raise StreamAborted(self._aborted)
            if not self._segments:
                return 0  # end of data
            head = self._segments[0]
            if isinstance(head, memoryview):
                n = min(len(out), len(head))
                out[:n] = head[:n]
                if n == len(head):
                    self._segments.popleft()
                else:
                    self._segments[0] = head[n:]
            else:
                offset, length = head
                if self._fd is None:
                    self._fd = os.open(self._source, os.O_RDONLY)
                n = os.preadv(self._fd, [out[:min(len(out), length)]], offset)
                if n <= 0:
                    raise StreamAborted(f"{self._source} is shorter than what was written to it")
                if n == length:
                    self._segments.popleft()
                else:
                    self._segments[0] = (offset + n, length - n)
            self._read += n
            return n

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        super().close()


class StreamUpload:
    """One object uploaded while its bytes are produced: `write` as they come (never blocks on the
    network), `release` before the producer reuses its memory, `finish` to wait until the object is
    whole in the store, `abort` to give up without ever committing it.

    A backend supplies `send(reader)`, which uploads everything `reader` yields to the key with the
    SDK's own parallel machinery and commits the object only at the end of the data; it runs on a
    thread of its own. Errors surface from `finish` as StoreErrors."""

    def __init__(self, store_uri: str, key: str, send: Callable[["_Pipe"], None], source=None,
                 on_abort: Callable[[], None] | None = None):
        self.key = key
        self.where = f"{store_uri}/{key}"
        self._pipe = _Pipe(source)
        self._error: BaseException | None = None
        self._on_abort = on_abort
        self.started = time.monotonic()
        self.finished: float | None = None

        def run() -> None:
            try:
                send(self._pipe)
            except BaseException as error:  # surfaces in finish()
                self._error = error
            finally:
                self.finished = time.monotonic()
                self._pipe.close()

        self._thread = threading.Thread(target=run, name=f"skyspot-stream-{key.rsplit('/', 1)[-1]}", daemon=True)
        self._thread.start()

    def write(self, data) -> None:
        self._pipe.feed(data)

    def end(self) -> None:
        """No more data (the producer's file is complete)."""
        self._pipe.end()

    def release(self) -> None:
        self._pipe.release()

    @property
    def bytes(self) -> int:
        return self._pipe.written

    @property
    def sent(self) -> int:
        """Bytes the SDK has taken so far (read from the stream; not necessarily acknowledged)."""
        return self._pipe.consumed

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def finish(self, timeout: float | None = None) -> bool:
        """End the data and wait up to `timeout`; True once the object is whole in the store.
        Raises the upload's StoreError (StreamAborted after abort)."""
        self._pipe.end()
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        if self._pipe.aborted:
            raise StreamAborted(self._pipe.aborted)
        if self._error is not None:
            error = self._error
            if isinstance(error, StoreError):
                raise error
            cause = next((e for e in (error, error.__cause__, error.__context__) if isinstance(e, StreamAborted)), None)
            if cause is not None:
                raise cause
            raise StoreError(f"cannot upload {self.where}: {type(error).__name__}: {_one_line(error)}")
        return True

    def abort(self, reason: str, wait: float = 0.0) -> None:
        """Stop: the object is never committed (the SDK's read fails; multipart uploads are aborted)."""
        self._pipe.abort(reason)
        if self._on_abort is not None:
            try:
                self._on_abort()
            except Exception:
                pass
        if wait:
            self._thread.join(wait)


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


# --------------------------------------------------------------------------- local


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
        return self.root / _check_key(key)

    def _os_error(self, error: OSError, key: str) -> StoreError:
        return StoreError(f"cannot use {self.root / key}: {error.strerror or error}")

    def put_file(self, local_path, key):
        try:
            _replace_into(lambda temp: shutil.copyfile(local_path, temp), self._path(key))
        except FileNotFoundError:
            raise
        except OSError as error:
            raise self._os_error(error, key) from None

    def put_bytes(self, key, data):
        try:
            _replace_into(lambda temp: temp.write_bytes(data), self._path(key))
        except OSError as error:
            raise self._os_error(error, key) from None

    def get_file(self, key, local_path):
        source = self._path(key)
        if not source.is_file():
            raise FileNotFoundError(errno.ENOENT, "not found in store", f"{self.uri}/{key}")
        try:
            _replace_into(lambda temp: shutil.copyfile(source, temp), Path(local_path), durable=False)
        except FileNotFoundError:
            raise
        except OSError as error:
            raise self._os_error(error, key) from None

    def get_bytes(self, key):
        try:
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
                if _TEMP_RE.match(name):
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
        _run_parallel(lambda rel: self.put_file(Path(local_dir) / rel, join_key(prefix, rel)),
                      list(files), max_workers)

    def download_files(self, prefix, files, local_dir, max_workers=DEFAULT_WORKERS):
        _run_parallel(lambda rel: self.get_file(join_key(prefix, rel), Path(local_dir) / rel),
                      list(files), max_workers)

    def open_stream(self, key, source=None):
        target = self._path(key)

        def send(pipe: _Pipe) -> None:
            def write(temp: Path) -> None:
                with open(temp, "wb") as f:
                    shutil.copyfileobj(pipe, f, STREAM_PART_BYTES)
            try:
                _replace_into(write, target)  # a hidden name until the end: a reader never sees half of it
            except OSError as error:
                raise self._os_error(error, key) from None

        return StreamUpload(self.uri, key, send, source)


# --------------------------------------------------------------------------- S3

# S3 caps a DeleteObjects request at 1,000 keys (DeleteObjects API reference).
_S3_DELETE_BATCH = 1000
# AWS suggests 8-16 MB parts for throughput; s3transfer raises the part size by itself
# for files that would exceed S3's 10,000-part limit.
_S3_PART_BYTES = 16 * 1024 * 1024
_S3_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                       "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable", "503", "500"}


class S3Store:
    """An S3 (or S3-compatible) bucket through boto3.

    boto3 (>= 1.28) honours `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3` itself, which is
    how tests and S3-compatible stores redirect it. Large files go through
    `client.upload_file`, i.e. multipart with parallel parts.
    """

    def __init__(self, bucket: str, prefix: str = "", *, sdk_attempts: int = 3,
                 connect_timeout: float = 10.0, read_timeout: float = 120.0):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self._options = (sdk_attempts, connect_timeout, read_timeout)
        self._client = None
        self._transfer_config = None
        self._stream_manager = None
        self.stream_client: str | None = None
        """"crt" or "classic" once a stream was opened: which transfer client streams go through."""
        self._lock = threading.Lock()

    def _s3(self):
        with self._lock:
            if self._client is None:
                import boto3
                from boto3.s3.transfer import TransferConfig
                from botocore.config import Config

                attempts, connect_timeout, read_timeout = self._options
                # The SDK retries briefly; long outages are the caller's with_retries' job,
                # so a stuck endpoint surfaces within seconds, not minutes.
                config = Config(retries={"max_attempts": attempts, "mode": "standard"},
                                connect_timeout=connect_timeout, read_timeout=read_timeout,
                                max_pool_connections=64)
                try:
                    self._client = boto3.session.Session().client("s3", config=config)
                except Exception as error:  # e.g. a malformed AWS config file or endpoint
                    raise StoreError(f"cannot set up an S3 client for {self.uri}: {error}") from None
                self._transfer_config = TransferConfig(
                    multipart_threshold=_S3_PART_BYTES, multipart_chunksize=_S3_PART_BYTES,
                    max_concurrency=4)
            return self._client

    def _key(self, key: str) -> str:
        return join_key(self.prefix, _check_key(key))

    def _error(self, error: BaseException, action: str, key: str = "") -> StoreError:
        return _s3_error(error, f"{action} {self.uri}/{key}".rstrip("/"), self._client)

    def put_file(self, local_path, key):
        client = self._s3()
        try:
            client.upload_file(os.fspath(local_path), self.bucket, self._key(key),
                               Config=self._transfer_config)
        except Exception as error:
            raise self._error(error, "upload to", key) from None

    def put_bytes(self, key, data):
        client = self._s3()
        try:
            client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except Exception as error:
            raise self._error(error, "write", key) from None

    def get_file(self, key, local_path):
        client = self._s3()
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        try:
            # s3transfer downloads to a temporary name and renames it into place itself.
            client.download_file(self.bucket, self._key(key), os.fspath(local_path),
                                 Config=self._transfer_config)
        except Exception as error:
            if _s3_code(error) in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(errno.ENOENT, "not found in store", f"{self.uri}/{key}") from None
            raise self._error(error, "download", key) from None

    def get_bytes(self, key):
        client = self._s3()
        try:
            return client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except Exception as error:
            if _s3_code(error) in ("404", "NoSuchKey"):
                return None
            raise self._error(error, "read", key) from None

    def exists(self, key):
        client = self._s3()
        try:
            client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except Exception as error:
            if _s3_code(error) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise self._error(error, "check", key) from None

    def list(self, prefix=""):
        client = self._s3()
        root = f"{self.prefix}/" if self.prefix else ""
        keys = []
        try:
            for page in client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=root + prefix):
                keys.extend(item["Key"][len(root):] for item in page.get("Contents", ()))
        except Exception as error:
            raise self._error(error, "list", prefix) from None
        return sorted(keys)

    def delete(self, keys):
        client = self._s3()
        keys = [self._key(k) for k in keys]
        for start in range(0, len(keys), _S3_DELETE_BATCH):
            batch = keys[start:start + _S3_DELETE_BATCH]
            try:
                response = client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            except Exception as error:
                raise self._error(error, "delete from") from None
            failed = response.get("Errors") or []
            if failed:
                first = failed[0]
                raise StoreError(f"cannot delete s3://{self.bucket}/{first.get('Key')}: "
                                 f"{first.get('Code')} ({len(failed)} keys failed)")

    def upload_dir(self, local_dir, prefix, files, max_workers=DEFAULT_WORKERS):
        self._s3()
        _run_parallel(lambda rel: self.put_file(Path(local_dir) / rel, join_key(prefix, rel)),
                      list(files), max_workers)

    def download_files(self, prefix, files, local_dir, max_workers=DEFAULT_WORKERS):
        self._s3()
        _run_parallel(lambda rel: self.get_file(join_key(prefix, rel), Path(local_dir) / rel),
                      list(files), max_workers)

    def open_stream(self, key, source=None):
        manager = self._streams()
        future: list = []

        def send(pipe: _Pipe) -> None:
            try:
                future.append(manager.upload(pipe, self.bucket, self._key(key)))
                future[0].result()
            except StreamAborted:
                raise
            except Exception as error:
                raise self._error(error, "upload to", key) from None

        return StreamUpload(self.uri, key, send, source, on_abort=lambda: future and future[0].cancel())

    def _streams(self):
        """The transfer manager streams go through: the AWS Common Runtime's S3 client (awscrt, the
        one boto3 uses for its CRT transfers) when it is installed, else boto3's classic
        TransferManager. SKYSPOT_S3_CLIENT=classic|crt chooses."""
        client = self._s3()
        with self._lock:
            if self._stream_manager is None:
                wanted = os.environ.get("SKYSPOT_S3_CLIENT", "").strip().lower() or "auto"
                manager = None
                if wanted in ("auto", "crt"):
                    try:
                        manager = _crt_transfer_manager(client)
                        self.stream_client = "crt"
                    except ImportError:
                        if wanted == "crt":
                            raise StoreError("SKYSPOT_S3_CLIENT=crt, but awscrt is not installed "
                                             "(pip install awscrt)") from None
                if manager is None:
                    from boto3.s3.transfer import TransferConfig, create_transfer_manager

                    manager = create_transfer_manager(client, TransferConfig(
                        multipart_threshold=STREAM_PART_BYTES, multipart_chunksize=STREAM_PART_BYTES,
                        max_concurrency=STREAM_CONCURRENCY, preferred_transfer_client="classic"))
                    self.stream_client = "classic"
                self._stream_manager = manager
            return self._stream_manager


def _crt_transfer_manager(client):
    """s3transfer's CRTTransferManager over a CRT S3 client of our own. boto3's helper
    (boto3.crt) would do the same but always with TLS and one client per machine (a cross-process
    lock); ours follows the client's endpoint (http on loopback in tests) and lets every rank of a
    node stream its own shards. Raises ImportError without awscrt."""
    import awscrt.s3  # noqa: F401 - ImportError here means: fall back to the classic manager
    import botocore.session
    from s3transfer.crt import (BotocoreCRTCredentialsWrapper, BotocoreCRTRequestSerializer, CRTTransferManager,
                                create_s3_crt_client)

    endpoint = client.meta.endpoint_url or ""
    region = client.meta.region_name or "us-east-1"
    custom = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    credentials = client._get_credentials()  # botocore's refreshing credentials (instance role etc.)
    provider = BotocoreCRTCredentialsWrapper(credentials).to_crt_credentials_provider() if credentials else None
    threads = max(2, (os.cpu_count() or 2) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))
    crt = create_s3_crt_client(region=region, crt_credentials_provider=provider, num_threads=threads,
                               part_size=STREAM_PART_BYTES, use_ssl=not endpoint.startswith("http://"))
    serializer = BotocoreCRTRequestSerializer(botocore.session.Session(),
                                              {"region_name": region, "endpoint_url": custom})
    return CRTTransferManager(crt, serializer)


def _s3_code(error: BaseException) -> str | None:
    """The S3 error code of a ClientError, also when boto3 wrapped it (S3UploadFailedError)."""
    from botocore.exceptions import ClientError

    for candidate in (error, error.__cause__, error.__context__):
        if isinstance(candidate, ClientError):
            return str(candidate.response.get("Error", {}).get("Code"))
    return None


def _s3_error(error: BaseException, what: str, client) -> StoreError:
    from botocore import exceptions as bce

    endpoint = getattr(getattr(client, "meta", None), "endpoint_url", None) or "S3"
    cause = error
    if type(error).__name__ == "S3UploadFailedError" and error.__context__ is not None:
        cause = error.__context__  # boto3 re-raises upload errors as this, losing the type
    if isinstance(cause, (bce.NoCredentialsError, bce.PartialCredentialsError)):
        return StoreError(f"cannot {what}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                          "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run with an instance role")
    if isinstance(cause, (bce.EndpointConnectionError, bce.ConnectTimeoutError, bce.ReadTimeoutError,
                          bce.ConnectionClosedError, bce.ConnectionError)):
        return TransientStoreError(f"cannot {what}: endpoint {endpoint} unreachable ({type(cause).__name__})")
    if type(cause).__name__ == "AwsCrtError":  # the CRT client's transport errors (refused, reset, timed out)
        return TransientStoreError(f"cannot {what}: {getattr(cause, 'name', 'AwsCrtError')}")
    code = _s3_code(error)
    if code is not None:
        status = None
        if isinstance(cause, bce.ClientError):
            status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in _S3_TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429)):
            return TransientStoreError(f"cannot {what}: S3 answered {code} (throttled or unavailable)")
        if code == "NoSuchBucket":
            return StoreError(f"cannot {what}: the bucket does not exist; create it or fix the store URI")
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
            return StoreError(f"cannot {what}: access denied ({code}); check the AWS credentials "
                              "and the bucket policy")
        return StoreError(f"cannot {what}: S3 answered {code}")
    return StoreError(f"cannot {what}: {type(cause).__name__}: {cause}")


# --------------------------------------------------------------------------- GCS


class GCSStore:
    """A Google Cloud Storage bucket through google-cloud-storage.

    With `STORAGE_EMULATOR_HOST` set (fake-gcs-server in tests) the client talks to the
    emulator anonymously under a placeholder project; otherwise it uses Application
    Default Credentials (env key file, gcloud login, or the VM's service account).

    Bulk transfers use `transfer_manager.upload_many` / `download_many` with threads.
    Not `upload_chunks_concurrently`: it uses the XML multipart API, which
    fake-gcs-server does not implement (404), so big files go as one resumable upload.
    """

    def __init__(self, bucket: str, prefix: str = "", *, sdk_retry_seconds: float = 10.0,
                 timeout: tuple[float, float] = (10.0, 120.0)):
        self.bucket_name = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"gs://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self._retry_seconds = sdk_retry_seconds
        self._timeout = timeout
        self._bucket = None
        self._retry = None
        self._lock = threading.Lock()

    def _gcs(self):
        with self._lock:
            if self._bucket is None:
                from google.cloud import storage
                from google.cloud.storage.retry import DEFAULT_RETRY

                try:
                    if os.environ.get("STORAGE_EMULATOR_HOST"):
                        from google.auth.credentials import AnonymousCredentials

                        client = storage.Client(project="test", credentials=AnonymousCredentials())
                    else:
                        client = storage.Client()
                except Exception as error:
                    raise _gcs_error(error, f"connect to {self.uri}") from None
                # The SDK's own retry loop would run for 120 s by default; keep it short and
                # let the caller's with_retries handle long outages (and warn about them).
                self._retry = DEFAULT_RETRY.with_timeout(self._retry_seconds) if self._retry_seconds else None
                self._bucket = client.bucket(self.bucket_name)
            return self._bucket

    def _blob(self, key: str):
        return self._gcs().blob(join_key(self.prefix, _check_key(key)))

    def _error(self, error: BaseException, action: str, key: str = "") -> StoreError:
        return _gcs_error(error, f"{action} {self.uri}/{key}".rstrip("/"))

    def put_file(self, local_path, key):
        blob = self._blob(key)
        try:
            blob.upload_from_filename(os.fspath(local_path), retry=self._retry, timeout=self._timeout)
        except FileNotFoundError:
            raise
        except Exception as error:
            raise self._error(error, "upload to", key) from None

    def put_bytes(self, key, data):
        blob = self._blob(key)
        try:
            blob.upload_from_string(data, retry=self._retry, timeout=self._timeout)
        except Exception as error:
            raise self._error(error, "write", key) from None

    def get_file(self, key, local_path):
        blob = self._blob(key)
        target = Path(local_path)
        try:
            _replace_into(lambda temp: blob.download_to_filename(
                os.fspath(temp), retry=self._retry, timeout=self._timeout), target, durable=False)
        except Exception as error:
            if _is_not_found(error):
                raise FileNotFoundError(errno.ENOENT, "not found in store", f"{self.uri}/{key}") from None
            raise self._error(error, "download", key) from None

    def get_bytes(self, key):
        blob = self._blob(key)
        try:
            return blob.download_as_bytes(retry=self._retry, timeout=self._timeout)
        except Exception as error:
            if _is_not_found(error):
                return None
            raise self._error(error, "read", key) from None

    def exists(self, key):
        blob = self._blob(key)
        try:
            return blob.exists(retry=self._retry, timeout=self._timeout)
        except Exception as error:
            raise self._error(error, "check", key) from None

    def list(self, prefix=""):
        bucket = self._gcs()
        root = f"{self.prefix}/" if self.prefix else ""
        try:
            names = [b.name[len(root):] for b in bucket.client.list_blobs(
                bucket, prefix=root + prefix, retry=self._retry, timeout=self._timeout)]
        except Exception as error:
            raise self._error(error, "list", prefix) from None
        return sorted(names)

    def delete(self, keys):
        def delete_one(key: str) -> None:
            try:
                self._blob(key).delete(retry=self._retry, timeout=self._timeout)
            except Exception as error:
                if not _is_not_found(error):
                    raise self._error(error, "delete", key) from None

        _run_parallel(delete_one, list(keys), DEFAULT_WORKERS)

    def upload_dir(self, local_dir, prefix, files, max_workers=DEFAULT_WORKERS):
        from google.cloud.storage import transfer_manager

        files = list(files)
        pairs = [(os.fspath(Path(local_dir) / rel), self._blob(join_key(prefix, rel))) for rel in files]
        results = transfer_manager.upload_many(
            pairs, worker_type=transfer_manager.THREAD, max_workers=max_workers,
            upload_kwargs={"retry": self._retry, "timeout": self._timeout})
        for rel, result in zip(files, results):
            if isinstance(result, FileNotFoundError):
                raise result
            if isinstance(result, BaseException):
                raise self._error(result, "upload to", join_key(prefix, rel))

    def download_files(self, prefix, files, local_dir, max_workers=DEFAULT_WORKERS):
        from google.cloud.storage import transfer_manager

        files = list(files)
        targets = [Path(local_dir) / rel for rel in files]
        temps = [_temp_sibling(t) for t in targets]
        for target in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
        pairs = [(self._blob(join_key(prefix, rel)), os.fspath(temp)) for rel, temp in zip(files, temps)]
        try:
            results = transfer_manager.download_many(
                pairs, worker_type=transfer_manager.THREAD, max_workers=max_workers,
                download_kwargs={"retry": self._retry, "timeout": self._timeout})
            for rel, temp, target, result in zip(files, temps, targets, results):
                key = join_key(prefix, rel)
                if result is None:
                    os.replace(temp, target)
                elif _is_not_found(result):
                    raise FileNotFoundError(errno.ENOENT, "not found in store", f"{self.uri}/{key}")
                else:
                    raise self._error(result, "download", key)
        finally:
            for temp in temps:
                temp.unlink(missing_ok=True)


    def open_stream(self, key, source=None):
        """A parallel composite upload: parts become temporary objects (`<key>.parts/<n>`), uploaded
        STREAM_CONCURRENCY at a time, then composed into the object (32 at a time, GCS's limit) and
        deleted. This is what `gcloud storage` does for large files. Not the transfer manager's
        `upload_chunks_concurrently`: it reads a finished file by ranges, and its XML multipart API
        is not in fake-gcs-server (404), so it could not be tested here."""
        bucket = self._gcs()
        name = join_key(self.prefix, _check_key(key))
        parts_prefix = f"{name}.parts-{uuid.uuid4().hex[:8]}/"

        def upload_part(index: int, data: bytes) -> None:
            blob = bucket.blob(f"{parts_prefix}{index:05d}")
            blob.upload_from_string(data, retry=self._retry, timeout=self._timeout, checksum="crc32c")

        def send(pipe: _Pipe) -> None:
            count = 0
            try:
                # At most twice the concurrency of parts in memory: reading waits for a slot.
                window = threading.Semaphore(STREAM_CONCURRENCY * 2)
                with ThreadPoolExecutor(max_workers=STREAM_CONCURRENCY, thread_name_prefix="skyspot-gcs-part") as pool:
                    futures = []
                    while True:
                        window.acquire()
                        data = _read_full(pipe, STREAM_PART_BYTES)
                        if not data and count > 0:
                            break
                        future = pool.submit(upload_part, count, data)
                        future.add_done_callback(lambda _f: window.release())
                        futures.append(future)
                        count += 1
                        if len(data) < STREAM_PART_BYTES:
                            break
                    for future in futures:
                        future.result()
                parts = [bucket.blob(f"{parts_prefix}{i:05d}") for i in range(count)]
                _compose(bucket, bucket.blob(name), parts, self._retry, self._timeout)
            except StreamAborted:
                raise
            except Exception as error:
                raise self._error(error, "upload to", key) from None
            finally:
                _delete_quietly([bucket.blob(f"{parts_prefix}{i:05d}") for i in range(count)], self._retry,
                                self._timeout)

        return StreamUpload(self.uri, key, send, source)


def _read_full(reader, size: int) -> bytes:
    """Up to `size` bytes from a stream, fewer only at its end."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = reader.readinto(view[got:])
        if not n:
            break
        got += n
    del view
    return bytes(buffer) if got == size else bytes(buffer[:got])


# GCS composes at most 32 sources per request (https://cloud.google.com/storage/docs/composite-objects).
_GCS_COMPOSE_MAX = 32


def _compose(bucket, target, parts: list, retry, timeout) -> None:
    """Compose `parts` into `target`, in rounds of 32 through intermediate objects when there are more."""
    level = 0
    while len(parts) > _GCS_COMPOSE_MAX:
        merged = []
        for i in range(0, len(parts), _GCS_COMPOSE_MAX):
            blob = bucket.blob(f"{parts[0].name}.c{level}-{i // _GCS_COMPOSE_MAX:05d}")
            blob.compose(parts[i:i + _GCS_COMPOSE_MAX], retry=retry, timeout=timeout)
            merged.append(blob)
        if level:  # intermediate objects of the previous round (the caller deletes the parts)
            _delete_quietly(parts, retry, timeout)
        parts, level = merged, level + 1
    target.compose(parts, retry=retry, timeout=timeout)
    if level:
        _delete_quietly(parts, retry, timeout)


def _delete_quietly(blobs: list, retry, timeout) -> None:
    """Best effort: leftover parts are only clutter (the retention pass deletes a step's keys)."""
    for blob in blobs:
        try:
            blob.delete(retry=retry, timeout=timeout)
        except Exception:
            pass


def _is_not_found(error: BaseException) -> bool:
    from google.api_core.exceptions import NotFound

    return isinstance(error, NotFound) or getattr(getattr(error, "response", None), "status_code", None) == 404


def _gcs_error(error: BaseException, what: str) -> StoreError:
    import requests
    from google.api_core import exceptions as gexc
    from google.auth import exceptions as auth_exc

    endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or "storage.googleapis.com"
    if isinstance(error, auth_exc.DefaultCredentialsError):
        return StoreError(f"cannot {what}: no Google Cloud credentials found; run `gcloud auth "
                          "application-default login` or set GOOGLE_APPLICATION_CREDENTIALS")
    if isinstance(error, gexc.RetryError) and error.cause is not None:
        error = error.cause
    if isinstance(error, (requests.ConnectionError, requests.Timeout, ConnectionError,
                          auth_exc.TransportError)):
        return TransientStoreError(f"cannot {what}: endpoint {endpoint} unreachable ({type(error).__name__})")
    status = getattr(error, "code", None)
    if status is None:
        status = getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(status, int):
        if status in (408, 429) or status >= 500:
            return TransientStoreError(f"cannot {what}: GCS answered HTTP {status} (throttled or unavailable)")
        if status in (401, 403):
            return StoreError(f"cannot {what}: access denied (HTTP {status}); check the Google "
                              "credentials and the bucket's IAM")
        if status == 404:
            return StoreError(f"cannot {what}: the bucket does not exist; create it or fix the store URI")
        return StoreError(f"cannot {what}: GCS answered HTTP {status}")
    if isinstance(error, auth_exc.RefreshError):
        return StoreError(f"cannot {what}: Google credentials could not be refreshed; log in again")
    return StoreError(f"cannot {what}: {type(error).__name__}: {error}")


# --------------------------------------------------------------------------- Azure Blob

# Files over this size go up as parallel blocks of this size and come down as parallel
# ranges (the SDK's own chunking, max_concurrency per file); like S3's parts. A block blob
# holds up to 50,000 blocks, so 16 MiB blocks allow 780 GiB per file.
_AZ_BLOCK_BYTES = 16 * 1024 * 1024
_AZ_CHUNK_CONCURRENCY = 4
_AZ_TRANSIENT_CODES = {"ServerBusy", "OperationTimedOut", "InternalError"}
_AZ_CREDENTIALS_HINT = ("set AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN, "
                        "or install azure-identity and run `az login` or use a managed identity")


class AzureStore:
    """An Azure Blob Storage container through azure-storage-blob.

    Credentials, the first one set wins: `AZURE_STORAGE_CONNECTION_STRING` (its
    `BlobEndpoint` also redirects the client, which is how tests reach Azurite), then
    `AZURE_STORAGE_KEY` or `AZURE_STORAGE_SAS_TOKEN` for the URI's account, then
    azure-identity's `DefaultAzureCredential` (service principal variables, managed
    identity, `az login`) when that package is installed.
    """

    def __init__(self, account: str, container: str, prefix: str = "", *, sdk_attempts: int = 3,
                 connect_timeout: float = 10.0, read_timeout: float = 120.0):
        self.account = account
        self.container_name = container
        self.prefix = prefix.strip("/")
        self.uri = str(StoreURI("az", container, self.prefix, account))
        self._options = (sdk_attempts, connect_timeout, read_timeout)
        self._endpoint = f"https://{account}.blob.core.windows.net"
        self._container = None
        self._lock = threading.Lock()

    def _az(self):
        with self._lock:
            if self._container is None:
                self._container = self._connect()
            return self._container

    def _connect(self):
        import requests
        from azure.core.pipeline.transport import RequestsTransport
        from azure.storage.blob import BlobServiceClient, ExponentialRetry
        from requests.adapters import HTTPAdapter
        from urllib3.util.retry import Retry

        attempts, connect_timeout, read_timeout = self._options
        what = f"connect to az://{self.account}/{self.container_name}"
        # Up to 8 files x 4 chunks in flight: a pool that small (requests' default is 10)
        # makes urllib3 warn and drop connections. The SDK's retry policy does the retrying.
        session = requests.Session()
        adapter = HTTPAdapter(pool_maxsize=64, max_retries=Retry(
            total=False, redirect=False, raise_on_status=False))
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        options = dict(
            transport=RequestsTransport(session=session, connection_timeout=connect_timeout,
                                        read_timeout=read_timeout, connection_data_block_size=256 * 1024),
            # The SDK retries briefly (its default waits 15 s, then more); long outages are the
            # caller's with_retries' job, so a dead endpoint surfaces within seconds.
            retry_policy=ExponentialRetry(initial_backoff=1, increment_base=2, retry_total=max(0, attempts - 1),
                                          random_jitter_range=1),
            max_single_put_size=_AZ_BLOCK_BYTES, max_block_size=_AZ_BLOCK_BYTES,
            max_single_get_size=_AZ_BLOCK_BYTES, max_chunk_get_size=_AZ_BLOCK_BYTES)
        env = os.environ
        connection_string = env.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
        if connection_string:
            fields = {k.strip().lower(): v.strip() for k, _, v in
                      (part.partition("=") for part in connection_string.split(";")) if v}
            named = fields.get("accountname", "").lower()
            if named and named != self.account:
                raise StoreError(f"cannot {what}: AZURE_STORAGE_CONNECTION_STRING is for storage account "
                                 f"{named!r}, not {self.account!r}")
            try:
                service = BlobServiceClient.from_connection_string(connection_string, **options)
            except ValueError:  # never quote it: it holds the key
                raise StoreError(f"cannot {what}: AZURE_STORAGE_CONNECTION_STRING is malformed") from None
        else:
            key = env.get("AZURE_STORAGE_KEY", "").strip()
            sas = env.get("AZURE_STORAGE_SAS_TOKEN", "").strip().lstrip("?")
            named = env.get("AZURE_STORAGE_ACCOUNT", "").strip().lower()
            if (key or sas) and named and named != self.account:
                raise StoreError(f"cannot {what}: AZURE_STORAGE_KEY / AZURE_STORAGE_SAS_TOKEN are for "
                                 f"AZURE_STORAGE_ACCOUNT {named!r}, not {self.account!r}")
            if key:
                credential = {"account_name": self.account, "account_key": key}
            elif sas:
                credential = sas
            else:
                try:
                    from azure.identity import DefaultAzureCredential
                except ImportError:
                    raise StoreError(f"cannot {what}: no Azure credentials found; {_AZ_CREDENTIALS_HINT}") from None
                credential = DefaultAzureCredential()
            service = BlobServiceClient(self._endpoint, credential=credential, **options)
        self._endpoint = f"{service.scheme}://{service.primary_hostname}"  # not service.url: it has the SAS
        return service.get_container_client(self.container_name)

    def _blob(self, key: str):
        return self._az().get_blob_client(join_key(self.prefix, _check_key(key)))

    def _error(self, error: BaseException, action: str, key: str = "") -> StoreError:
        return _azure_error(error, f"{action} {self.uri}/{key}".rstrip("/"), self._endpoint)

    def _missing(self, key: str) -> FileNotFoundError:
        return FileNotFoundError(errno.ENOENT, "not found in store", f"{self.uri}/{key}")

    def put_file(self, local_path, key):
        blob = self._blob(key)
        with open(local_path, "rb") as f:
            try:
                blob.upload_blob(f, length=os.fstat(f.fileno()).st_size, overwrite=True,
                                 max_concurrency=_AZ_CHUNK_CONCURRENCY)
            except Exception as error:
                raise self._error(error, "upload to", key) from None

    def put_bytes(self, key, data):
        blob = self._blob(key)
        try:
            blob.upload_blob(data, overwrite=True)
        except Exception as error:
            raise self._error(error, "write", key) from None

    def get_file(self, key, local_path):
        blob = self._blob(key)

        def download(temp: Path) -> None:
            stream = blob.download_blob(max_concurrency=_AZ_CHUNK_CONCURRENCY)  # 404 here, before the file
            with open(temp, "wb") as f:
                stream.readinto(f)

        try:
            _replace_into(download, Path(local_path), durable=False)
        except Exception as error:
            if _az_blob_missing(error):
                raise self._missing(key) from None
            raise self._error(error, "download", key) from None

    def get_bytes(self, key):
        blob = self._blob(key)
        try:
            return blob.download_blob(max_concurrency=_AZ_CHUNK_CONCURRENCY).readall()
        except Exception as error:
            if _az_blob_missing(error):
                return None
            raise self._error(error, "read", key) from None

    def exists(self, key):
        blob = self._blob(key)
        try:
            blob.get_blob_properties()
            return True
        except Exception as error:
            if _az_blob_missing(error):
                return False
            raise self._error(error, "check", key) from None

    def list(self, prefix=""):
        container = self._az()
        root = f"{self.prefix}/" if self.prefix else ""
        try:
            names = [name[len(root):] for name in container.list_blob_names(name_starts_with=(root + prefix) or None)]
        except Exception as error:
            raise self._error(error, "list", prefix) from None
        return sorted(names)

    def delete(self, keys):
        def delete_one(key: str) -> None:
            try:
                self._blob(key).delete_blob()
            except Exception as error:
                if not _az_blob_missing(error):
                    raise self._error(error, "delete", key) from None

        self._az()
        _run_parallel(delete_one, list(keys), DEFAULT_WORKERS)

    def upload_dir(self, local_dir, prefix, files, max_workers=DEFAULT_WORKERS):
        self._az()
        _run_parallel(lambda rel: self.put_file(Path(local_dir) / rel, join_key(prefix, rel)),
                      list(files), max_workers)

    def download_files(self, prefix, files, local_dir, max_workers=DEFAULT_WORKERS):
        self._az()
        _run_parallel(lambda rel: self.get_file(join_key(prefix, rel), Path(local_dir) / rel),
                      list(files), max_workers)

    def open_stream(self, key, source=None):
        """The SDK's own chunked upload of a stream of unknown length: blocks of _AZ_BLOCK_BYTES
        staged STREAM_CONCURRENCY at a time, committed as one block list at the end (an aborted
        stream commits nothing; staged blocks expire)."""
        blob = self._blob(key)

        def send(pipe: _Pipe) -> None:
            try:
                # The SDK's chunked path spins forever on a stream that turns out empty
                # (azure-storage-blob 12.31 `_parallel_uploads` with nothing running): anything
                # under one block goes as a single put instead.
                head = _read_full(pipe, _AZ_BLOCK_BYTES)
                if len(head) < _AZ_BLOCK_BYTES:
                    blob.upload_blob(head, overwrite=True)
                else:
                    blob.upload_blob(_Chained(head, pipe), overwrite=True, max_concurrency=STREAM_CONCURRENCY)
            except StreamAborted:
                raise
            except Exception as error:
                if isinstance(error.__context__, StreamAborted):
                    raise error.__context__ from None
                raise self._error(error, "upload to", key) from None

        return StreamUpload(self.uri, key, send, source)


class _Chained(io.RawIOBase):
    """`head`, then the rest of `reader`."""

    def __init__(self, head: bytes, reader) -> None:
        super().__init__()
        self._head, self._reader = memoryview(head), reader

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if len(self._head):
            n = min(len(buffer), len(self._head))
            memoryview(buffer).cast("B")[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._reader.readinto(buffer)


def _az_code(error: BaseException) -> str | None:
    """The storage error code (`BlobNotFound`, `ContainerNotFound`, ...), from the body or `x-ms-error-code`."""
    code = getattr(error, "error_code", None)
    return None if code is None else str(getattr(code, "value", code))


def _az_blob_missing(error: BaseException) -> bool:
    """A 404 for the blob itself, not for its container."""
    from azure.core.exceptions import ResourceNotFoundError

    return isinstance(error, ResourceNotFoundError) and _az_code(error) != "ContainerNotFound"


def _redact(text: str) -> str:
    """One line, with SAS signatures and account keys masked (SDK messages can quote request URLs)."""
    text = re.sub(r"(?i)\b(sig|accountkey|sharedaccesssignature)=[^&;\s'\"]+", r"\1=***", text)
    return text.strip().splitlines()[0] if text.strip() else ""


def _azure_error(error: BaseException, what: str, endpoint: str) -> StoreError:
    from azure.core import exceptions as aze

    if isinstance(error, aze.ClientAuthenticationError) and getattr(error, "status_code", None) is None:
        # Raised on this side, before any request reached the store.
        if type(error).__name__ == "AzureSigningError":
            return StoreError(f"cannot {what}: the account key cannot sign requests (not base64?); check "
                              "AZURE_STORAGE_KEY or the AccountKey in AZURE_STORAGE_CONNECTION_STRING")
        if type(error).__name__ == "CredentialUnavailableError":
            return StoreError(f"cannot {what}: no Azure credentials found; {_AZ_CREDENTIALS_HINT}")
        return StoreError(f"cannot {what}: the Azure credential could not get a token "
                          f"({type(error).__name__}); check it or run `az login` again")
    if isinstance(error, (aze.ServiceRequestError, aze.ServiceResponseError)):
        return TransientStoreError(f"cannot {what}: endpoint {endpoint} unreachable ({type(error).__name__})")
    if isinstance(error, aze.HttpResponseError):
        status, code = error.status_code, _az_code(error)
        answer = code or f"HTTP {status}"
        if code in _AZ_TRANSIENT_CODES or (status is not None and (status in (408, 429) or status >= 500)):
            return TransientStoreError(f"cannot {what}: Azure answered {answer} (throttled or unavailable)")
        if code == "ContainerNotFound" or (status == 404 and code is None):
            return StoreError(f"cannot {what}: the container does not exist; create it or fix the store URI")
        if status in (401, 403):
            return StoreError(f"cannot {what}: access denied ({answer}); check the Azure credentials and "
                              "their access to the container")
        return StoreError(f"cannot {what}: Azure answered {answer}")
    return StoreError(f"cannot {what}: {type(error).__name__}: {_redact(str(error))}")
