"""The S3 backend: Amazon S3 and S3-compatible stores through boto3 (imported on first use),
streams through the AWS Common Runtime's S3 client when awscrt is installed."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

from skyspot.errors import StoreError
from skyspot.storage.store import DEFAULT_WORKERS, PreconditionFailed, TransientStoreError
from skyspot.storage.stream import STREAM_CONCURRENCY, STREAM_PART_BYTES, Pipe, StreamAborted, StreamUpload
from skyspot.storage.transfer import get_each, put_each
from skyspot.storage.uri import check_key, join_key


# S3 caps a DeleteObjects request at 1,000 keys (DeleteObjects API reference).
_S3_DELETE_BATCH = 1000
# AWS suggests 8-16 MB parts for throughput; s3transfer raises the part size by itself
# for files that would exceed S3's 10,000-part limit.
_S3_PART_BYTES = 16 * 1024 * 1024
_S3_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
}


# What a conditional PutObject answers when its condition fails (conditional-writes.html above put_if).
_S3_PRECONDITION_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}


class S3Store:
    """An S3 (or S3-compatible) bucket through boto3.

    boto3 (>= 1.28) honours `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3` itself, which is
    how tests and S3-compatible stores redirect it. Large files go through
    `client.upload_file`, i.e. multipart with parallel parts.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        sdk_attempts: int = 3,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
    ):
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
                config = Config(
                    retries={"max_attempts": attempts, "mode": "standard"},
                    connect_timeout=connect_timeout,
                    read_timeout=read_timeout,
                    max_pool_connections=64,
                )
                try:
                    self._client = boto3.session.Session().client("s3", config=config)
                except Exception as error:  # e.g. a malformed AWS config file or endpoint
                    raise StoreError(f"cannot set up an S3 client for {self.uri}: {error}") from None
                self._transfer_config = TransferConfig(
                    multipart_threshold=_S3_PART_BYTES, multipart_chunksize=_S3_PART_BYTES, max_concurrency=4
                )
            return self._client

    def _key(self, key: str) -> str:
        return join_key(self.prefix, check_key(key))

    def _error(self, error: BaseException, action: str, key: str = "") -> StoreError:
        return _s3_error(error, f"{action} {self.uri}/{key}".rstrip("/"), self._client)

    def put_file(self, local_path, key):
        client = self._s3()
        try:
            client.upload_file(os.fspath(local_path), self.bucket, self._key(key), Config=self._transfer_config)
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
            client.download_file(self.bucket, self._key(key), os.fspath(local_path), Config=self._transfer_config)
        except Exception as error:
            if _s3_code(error) in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(errno.ENOENT, "not found in store", f"{self.uri}/{key}") from None
            raise self._error(error, "download", key) from None

    def get_bytes(self, key, limit=None):
        client = self._s3()
        ranged = {} if limit is None else {"Range": f"bytes=0-{limit}"}  # inclusive: limit + 1 bytes
        try:
            return client.get_object(Bucket=self.bucket, Key=self._key(key), **ranged)["Body"].read()
        except Exception as error:
            if _s3_code(error) in ("404", "NoSuchKey"):
                return None
            if ranged and _s3_code(error) in ("416", "InvalidRange"):  # a range of an empty object
                return b""
            raise self._error(error, "read", key) from None

    def get_versioned(self, key):
        client = self._s3()
        try:
            response = client.get_object(Bucket=self.bucket, Key=self._key(key))
            return response["Body"].read(), response["ETag"]
        except Exception as error:
            if _s3_code(error) in ("404", "NoSuchKey"):
                return None, None
            raise self._error(error, "read", key) from None

    def put_if(self, key, data, version):
        """PutObject with If-None-Match: * (create only) or If-Match: ETag, which S3 checks itself:
        412 when the object is not as given, 409 when a concurrent conditional write to the same key
        won, 404 when If-Match names a deleted object
        (https://docs.aws.amazon.com/AmazonS3/latest/userguide/conditional-writes.html)."""
        client = self._s3()
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        try:
            return client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **condition)["ETag"]
        except Exception as error:
            if _s3_precondition_failed(error, version):
                raise PreconditionFailed(f"cannot write {self.uri}/{key}: S3 answered {_s3_code(error)}") from None
            raise self._error(error, "write", key) from None

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
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=root + prefix):
                keys.extend(item["Key"][len(root) :] for item in page.get("Contents", ()))
        except Exception as error:
            raise self._error(error, "list", prefix) from None
        return sorted(keys)

    def delete(self, keys):
        client = self._s3()
        keys = [self._key(k) for k in keys]
        for start in range(0, len(keys), _S3_DELETE_BATCH):
            batch = keys[start : start + _S3_DELETE_BATCH]
            try:
                response = client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
            except Exception as error:
                raise self._error(error, "delete from") from None
            failed = response.get("Errors") or []
            if failed:
                first = failed[0]
                raise StoreError(
                    f"cannot delete s3://{self.bucket}/{first.get('Key')}: "
                    f"{first.get('Code')} ({len(failed)} keys failed)"
                )

    def upload_dir(self, local_dir, prefix, files, max_workers=DEFAULT_WORKERS):
        self._s3()
        put_each(self, local_dir, prefix, files, max_workers)

    def download_files(self, prefix, files, local_dir, max_workers=DEFAULT_WORKERS):
        self._s3()
        get_each(self, prefix, files, local_dir, max_workers)

    def open_stream(self, key, source=None):
        manager = self._streams()
        future: list = []

        def send(pipe: Pipe) -> None:
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
                            raise StoreError(
                                "SKYSPOT_S3_CLIENT=crt, but awscrt is not installed (pip install awscrt)"
                            ) from None
                if manager is None:
                    from boto3.s3.transfer import TransferConfig, create_transfer_manager

                    manager = create_transfer_manager(
                        client,
                        TransferConfig(
                            multipart_threshold=STREAM_PART_BYTES,
                            multipart_chunksize=STREAM_PART_BYTES,
                            max_concurrency=STREAM_CONCURRENCY,
                            preferred_transfer_client="classic",
                        ),
                    )
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
    from s3transfer.crt import (
        BotocoreCRTCredentialsWrapper,
        BotocoreCRTRequestSerializer,
        CRTTransferManager,
        create_s3_crt_client,
    )

    endpoint = client.meta.endpoint_url or ""
    region = client.meta.region_name or "us-east-1"
    custom = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    credentials = client._get_credentials()  # botocore's refreshing credentials (instance role etc.)
    provider = BotocoreCRTCredentialsWrapper(credentials).to_crt_credentials_provider() if credentials else None
    threads = max(2, (os.cpu_count() or 2) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))
    crt = create_s3_crt_client(
        region=region,
        crt_credentials_provider=provider,
        num_threads=threads,
        part_size=STREAM_PART_BYTES,
        use_ssl=not endpoint.startswith("http://"),
    )
    serializer = BotocoreCRTRequestSerializer(
        botocore.session.Session(), {"region_name": region, "endpoint_url": custom}
    )
    return CRTTransferManager(crt, serializer)


