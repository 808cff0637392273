"""The Store interface every backend implements, and retrying what is worth retrying.

Keys are `/`-separated names relative to the store's root. `TransientStoreError` marks the
failures worth retrying (unreachable endpoint, throttling, 5xx), which `with_retries` does
with backoff and jitter.

Conditional writes (`get_versioned` / `put_if`) are a compare-and-swap on one object, checked by
the server itself (S3 If-Match / If-None-Match, GCS ifGenerationMatch, Azure If-Match /
If-None-Match, a lock file for a local directory); `PreconditionFailed` says another writer got
there first. The version token is opaque: compare it for equality, never parse it. On S3 it is the
ETag, the MD5 of the bytes, so writing the same bytes again keeps the token (GCS, Azure and the
local store give every write a new one): a protocol that must tell such rewrites apart keeps a
counter in the bytes. The SDKs retry a write whose answer was lost, so `PreconditionFailed` can
follow our own write having landed: a caller that must know reads the object back and compares.
"""

from __future__ import annotations

import os
import random
import time
from typing import TYPE_CHECKING, Callable, Iterable, Protocol, TypeVar, runtime_checkable

from skyspot.errors import StoreError

if TYPE_CHECKING:
    from skyspot.storage.stream import StreamUpload

T = TypeVar("T")

# One parallel transfer per file; each S3 file is itself split into parallel parts.
DEFAULT_WORKERS = 8


class TransientStoreError(StoreError):
    """The store could not be reached or asked us to slow down; the same call may work later."""


class PreconditionFailed(StoreError):
    """A conditional write found the object not as the caller last saw it (created, changed or deleted since)."""


@runtime_checkable
class Store(Protocol):
    """What the trainer and the ledger need from a store. Keys are relative to `uri`."""

    uri: str

    def put_file(self, local_path: str | os.PathLike, key: str) -> None: ...

    def put_bytes(self, key: str, data: bytes) -> None: ...

    def get_file(self, key: str, local_path: str | os.PathLike) -> None:
        """Download to `local_path` (written whole or not at all); FileNotFoundError if the key is missing."""

    def get_bytes(self, key: str, limit: int | None = None) -> bytes | None:
        """The object's bytes, or None when it does not exist. With `limit`: at most its first `limit` + 1
        bytes, by a ranged read (a caller with a cap sees it passed without downloading the rest)."""

    def get_versioned(self, key: str) -> tuple[bytes | None, str | None]:
        """The object's bytes and an opaque version token (None, None when it does not exist)."""

    def put_if(self, key: str, data: bytes, version: str | None) -> str:
        """Write `data` only if the object is still at `version` (None: only if it does not exist yet);
        returns the new version token; raises PreconditionFailed otherwise. Atomic on the server."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str = "") -> list[str]:
        """Every key starting with `prefix` (recursive), sorted."""

    def delete(self, keys: Iterable[str]) -> None:
        """Delete keys; missing keys are not an error."""

    def upload_dir(
        self, local_dir: str | os.PathLike, prefix: str, files: list[str], max_workers: int = DEFAULT_WORKERS
    ) -> None:
        """Upload `local_dir/F` to `prefix/F` for each relative path F, in parallel."""

    def download_files(
        self, prefix: str, files: list[str], local_dir: str | os.PathLike, max_workers: int = DEFAULT_WORKERS
    ) -> None:
        """Download `prefix/F` to `local_dir/F` for each F, in parallel.

        A missing key raises FileNotFoundError whose `filename` is `<uri>/<key>`."""

    def open_stream(self, key: str, source: str | os.PathLike | None = None) -> "StreamUpload":
        """Start uploading `key` from bytes written to the returned stream as they are produced, many
        parts in parallel; the object appears whole at `finish`, or never (`abort`). `source` is
        the local file the producer writes the same bytes to first, read back after `release`."""


def backoff_delay(attempt: int, base_delay: float, max_delay: float) -> float:
    """Exponential backoff with "equal jitter": half the capped delay fixed, half random.

    Jitter spreads out many nodes retrying the same bucket after an outage; keeping half
    fixed means a retry never comes back immediately
    (https://aws.amazon.com/blogs/architecture/exponential-backoff-and-jitter/).
    """
    capped = min(max_delay, base_delay * 2 ** (attempt - 1))
    return capped / 2 + random.uniform(0, capped / 2)


def with_retries(
    fn: Callable[[], T],
    *,
    attempts: int | None = 5,
    base_delay: float = 0.5,
    max_delay: float = 30.0,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
    retry_on: tuple[type[BaseException], ...] = (TransientStoreError,),
    sleep: Callable[[float], None] = time.sleep,
) -> T:
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
