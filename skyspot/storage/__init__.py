"""Where a run's durable state lives: a tiny storage protocol over string URIs.

A run root is `s3://BUCKET/PREFIX`, `gs://BUCKET/PREFIX`, `az://ACCOUNT/CONTAINER/PREFIX`
or a local directory (which may be a SkyPilot bucket mount). `gs://…` is not a `Path`, so
everything above this module speaks in *keys*: `/`-separated names relative to the
store's root, e.g. `run-1/checkpoints/step_100/COMMITTED`.

    store = open_store("s3://my-bucket/runs")
    store.put_bytes("run-1/run.json", b"{}")
    store.list("run-1/checkpoints/")   # -> ["run-1/checkpoints/step_100/COMMITTED", ...]

`parse_store_uri` runs at CLI start-up, so this package imports no cloud SDK at import
time: boto3, google-cloud-storage and azure-storage-blob are imported inside the
backends, on first use.

One module per concern: `uri` (locations, keys, mount sources), `store` (the interface,
retries), `transfer` (parallel transfers, atomic local writes), `stream` (streaming
uploads), and one per backend: `local`, `s3`, `gcs`, `azure`. This file only opens a
store by its URI and re-exports what the rest of skyspot imports.

Credentials come from each cloud's standard chain only (environment, shared config
files, instance or workload identity); endpoints can be redirected to emulators with
`AWS_ENDPOINT_URL`, `STORAGE_EMULATOR_HOST` and an `AZURE_STORAGE_CONNECTION_STRING`
whose `BlobEndpoint` names the emulator. SDK failures become `StoreError`s with
one line that says what is wrong; `TransientStoreError` marks the ones worth retrying
(unreachable endpoint, throttling, 5xx), which `with_retries` does with backoff.
"""

from __future__ import annotations

import os

from skyspot.errors import StoreError
from skyspot.storage.azure import AzureStore
from skyspot.storage.gcs import GCSStore
from skyspot.storage.local import LocalStore
from skyspot.storage.s3 import S3Store
from skyspot.storage.s3 import _crt_transfer_manager as _crt_transfer_manager  # re-exported for bench/emergency.py
from skyspot.storage.store import (
    DEFAULT_WORKERS,
    PreconditionFailed,
    Store,
    TransientStoreError,
    backoff_delay,
    with_retries,
)
from skyspot.storage.stream import STREAM_CONCURRENCY, STREAM_PART_BYTES, StreamAborted, StreamUpload
from skyspot.storage.uri import (
    EXPECTED_FORMS,
    FORMS,
    StoreURI,
    canonical,
    is_bucket_uri,
    join_key,
    mount_source,
    parse_store_uri,
)

__all__ = [
    "AzureStore",
    "DEFAULT_WORKERS",
    "EXPECTED_FORMS",
    "FORMS",
    "GCSStore",
    "LocalStore",
    "PreconditionFailed",
    "S3Store",
    "STREAM_CONCURRENCY",
    "STREAM_PART_BYTES",
    "Store",
    "StoreError",
    "StoreURI",
    "StreamAborted",
    "StreamUpload",
    "TransientStoreError",
    "backoff_delay",
    "canonical",
    "is_bucket_uri",
    "join_key",
    "mount_source",
    "open_store",
    "parse_store_uri",
    "with_retries",
]


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