def _s3_code(error: BaseException) -> str | None:
    """The S3 error code of a ClientError, also when boto3 wrapped it (S3UploadFailedError)."""
    from botocore.exceptions import ClientError

    for candidate in (error, error.__cause__, error.__context__):
        if isinstance(candidate, ClientError):
            return str(candidate.response.get("Error", {}).get("Code"))
    return None


def _s3_precondition_failed(error: BaseException, version: str | None) -> bool:
    """A conditional PutObject's answer that the object was not as given: 412, a concurrent conditional
    write's 409, or (with If-Match) the object gone."""
    code = _s3_code(error)
    return code in _S3_PRECONDITION_CODES or (version is not None and code in ("404", "NoSuchKey"))


def _s3_error(error: BaseException, what: str, client) -> StoreError:
    from botocore import exceptions as bce

    endpoint = getattr(getattr(client, "meta", None), "endpoint_url", None) or "S3"
    cause = error
    if type(error).__name__ == "S3UploadFailedError" and error.__context__ is not None:
        cause = error.__context__  # boto3 re-raises upload errors as this, losing the type
    if isinstance(cause, (bce.NoCredentialsError, bce.PartialCredentialsError)):
        return StoreError(
            f"cannot {what}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run with an instance role"
        )
    if isinstance(
        cause,
        (
            bce.EndpointConnectionError,
            bce.ConnectTimeoutError,
            bce.ReadTimeoutError,
            bce.ConnectionClosedError,
            bce.ConnectionError,
        ),
    ):
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
            return StoreError(f"cannot {what}: access denied ({code}); check the AWS credentials and the bucket policy")
        return StoreError(f"cannot {what}: S3 answered {code}")
    return StoreError(f"cannot {what}: {type(cause).__name__}: {cause}")
