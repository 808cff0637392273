"""The GCS backend: Google Cloud Storage through google-cloud-storage (imported on first use),
streams as parallel composite uploads."""

from __future__ import annotations

import errno
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from skyspot.errors import StoreError
from skyspot.storage.store import DEFAULT_WORKERS, PreconditionFailed, TransientStoreError
from skyspot.storage.stream import STREAM_CONCURRENCY, STREAM_PART_BYTES, Pipe, StreamAborted, StreamUpload, read_full
from skyspot.storage.transfer import replace_into, run_parallel, temp_sibling
from skyspot.storage.uri import check_key, join_key


class GCSStore:
    """A Google Cloud Storage bucket through google-cloud-storage.

    With `STORAGE_EMULATOR_HOST` set (fake-gcs-server in tests) the client talks to the
    emulator anonymously under a placeholder project; otherwise it uses Application
    Default Credentials (env key file, gcloud login, or the VM's service account).

    Bulk transfers use `transfer_manager.upload_many` / `download_many` with threads.
    Not `upload_chunks_concurrently`: it uses the XML multipart API, which
    fake-gcs-server does not implement (404), so big files go as one resumable upload.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        sdk_retry_seconds: float = 10.0,
        timeout: tuple[float, float] = (10.0, 120.0),
    ):
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
        return self._gcs().blob(join_key(self.prefix, check_key(key)))

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
            replace_into(
                lambda temp: blob.download_to_filename(os.fspath(temp), retry=self._retry, timeout=self._timeout),
                target,
                durable=False,
            )
        except Exception as error:
            if _is_not_found(error):
                raise FileNotFoundError(errno.ENOENT, "not found in store", f"{self.uri}/{key}") from None
            raise self._error(error, "download", key) from None

    def get_bytes(self, key, limit=None):
        blob = self._blob(key)
        try:  # `end` is inclusive: limit + 1 bytes
            return blob.download_as_bytes(
                retry=self._retry, timeout=self._timeout, start=0 if limit is not None else None, end=limit
            )
        except Exception as error:
            if _is_not_found(error):
                return None
            if limit is not None and getattr(getattr(error, "response", None), "status_code", None) == 416:
                return b""  # a range of an empty object
            raise self._error(error, "read", key) from None

    def get_versioned(self, key):
        """The generation first, then the bytes of that generation only (ifGenerationMatch on the
        download), so a write in between cannot pair new bytes with the old generation: then read again."""
        bucket = self._gcs()
        name = join_key(self.prefix, check_key(key))
        for _ in range(_GCS_READ_ATTEMPTS):
            try:
                blob = bucket.get_blob(name, retry=self._retry, timeout=self._timeout)
                if blob is None:
                    return None, None
                data = blob.download_as_bytes(
                    if_generation_match=blob.generation, retry=self._retry, timeout=self._timeout
                )
                return data, str(blob.generation)
            except Exception as error:
                if _is_not_found(error) or _is_precondition_failed(error):
                    continue  # replaced or deleted between the two requests
                raise self._error(error, "read", key) from None
        raise TransientStoreError(f"cannot read {self.uri}/{key}: it changed on every read")

    def put_if(self, key, data, version):
        """An upload with ifGenerationMatch (0: only if no live object exists), which GCS checks
        itself and answers 412 when it fails (https://cloud.google.com/storage/docs/request-preconditions).
        The generation is a new number on every write, so the same bytes again are a new version."""
        blob = self._blob(key)
        try:
            generation = 0 if version is None else int(version)
        except ValueError:
            raise PreconditionFailed(f"cannot write {self.uri}/{key}: {version!r} is not a GCS generation") from None
        try:
            blob.upload_from_string(data, if_generation_match=generation, retry=self._retry, timeout=self._timeout)
        except Exception as error:
            if _is_precondition_failed(error):
                raise PreconditionFailed(f"cannot write {self.uri}/{key}: GCS answered HTTP 412") from None
            raise self._error(error, "write", key) from None
        return str(blob.generation)

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
            names = [
                b.name[len(root) :]
                for b in bucket.client.list_blobs(
                    bucket, prefix=root + prefix, retry=self._retry, timeout=self._timeout
                )
            ]
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

        run_parallel(delete_one, list(keys), DEFAULT_WORKERS)

    def upload_dir(self, local_dir, prefix, files, max_workers=DEFAULT_WORKERS):
        from google.cloud.storage import transfer_manager

        files = list(files)
        pairs = [(os.fspath(Path(local_dir) / rel), self._blob(join_key(prefix, rel))) for rel in files]
        results = transfer_manager.upload_many(
            pairs,
            worker_type=transfer_manager.THREAD,
            max_workers=max_workers,
            upload_kwargs={"retry": self._retry, "timeout": self._timeout},
        )
        for rel, result in zip(files, results):
            if isinstance(result, FileNotFoundError):
                raise result
            if isinstance(result, BaseException):
                raise self._error(result, "upload to", join_key(prefix, rel))

    def download_files(self, prefix, files, local_dir, max_workers=DEFAULT_WORKERS):
        from google.cloud.storage import transfer_manager

        files = list(files)
        targets = [Path(local_dir) / rel for rel in files]
        temps = [temp_sibling(t) for t in targets]
        for target in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
        pairs = [(self._blob(join_key(prefix, rel)), os.fspath(temp)) for rel, temp in zip(files, temps)]
        try:
            results = transfer_manager.download_many(
                pairs,
                worker_type=transfer_manager.THREAD,
                max_workers=max_workers,
                download_kwargs={"retry": self._retry, "timeout": self._timeout},
            )
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
        name = join_key(self.prefix, check_key(key))
        parts_prefix = f"{name}.parts-{uuid.uuid4().hex[:8]}/"

        def upload_part(index: int, data: bytes) -> None:
            blob = bucket.blob(f"{parts_prefix}{index:05d}")
            blob.upload_from_string(data, retry=self._retry, timeout=self._timeout, checksum="crc32c")

        def send(pipe: Pipe) -> None:
            count = 0
            try:
                # At most twice the concurrency of parts in memory: reading waits for a slot.
                window = threading.Semaphore(STREAM_CONCURRENCY * 2)
                with ThreadPoolExecutor(max_workers=STREAM_CONCURRENCY, thread_name_prefix="skyspot-gcs-part") as pool:
                    futures = []
                    while True:
                        window.acquire()
                        data = read_full(pipe, STREAM_PART_BYTES)
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
                _delete_quietly(
                    [bucket.blob(f"{parts_prefix}{i:05d}") for i in range(count)], self._retry, self._timeout
                )

        return StreamUpload(self.uri, key, send, source)


# GCS composes at most 32 sources per request (https://cloud.google.com/storage/docs/composite-objects).
_GCS_COMPOSE_MAX = 32


def _compose(bucket, target, parts: list, retry, timeout) -> None:
    """Compose `parts` into `target`, in rounds of 32 through intermediate objects when there are more."""
    level = 0
    while len(parts) > _GCS_COMPOSE_MAX:
        merged = []
        for i in range(0, len(parts), _GCS_COMPOSE_MAX):
            blob = bucket.blob(f"{parts[0].name}.c{level}-{i // _GCS_COMPOSE_MAX:05d}")
            blob.compose(parts[i : i + _GCS_COMPOSE_MAX], retry=retry, timeout=timeout)
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


# A read whose object keeps changing between its generation and its bytes gives up after this many tries.
_GCS_READ_ATTEMPTS = 5


def _is_precondition_failed(error: BaseException) -> bool:
    from google.api_core.exceptions import PreconditionFailed as GooglePreconditionFailed

    return (
        isinstance(error, GooglePreconditionFailed)
        or getattr(getattr(error, "response", None), "status_code", None) == 412
    )


def _is_not_found(error: BaseException) -> bool:
    from google.api_core.exceptions import NotFound

    return isinstance(error, NotFound) or getattr(getattr(error, "response", None), "status_code", None) == 404


def _gcs_error(error: BaseException, what: str) -> StoreError:
    import requests
    from google.api_core import exceptions as gexc
    from google.auth import exceptions as auth_exc

    endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or "storage.googleapis.com"
    if isinstance(error, auth_exc.DefaultCredentialsError):
        return StoreError(
            f"cannot {what}: no Google Cloud credentials found; run `gcloud auth "
            "application-default login` or set GOOGLE_APPLICATION_CREDENTIALS"
        )
    if isinstance(error, gexc.RetryError) and error.cause is not None:
        error = error.cause
    if isinstance(error, (requests.ConnectionError, requests.Timeout, ConnectionError, auth_exc.TransportError)):
        return TransientStoreError(f"cannot {what}: endpoint {endpoint} unreachable ({type(error).__name__})")
    status = getattr(error, "code", None)
    if status is None:
        status = getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(status, int):
        if status in (408, 429) or status >= 500:
            return TransientStoreError(f"cannot {what}: GCS answered HTTP {status} (throttled or unavailable)")
        if status in (401, 403):
            return StoreError(
                f"cannot {what}: access denied (HTTP {status}); check the Google credentials and the bucket's IAM"
            )
        if status == 404:
            return StoreError(f"cannot {what}: the bucket does not exist; create it or fix the store URI")
        return StoreError(f"cannot {what}: GCS answered HTTP {status}")
    if isinstance(error, auth_exc.RefreshError):
        return StoreError(f"cannot {what}: Google credentials could not be refreshed; log in again")
    return StoreError(f"cannot {what}: {type(error).__name__}: {error}")
