"""One behaviour suite over a directory, moto S3, fake-gcs-server and Azurite (skyspot.storage.local, s3, gcs,
azure), and each backend's failures in one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from skyspot.errors import StoreError
from skyspot.storage import (
    AzureStore,
    GCSStore,
    LocalStore,
    S3Store,
    TransientStoreError,
    open_store,
    parse_store_uri,
    with_retries,
)

from tests.storage.conftest import SERVERS


# --------------------------------------------------------------------------- one suite, three stores


def test_put_get_list_delete(store, tmp_path):
    store.put_bytes("r1/run.json", b'{"a": 1}')
    store.put_bytes("r1/events/e.jsonl", b"line\n")
    store.put_bytes("r2/run.json", b"{}")
    assert store.get_bytes("r1/run.json") == b'{"a": 1}'
    assert store.get_bytes("r1/nothing") is None
    assert store.exists("r1/run.json") and not store.exists("r1/nothing")
    assert store.list("r1/") == ["r1/events/e.jsonl", "r1/run.json"]
    assert store.list("r") == ["r1/events/e.jsonl", "r1/run.json", "r2/run.json"]
    assert store.list("zz/") == []

    local = tmp_path / "in.bin"
    local.write_bytes(b"x" * 1000)
    store.put_file(local, "r1/file.bin")
    store.get_file("r1/file.bin", tmp_path / "out" / "file.bin")
    assert (tmp_path / "out" / "file.bin").read_bytes() == b"x" * 1000
    with pytest.raises(FileNotFoundError, match="r1/missing.bin"):
        store.get_file("r1/missing.bin", tmp_path / "out" / "missing.bin")
    assert not (tmp_path / "out" / "missing.bin").exists()

    store.delete(["r1/run.json", "r1/never-existed"])
    assert store.list("r1/") == ["r1/events/e.jsonl", "r1/file.bin"]


def test_parallel_upload_and_download_of_a_directory(store, tmp_path):
    src = tmp_path / "src"
    files = {
        "big.bin": os.urandom(20 * 1024 * 1024),  # over 16 MiB: 2 S3 parts, 2 Azure blocks and ranges
        "sub/a.txt": b"a",
        "sub/b.txt": b"b" * 4097,
        "empty": b"",
    }
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    store.upload_dir(src, "ckpt", sorted(files), max_workers=4)
    assert store.list("ckpt/") == sorted(f"ckpt/{rel}" for rel in files)

    dst = tmp_path / "dst"
    store.download_files("ckpt", sorted(files), dst, max_workers=4)
    for rel, data in files.items():
        assert (dst / rel).read_bytes() == data
    assert sorted(p.name for p in dst.rglob("*.partial")) == []

    with pytest.raises(FileNotFoundError, match="ckpt/nope"):
        store.download_files("ckpt", ["sub/a.txt", "nope"], tmp_path / "dst2")


def test_local_store_never_shows_half_written_files(tmp_path):
    store = LocalStore(tmp_path)
    store.put_bytes("a/b/c.json", b"{}")
    (tmp_path / "a" / "b" / ".c.json.0123456789ab.partial").write_bytes(b"half")  # a writer killed mid-write
    assert store.list("") == ["a/b/c.json"]
    store.delete(["a/b/c.json"])
    assert not (tmp_path / "a" / "b" / "c.json").exists()
    with pytest.raises(ValueError, match="invalid store key"):
        store.put_bytes("../escape", b"x")


# --------------------------------------------------------------------------- failures, one line each


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def quick_store(uri: str):
    """The store at `uri` with the SDK's own retries off, so a test sees the first failure."""
    parsed = parse_store_uri(uri)
    if parsed.scheme == "s3":
        return S3Store(parsed.bucket, parsed.prefix, sdk_attempts=1)
    if parsed.scheme == "gs":
        return GCSStore(parsed.bucket, parsed.prefix, sdk_retry_seconds=0)
    return AzureStore(parsed.account, parsed.bucket, parsed.prefix, sdk_attempts=1)


