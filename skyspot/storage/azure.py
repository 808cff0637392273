"""The Azure backend: Azure Blob Storage through azure-storage-blob (imported on first use),
with azure-identity's credential chain when it is installed."""

from __future__ import annotations

import errno
import io
import os
import re
import threading
from pathlib import Path

from skyspot.errors import StoreError
from skyspot.storage.store import DEFAULT_WORKERS, PreconditionFailed, TransientStoreError
from skyspot.storage.stream import STREAM_CONCURRENCY, Pipe, StreamAborted, StreamUpload, read_full
from skyspot.storage.transfer import get_each, put_each, replace_into, run_parallel
from skyspot.storage.uri import StoreURI, check_key, join_key


# Files over this size go up as parallel blocks of this size and come down as parallel
# ranges (the SDK's own chunking, max_concurrency per file); like S3's parts. A block blob
# holds up to 50,000 blocks, so 16 MiB blocks allow 780 GiB per file.
_AZ_BLOCK_BYTES = 16 * 1024 * 1024
_AZ_CHUNK_CONCURRENCY = 4
_AZ_TRANSIENT_CODES = {"ServerBusy", "OperationTimedOut", "InternalError"}
_AZ_CREDENTIALS_HINT = (
    "set AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN, "
    "or install azure-identity and run `az login` or use a managed identity"
)


