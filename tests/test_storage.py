"""skyspot.storage: URI validation, then one behaviour suite over a directory, moto S3, fake-gcs-server and Azurite."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from skyspot.errors import StoreError, UsageError
from skyspot.storage import (AzureStore, GCSStore, LocalStore, S3Store, StoreURI, TransientStoreError, backoff_delay,
                             mount_source, open_store, parse_store_uri, with_retries)

FORMS = "s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, az://ACCOUNT/CONTAINER/PREFIX or a local path"
AZ_FORM = "az://ACCOUNT/CONTAINER/PREFIX"


# --------------------------------------------------------------------------- URIs


@pytest.mark.parametrize("uri, expected", [
    ("s3://my-bucket/runs/llama", StoreURI("s3", "my-bucket", "runs/llama")),
    ("s3://my.bucket-1", StoreURI("s3", "my.bucket-1", "")),
    ("S3://abc/x/", StoreURI("s3", "abc", "x")),
    ("gs://under_score/p", StoreURI("gs", "under_score", "p")),
    ("gs://" + ".".join(["a" * 60] * 3), StoreURI("gs", ".".join(["a" * 60] * 3), "")),
    ("az://myaccount1/container-1/runs", StoreURI("az", "container-1", "runs", "myaccount1")),
    ("az://abc/ckpt", StoreURI("az", "ckpt", "", "abc")),
    ("/abs/path", StoreURI("file", "", "/abs/path")),
    ("file:///abs/path", StoreURI("file", "", "/abs/path")),
])
def test_valid_uris_parse(uri, expected):
    assert parse_store_uri(uri) == expected


def test_relative_local_path_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_store_uri("runs") == StoreURI("file", "", str(tmp_path / "runs"))
    assert str(parse_store_uri("s3://abc/x")) == "s3://abc/x"


@pytest.mark.parametrize("uri", ["s3://abc/x/y", "gs://abc", "az://myaccount1/ckpt/runs/llama", "az://abc/ckpt",
                                 "/abs/path"])
def test_a_parsed_uri_prints_as_written(uri):
    assert str(parse_store_uri(uri)) == uri
    assert parse_store_uri(str(parse_store_uri(uri))) == parse_store_uri(uri)


@pytest.mark.parametrize("uri, message", [
    ("http://host/x", f"unsupported store scheme 'http://' in 'http://host/x'; expected {FORMS}"),
    ("ftp://a/b", f"unsupported store scheme 'ftp://' in 'ftp://a/b'; expected {FORMS}"),
    ("", f"empty store location; expected {FORMS}"),
    ("s3://", "store 's3://' has no bucket; expected s3://BUCKET/PREFIX"),
    ("s3://My_Bucket/x", "invalid S3 bucket name 'My_Bucket' in 's3://My_Bucket/x': may contain only "
                         "lowercase letters, digits, dots and hyphens; expected s3://BUCKET/PREFIX"),
    ("s3://ab", "invalid S3 bucket name 'ab' in 's3://ab': must be 3-63 characters long, not 2; "
                "expected s3://BUCKET/PREFIX"),
    ("s3://-abc", "invalid S3 bucket name '-abc' in 's3://-abc': must start and end with a letter or "
                  "digit; expected s3://BUCKET/PREFIX"),
    ("s3://a..b", "invalid S3 bucket name 'a..b' in 's3://a..b': must not contain two adjacent dots; "
                  "expected s3://BUCKET/PREFIX"),
    ("s3://10.0.0.1", "invalid S3 bucket name '10.0.0.1' in 's3://10.0.0.1': must not be an IP address; "
                      "expected s3://BUCKET/PREFIX"),
    ("s3://under_score", "invalid S3 bucket name 'under_score' in 's3://under_score': may contain only "
                         "lowercase letters, digits, dots and hyphens; expected s3://BUCKET/PREFIX"),
    ("gs://" + "a" * 64, f"invalid GCS bucket name '{'a' * 64}' in 'gs://{'a' * 64}': must be 3-63 "
                         "characters long (up to 222 with dots), not 64; expected gs://BUCKET/PREFIX"),
    ("gs://google-ckpt", "invalid GCS bucket name 'google-ckpt' in 'gs://google-ckpt': must not start "
                         "with 'goog' or contain 'google'; expected gs://BUCKET/PREFIX"),
    ("az://", f"store 'az://' has no storage account; expected {AZ_FORM}"),
    ("az://myaccount1", f"store 'az://myaccount1' has no container; expected {AZ_FORM}"),
    ("az://myaccount1/", f"store 'az://myaccount1/' has no container; expected {AZ_FORM}"),
    ("az://ab/ckpt", f"invalid Azure storage account name 'ab' in 'az://ab/ckpt': must be 3-24 characters long, "
                     f"not 2; expected {AZ_FORM}"),
    ("az://My_Account/ckpt", "invalid Azure storage account name 'My_Account' in 'az://My_Account/ckpt': may "
                             f"contain only lowercase letters and digits; expected {AZ_FORM}"),
    # the old az://CONTAINER/PREFIX form: a container name is rarely a valid account name
    ("az://container-1/runs", "invalid Azure storage account name 'container-1' in 'az://container-1/runs': may "
                              f"contain only lowercase letters and digits; expected {AZ_FORM}"),
    ("az://myaccount1/Container", "invalid Azure container name 'Container' in 'az://myaccount1/Container': may "
                                  f"contain only lowercase letters, digits and hyphens; expected {AZ_FORM}"),
    ("az://myaccount1/ckpt/a//b", f"store 'az://myaccount1/ckpt/a//b' has an empty, '.' or '..' path segment; "
                                  f"expected {AZ_FORM}"),
    ("s3://abc/a//b", "store 's3://abc/a//b' has an empty, '.' or '..' path segment; "
                      "expected s3://BUCKET/PREFIX"),
    ("gs://abc/../x", "store 'gs://abc/../x' has an empty, '.' or '..' path segment; "
                      "expected gs://BUCKET/PREFIX"),
    ("file://host/x", "store 'file://host/x' is not a local file URI; expected file:///ABSOLUTE/PATH"),
])
def test_bad_uris_say_what_is_wrong_and_what_is_expected(uri, message):
    with pytest.raises(UsageError) as caught:
        parse_store_uri(uri)
    assert str(caught.value) == message
    assert "\n" not in str(caught.value)


def test_parsing_imports_no_cloud_sdk():
    code = ("import sys, skyspot.storage as s; s.parse_store_uri('gs://abc/x'); s.open_store('s3://abc/x'); "
            "s.open_store('az://abc/ckpt/x'); s.mount_source('az://abc/ckpt/x'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore', 'google', 'azure')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- bucket mounts


@pytest.mark.parametrize("uri, source, name", [
    ("s3://my-ckpts/runs/llama", "s3://my-ckpts", "my-ckpts"),
    ("gs://my-ckpts", "gs://my-ckpts", "my-ckpts"),
    ("az://myaccount1/ckpts/runs", "https://myaccount1.blob.core.windows.net/ckpts", "ckpts"),
])
def test_mount_source_is_a_bucket_skypilot_mounts(uri, source, name):
    """What SkyPilot 0.14.1 does with a MOUNT file mount: the task loads offline, and the checks its
    server runs before creating the storage (Storage.construct) accept the source and name the bucket."""
    from sky import Task
    from sky.data import data_utils

    assert mount_source(uri) == source
    task = Task.from_yaml_config({"run": "true", "file_mounts": {"/skyspot/store": {"source": source, "mode": "MOUNT"}}})
    storage = task.storage_mounts["/skyspot/store"]
    storage._validate_storage_spec(storage.name)
    assert storage.name == name and storage.source == source
    if uri.startswith("az://"):
        # construct() picks the Azure store for a source that passes this check, and mounts this account
        assert data_utils.is_az_container_endpoint(source)
        assert data_utils.split_az_path(source) == ("myaccount1", "ckpts", "")


def test_skypilot_refuses_our_own_az_uri_as_a_mount_source():
    from sky import Task
    from sky.exceptions import StorageSourceError

    task = Task.from_yaml_config({"run": "true", "file_mounts": {
        "/skyspot/store": {"source": "az://myaccount1/ckpts", "mode": "MOUNT"}}})
    storage = task.storage_mounts["/skyspot/store"]
    with pytest.raises(StorageSourceError, match="Supported paths"):
        storage._validate_storage_spec(storage.name)
    with pytest.raises(ValueError, match="local path"):
        mount_source("/mnt/ckpts")


# --------------------------------------------------------------------------- retries


def test_with_retries_retries_transient_errors_then_succeeds():
    calls, retries, sleeps = [], [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise TransientStoreError("endpoint unreachable")
        return "ok"

    result = with_retries(flaky, attempts=5, base_delay=1.0, max_delay=1.5,
                          on_retry=lambda n, e, d: retries.append((n, str(e))), sleep=sleeps.append)
    assert result == "ok"
    assert retries == [(1, "endpoint unreachable"), (2, "endpoint unreachable")]
    assert 0.5 <= sleeps[0] <= 1.0 and 0.75 <= sleeps[1] <= 1.5  # equal jitter, capped at max_delay


def test_with_retries_gives_up_after_attempts_and_never_retries_permanent_errors():
    calls = []

    def down():
        calls.append(1)
        raise TransientStoreError("down")

    with pytest.raises(TransientStoreError):
        with_retries(down, attempts=3, base_delay=0, max_delay=0, sleep=lambda d: None)
    assert len(calls) == 3

    def denied():
        calls.append(1)
        raise StoreError("access denied")

    calls.clear()
    with pytest.raises(StoreError, match="access denied"):
        with_retries(denied, attempts=3, sleep=lambda d: None)
    assert len(calls) == 1


def test_backoff_grows_exponentially_up_to_the_cap():
    for attempt, cap in [(1, 1), (2, 2), (3, 4), (10, 30)]:
        delay = backoff_delay(attempt, base_delay=1, max_delay=30)
        assert cap / 2 <= delay <= cap


# --------------------------------------------------------------------------- one suite, three stores


SERVERS = {"s3": "s3_server", "gs": "gcs_server", "az": "azure_server"}


@pytest.fixture(params=["local", "s3", "gs", "az"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(tmp_path / "store")
    server = request.getfixturevalue(SERVERS[request.param])
    return open_store(server.bucket() + "/runs")


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
    files = {"big.bin": os.urandom(20 * 1024 * 1024),  # over 16 MiB: 2 S3 parts, 2 Azure blocks and ranges
             "sub/a.txt": b"a", "sub/b.txt": b"b" * 4097, "empty": b""}
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
            with_retries(lambda: store.list("r/"), attempts=2, base_delay=0, max_delay=0,
                         on_retry=lambda *a: retries.append(a), sleep=lambda d: None)
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
    assert str(caught.value) == (f"cannot read s3://ckpt/runs/run.json: endpoint {url} unreachable "
                                 "(EndpointConnectionError)")


def test_s3_missing_credentials_say_how_to_provide_them(s3_server, monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_WEB_IDENTITY_TOKEN_FILE"):
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
    env = {k: v for k, v in os.environ.items()
           if k not in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT")}
    env.update(CLOUDSDK_CONFIG=str(tmp_path), NO_GCE_CHECK="true", GCE_METADATA_HOST=closed,
               GCE_METADATA_IP=closed, HOME=str(tmp_path))
    code = ("from skyspot.storage import GCSStore\n"
            "try:\n    GCSStore('ckpt', sdk_retry_seconds=0).get_bytes('x')\n"
            "except Exception as e:\n    print(type(e).__name__ + ': ' + str(e))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == (
        "StoreError: cannot connect to gs://ckpt: no Google Cloud credentials found; run "
        "`gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS"), out.stderr


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
    store.put_bytes("r/events/attempt-1.node-0.rank-0.jsonl",
                    (line(2.0, "step", **step) + "\n" + line(1.0, "start") + "\n").encode())
    store.put_bytes("r/events/attempt-1.executor.jsonl", (line(0.5, "attempt_start") + "\nnot json\n").encode())
    store.put_bytes("r/events-old/attempt-0.executor.jsonl", (line(0.1, "attempt_start") + "\n").encode())
    store.put_bytes("other/events/attempt-1.executor.jsonl", (line(0.2, "attempt_start") + "\n").encode())
    log = read_events_store(store, "r")
    assert [(e["ts"], e["type"]) for e in log.events] == [(0.5, "attempt_start"), (1.0, "start"), (2.0, "step")]
    assert log.malformed == 1
    assert read_events_store(store, "missing").events == []


def test_azure_unreachable_endpoint_is_a_transient_store_error(azure_server, monkeypatch):
    url = _closed_port_url() + "/devstoreaccount1"
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       azure_server.connection_string.replace(azure_server.url, url))
    with pytest.raises(TransientStoreError) as caught:
        AzureStore("devstoreaccount1", "ckpt", "runs", sdk_attempts=1).get_bytes("run.json")
    assert str(caught.value) == (f"cannot read az://devstoreaccount1/ckpt/runs/run.json: endpoint {url} unreachable "
                                 "(ServiceRequestError)")


def test_azure_missing_credentials_say_how_to_provide_them(monkeypatch):
    for var in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setitem(sys.modules, "azure.identity", None)  # as without azure-identity: never ask a metadata address
    with pytest.raises(StoreError) as caught:
        open_store("az://myaccount1/ckpt").put_bytes("x", b"1")
    assert str(caught.value) == (
        "cannot connect to az://myaccount1/ckpt: no Azure credentials found; set AZURE_STORAGE_CONNECTION_STRING, "
        "AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN, or install azure-identity and run `az login` or use a "
        "managed identity")
    assert not isinstance(caught.value, TransientStoreError)


def test_azure_missing_container_is_named(azure_server):
    with pytest.raises(StoreError, match=r"az://devstoreaccount1/no-such-container-1/k: the container does not exist"):
        open_store("az://devstoreaccount1/no-such-container-1").put_bytes("k", b"1")
    with pytest.raises(StoreError, match=r"cannot list az://devstoreaccount1/no-such-container-1: the container"):
        open_store("az://devstoreaccount1/no-such-container-1").list()


def test_azure_wrong_key_is_access_denied_and_never_quoted(azure_server, monkeypatch):
    wrong = "d3Jvbmcta2V5LXdyb25nLWtleS13cm9uZy1rZXktd3Jvbmcta2V5LXdyb25nLWtleQ=="
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azure_server.connection_string.replace(azure_server.KEY, wrong))
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
    assert str(caught.value) == ("cannot connect to az://otheraccount/ckpt: AZURE_STORAGE_CONNECTION_STRING is for "
                                 "storage account 'devstoreaccount1', not 'otheraccount'")
    assert azure_server.KEY not in str(caught.value)


# --------------------------------------------------------------------------- streaming uploads


def _stream_through(store, key: str, data: bytes, source, *, release_at: int) -> None:
    """Feed `data` as a writer does: the local file first, then the stream, a view of the caller's
    memory for big chunks; at `release_at` the memory is released and then scribbled over, so what
    follows must come from the file."""
    buffer = bytearray(data)
    stream = store.open_stream(key, source=source)
    with open(source, "wb", buffering=0) as f:
        for start in range(0, len(buffer), 3 * 1024 * 1024 + 17):
            chunk = memoryview(buffer)[start:start + 3 * 1024 * 1024 + 17]
            f.write(chunk)
            stream.write(chunk)
            stream.write(b"")  # empty writes are nothing
    stream.end()
    if release_at:
        stream.release()
        buffer[:] = b"\0" * len(buffer)  # the snapshot buffers being reused by the next checkpoint
    assert stream.finish(timeout=120)
    assert stream.bytes == len(data)


def test_a_stream_becomes_one_whole_object_from_memory_and_the_local_file(store, tmp_path):
    data = os.urandom(34 * 1024 * 1024 + 5)  # three 16 MiB parts (S3 parts, GCS composite parts, Azure blocks)
    _stream_through(store, "ckpt/step_1/shard.pt", data, tmp_path / "shard.pt", release_at=1)
    store.get_file("ckpt/step_1/shard.pt", tmp_path / "back.pt")
    assert (tmp_path / "back.pt").read_bytes() == data
    assert store.list("ckpt/") == ["ckpt/step_1/shard.pt"]  # no temporary parts left behind

    empty = store.open_stream("ckpt/step_1/empty.pt", source=tmp_path / "empty.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    assert empty.finish(timeout=60) and store.get_bytes("ckpt/step_1/empty.pt") == b""


def test_an_aborted_stream_never_becomes_an_object(store, tmp_path):
    from skyspot.storage import StreamAborted

    stream = store.open_stream("ckpt/step_2/shard.pt", source=tmp_path / "x")
    stream.write(os.urandom(20 * 1024 * 1024))
    stream.abort("superseded by step 3", wait=30)
    with pytest.raises(StreamAborted, match="superseded by step 3"):
        stream.finish(timeout=30)
    assert not store.exists("ckpt/step_2/shard.pt")


@pytest.mark.parametrize("client", ["crt", "classic"])
def test_s3_streams_through_the_crt_client_or_the_classic_transfer_manager(s3_server, client, monkeypatch, tmp_path):
    pytest.importorskip("awscrt") if client == "crt" else None
    monkeypatch.setenv("SKYSPOT_S3_CLIENT", client)
    store = open_store(s3_server.bucket() + "/runs")
    data = os.urandom(17 * 1024 * 1024)
    _stream_through(store, "k.bin", data, tmp_path / "k.bin", release_at=0)
    assert store.stream_client == client and store.get_bytes("k.bin") == data