@pytest.mark.parametrize("backend", ["s3", "gs", "az"])
def test_an_outage_is_transient_and_the_store_answers_again_with_its_objects(backend, request):
    server = request.getfixturevalue(SERVERS[backend])
    store = quick_store(server.bucket() + "/runs")
    store.put_bytes("r/run.json", b"{}")
    server.stop()
    try:
        with pytest.raises(TransientStoreError, match=r"unreachable \(\w+\)$") as caught:
            store.get_bytes("r/run.json")
        assert "\n" not in str(caught.value)
        retries = []
        with pytest.raises(TransientStoreError):
            with_retries(
                lambda: store.list("r/"),
                attempts=2,
                base_delay=0,
                max_delay=0,
                on_retry=lambda *a: retries.append(a),
                sleep=lambda d: None,
            )
        assert len(retries) == 1
    finally:
        server.start()
    assert with_retries(lambda: store.get_bytes("r/run.json"), attempts=5, base_delay=0.2) == b"{}"
    assert store.list("r/") == ["r/run.json"]


def test_s3_unreachable_endpoint_is_a_transient_store_error(s3_server, monkeypatch):
    url = _closed_port_url()
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)
    with pytest.raises(TransientStoreError) as caught:
        S3Store("ckpt", "runs", sdk_attempts=1).get_bytes("run.json")
    assert str(caught.value) == (
        f"cannot read s3://ckpt/runs/run.json: endpoint {url} unreachable (EndpointConnectionError)"
    )


def test_s3_missing_credentials_say_how_to_provide_them(s3_server, monkeypatch, tmp_path):
    for var in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreError) as caught:
        S3Store("ckpt", sdk_attempts=1).put_bytes("x", b"1")
    assert str(caught.value).startswith("cannot write s3://ckpt/x: no AWS credentials found; set AWS_ACCESS_KEY_ID")
    assert not isinstance(caught.value, TransientStoreError)


def test_s3_missing_bucket_is_named(s3_server):
    with pytest.raises(StoreError, match=r"s3://no-such-bucket-1/k: the bucket does not exist"):
        open_store("s3://no-such-bucket-1").put_bytes("k", b"1")


def test_gcs_unreachable_endpoint_is_a_transient_store_error(gcs_server, monkeypatch):
    url = _closed_port_url()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
    with pytest.raises(TransientStoreError) as caught:
        GCSStore("ckpt", "runs", sdk_retry_seconds=0).get_bytes("run.json")
    assert str(caught.value) == f"cannot read gs://ckpt/runs/run.json: endpoint {url} unreachable (ConnectionError)"


def test_gcs_missing_credentials_say_how_to_provide_them(tmp_path):
    # A fresh interpreter: google-auth reads its metadata-server variables once, at import, and
    # must never probe the real metadata address. NO_GCE_CHECK skips the probe; the addresses
    # point at a closed loopback port in case a version ignores it.
    closed = _closed_port_url().removeprefix("http://")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT")
    }
    env.update(
        CLOUDSDK_CONFIG=str(tmp_path),
        NO_GCE_CHECK="true",
        GCE_METADATA_HOST=closed,
        GCE_METADATA_IP=closed,
        HOME=str(tmp_path),
    )
    code = (
        "from skyspot.storage import GCSStore\n"
        "try:\n    GCSStore('ckpt', sdk_retry_seconds=0).get_bytes('x')\n"
        "except Exception as e:\n    print(type(e).__name__ + ': ' + str(e))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == (
        "StoreError: cannot connect to gs://ckpt: no Google Cloud credentials found; run "
        "`gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS"
    ), out.stderr


def test_gcs_missing_bucket_is_named(gcs_server):
    with pytest.raises(StoreError, match=r"gs://no-such-bucket-1/k: the bucket does not exist"):
        open_store("gs://no-such-bucket-1").put_bytes("k", b"1")