class AzureStore:
    """An Azure Blob Storage container through azure-storage-blob.

    Credentials, the first one set wins: `AZURE_STORAGE_CONNECTION_STRING` (its
    `BlobEndpoint` also redirects the client, which is how tests reach Azurite), then
    `AZURE_STORAGE_KEY` or `AZURE_STORAGE_SAS_TOKEN` for the URI's account, then
    azure-identity's `DefaultAzureCredential` (service principal variables, managed
    identity, `az login`) when that package is installed.
    """

    def __init__(
        self,
        account: str,
        container: str,
        prefix: str = "",
        *,
        sdk_attempts: int = 3,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
    ):
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
        adapter = HTTPAdapter(pool_maxsize=64, max_retries=Retry(total=False, redirect=False, raise_on_status=False))
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        options = dict(
            transport=RequestsTransport(
                session=session,
                connection_timeout=connect_timeout,
                read_timeout=read_timeout,
                connection_data_block_size=256 * 1024,
            ),
            # The SDK retries briefly (its default waits 15 s, then more); long outages are the
            # caller's with_retries' job, so a dead endpoint surfaces within seconds.
            retry_policy=ExponentialRetry(
                initial_backoff=1, increment_base=2, retry_total=max(0, attempts - 1), random_jitter_range=1
            ),
            max_single_put_size=_AZ_BLOCK_BYTES,
            max_block_size=_AZ_BLOCK_BYTES,
            max_single_get_size=_AZ_BLOCK_BYTES,
            max_chunk_get_size=_AZ_BLOCK_BYTES,
        )
        env = os.environ
        connection_string = env.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
        if connection_string:
            fields = {
                k.strip().lower(): v.strip()
                for k, _, v in (part.partition("=") for part in connection_string.split(";"))
                if v
            }
            named = fields.get("accountname", "").lower()
            if named and named != self.account:
                raise StoreError(
                    f"cannot {what}: AZURE_STORAGE_CONNECTION_STRING is for storage account "
                    f"{named!r}, not {self.account!r}"
                )
            try:
                service = BlobServiceClient.from_connection_string(connection_string, **options)
            except ValueError:  # never quote it: it holds the key
                raise StoreError(f"cannot {what}: AZURE_STORAGE_CONNECTION_STRING is malformed") from None
        else:
            key = env.get("AZURE_STORAGE_KEY", "").strip()
            sas = env.get("AZURE_STORAGE_SAS_TOKEN", "").strip().lstrip("?")
            named = env.get("AZURE_STORAGE_ACCOUNT", "").strip().lower()
            if (key or sas) and named and named != self.account:
                raise StoreError(
                    f"cannot {what}: AZURE_STORAGE_KEY / AZURE_STORAGE_SAS_TOKEN are for "
                    f"AZURE_STORAGE_ACCOUNT {named!r}, not {self.account!r}"
                )
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
        return self._az().get_blob_client(join_key(self.prefix, check_key(key)))

    def _error(self, error: BaseException, action: str, key: str = "") -> StoreError:
        return _azure_error(error, f"{action} {self.uri}/{key}".rstrip("/"), self._endpoint)

    def _missing(self, key: str) -> FileNotFoundError:
        return FileNotFoundError(errno.ENOENT, "not found in store", f"{self.uri}/{key}")

    def put_file(self, local_path, key):
        blob = self._blob(key)
        with open(local_path, "rb") as f:
            try:
                blob.upload_blob(
                    f, length=os.fstat(f.fileno()).st_size, overwrite=True, max_concurrency=_AZ_CHUNK_CONCURRENCY
                )
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
            replace_into(download, Path(local_path), durable=False)
        except Exception as error:
            if _az_blob_missing(error):
                raise self._missing(key) from None
            raise self._error(error, "download", key) from None

    def get_bytes(self, key, limit=None):
        blob = self._blob(key)
        ranged = {} if limit is None else {"offset": 0, "length": limit + 1}
        try:
            return blob.download_blob(max_concurrency=_AZ_CHUNK_CONCURRENCY, **ranged).readall()
        except Exception as error:
            if _az_blob_missing(error):
                return None
            if ranged and _az_code(error) == "InvalidRange":  # a range of an empty blob
                return b""
            raise self._error(error, "read", key) from None

    def get_versioned(self, key):
        blob = self._blob(key)
        try:
            # The SDK asks for any later chunk If-Match the first one's ETag, so bytes and ETag agree.
            stream = blob.download_blob(max_concurrency=_AZ_CHUNK_CONCURRENCY)
            return stream.readall(), str(stream.properties.etag)
        except Exception as error:
            if _az_blob_missing(error):
                return None, None
            raise self._error(error, "read", key) from None

    def put_if(self, key, data, version):
        """Put Blob with If-Match: ETag, or If-None-Match: * for create only (overwrite=False), which
        the service checks itself: 412 ConditionNotMet, or 409 BlobAlreadyExists for a create
        (https://learn.microsoft.com/en-us/rest/api/storageservices/specifying-conditional-headers-for-blob-service-operations).
        Every write gets a new ETag, so the same bytes again are a new version."""
        from azure.core import MatchConditions

        blob = self._blob(key)
        condition = (
            {"overwrite": False}
            if version is None
            else {"overwrite": True, "etag": version, "match_condition": MatchConditions.IfNotModified}
        )
        try:
            return str(blob.upload_blob(data, **condition)["etag"])
        except Exception as error:
            code = _az_code(error)
            if (
                code in ("ConditionNotMet", "BlobAlreadyExists")
                or getattr(error, "status_code", None) == 412
                or (version is not None and _az_blob_missing(error))
            ):
                raise PreconditionFailed(
                    f"cannot write {self.uri}/{key}: Azure answered {code or 'HTTP 412'}"
                ) from None
            raise self._error(error, "write", key) from None

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
            names = [name[len(root) :] for name in container.list_blob_names(name_starts_with=(root + prefix) or None)]
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
        run_parallel(delete_one, list(keys), DEFAULT_WORKERS)

    def upload_dir(self, local_dir, prefix, files, max_workers=DEFAULT_WORKERS):
        self._az()
        put_each(self, local_dir, prefix, files, max_workers)

    def download_files(self, prefix, files, local_dir, max_workers=DEFAULT_WORKERS):
        self._az()
        get_each(self, prefix, files, local_dir, max_workers)

    def open_stream(self, key, source=None):
        """The SDK's own chunked upload of a stream of unknown length: blocks of _AZ_BLOCK_BYTES
        staged STREAM_CONCURRENCY at a time, committed as one block list at the end (an aborted
        stream commits nothing; staged blocks expire)."""
        blob = self._blob(key)

        def send(pipe: Pipe) -> None:
            try:
                # The SDK's chunked path spins forever on a stream that turns out empty
                # (azure-storage-blob 12.31 `_parallel_uploads` with nothing running): anything
                # under one block goes as a single put instead.
                head = read_full(pipe, _AZ_BLOCK_BYTES)
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
            return StoreError(
                f"cannot {what}: the account key cannot sign requests (not base64?); check "
                "AZURE_STORAGE_KEY or the AccountKey in AZURE_STORAGE_CONNECTION_STRING"
            )
        if type(error).__name__ == "CredentialUnavailableError":
            return StoreError(f"cannot {what}: no Azure credentials found; {_AZ_CREDENTIALS_HINT}")
        return StoreError(
            f"cannot {what}: the Azure credential could not get a token "
            f"({type(error).__name__}); check it or run `az login` again"
        )
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
            return StoreError(
                f"cannot {what}: access denied ({answer}); check the Azure credentials and "
                "their access to the container"
            )
        return StoreError(f"cannot {what}: Azure answered {answer}")
    return StoreError(f"cannot {what}: {type(error).__name__}: {_redact(str(error))}")