def test_a_runs_events_are_read_back_from_the_store_in_time_order(s3_server):
    """What `status` (cloud runs) and the interval planner (a fresh node) read: the synced event files."""
    import json

    from skyspot.events import read_events_store
    from skyspot.storage import open_store

    store = open_store(s3_server.bucket())
    step = {"step": 1, "loss": 2.5, "lr": 1e-3, "step_seconds": 0.1, "samples": 8, "tokens": 512}
    line = lambda ts, type, **f: json.dumps({"ts": ts, "run_id": "r", "attempt": 1, "type": type, **f})  # noqa: E731
    store.put_bytes(
        "r/events/attempt-1.node-0.rank-0.jsonl",
        (line(2.0, "step", **step) + "\n" + line(1.0, "start") + "\n").encode(),
    )
    store.put_bytes("r/events/attempt-1.executor.jsonl", (line(0.5, "attempt_start") + "\nnot json\n").encode())
    store.put_bytes("r/events-old/attempt-0.executor.jsonl", (line(0.1, "attempt_start") + "\n").encode())
    store.put_bytes("other/events/attempt-1.executor.jsonl", (line(0.2, "attempt_start") + "\n").encode())
    log = read_events_store(store, "r")
    assert [(e["ts"], e["type"]) for e in log.events] == [(0.5, "attempt_start"), (1.0, "start"), (2.0, "step")]
    assert log.malformed == 1
    assert read_events_store(store, "missing").events == []


def test_azure_unreachable_endpoint_is_a_transient_store_error(azure_server, monkeypatch):
    url = _closed_port_url() + "/devstoreaccount1"
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azure_server.connection_string.replace(azure_server.url, url))
    with pytest.raises(TransientStoreError) as caught:
        AzureStore("devstoreaccount1", "ckpt", "runs", sdk_attempts=1).get_bytes("run.json")
    assert str(caught.value) == (
        f"cannot read az://devstoreaccount1/ckpt/runs/run.json: endpoint {url} unreachable (ServiceRequestError)"
    )


def test_azure_missing_credentials_say_how_to_provide_them(monkeypatch):
    for var in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setitem(sys.modules, "azure.identity", None)  # as without azure-identity: never ask a metadata address
    with pytest.raises(StoreError) as caught:
        open_store("az://myaccount1/ckpt").put_bytes("x", b"1")
    assert str(caught.value) == (
        "cannot connect to az://myaccount1/ckpt: no Azure credentials found; set AZURE_STORAGE_CONNECTION_STRING, "
        "AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN, or install azure-identity and run `az login` or use a "
        "managed identity"
    )
    assert not isinstance(caught.value, TransientStoreError)


def test_azure_missing_container_is_named(azure_server):
    with pytest.raises(StoreError, match=r"az://devstoreaccount1/no-such-container-1/k: the container does not exist"):
        open_store("az://devstoreaccount1/no-such-container-1").put_bytes("k", b"1")
    with pytest.raises(StoreError, match=r"cannot list az://devstoreaccount1/no-such-container-1: the container"):
        open_store("az://devstoreaccount1/no-such-container-1").list()


def test_azure_wrong_key_is_access_denied_and_never_quoted(azure_server, monkeypatch):
    wrong = "d3Jvbmcta2V5LXdyb25nLWtleS13cm9uZy1rZXktd3Jvbmcta2V5LXdyb25nLWtleQ=="
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING", azure_server.connection_string.replace(azure_server.KEY, wrong)
    )
    uri = azure_server.container()
    with pytest.raises(StoreError) as caught:
        quick_store(uri).put_bytes("k", b"1")
    message = str(caught.value)
    assert message.startswith(f"cannot write {uri}/k: access denied (") and "check the Azure credentials" in message
    assert wrong not in message and "\n" not in message
    assert not isinstance(caught.value, TransientStoreError)


def test_azure_credentials_for_another_account_are_refused(azure_server, monkeypatch):
    with pytest.raises(StoreError) as caught:
        open_store("az://otheraccount/ckpt").list()
    assert str(caught.value) == (
        "cannot connect to az://otheraccount/ckpt: AZURE_STORAGE_CONNECTION_STRING is for "
        "storage account 'devstoreaccount1', not 'otheraccount'"
    )
    assert azure_server.KEY not in str(caught.value)
