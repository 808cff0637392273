"""skyspot.storage.uri: store URIs validated with one line saying what is wrong, and the bucket SkyPilot mounts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from skyspot.errors import UsageError
from skyspot.storage import StoreURI, mount_source, parse_store_uri

FORMS = "s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, az://ACCOUNT/CONTAINER/PREFIX or a local path"
AZ_FORM = "az://ACCOUNT/CONTAINER/PREFIX"


# --------------------------------------------------------------------------- URIs


@pytest.mark.parametrize(
    "uri, expected",
    [
        ("s3://my-bucket/runs/llama", StoreURI("s3", "my-bucket", "runs/llama")),
        ("s3://my.bucket-1", StoreURI("s3", "my.bucket-1", "")),
        ("S3://abc/x/", StoreURI("s3", "abc", "x")),
        ("gs://under_score/p", StoreURI("gs", "under_score", "p")),
        ("gs://" + ".".join(["a" * 60] * 3), StoreURI("gs", ".".join(["a" * 60] * 3), "")),
        ("az://myaccount1/container-1/runs", StoreURI("az", "container-1", "runs", "myaccount1")),
        ("az://abc/ckpt", StoreURI("az", "ckpt", "", "abc")),
        ("/abs/path", StoreURI("file", "", "/abs/path")),
        ("file:///abs/path", StoreURI("file", "", "/abs/path")),
    ],
)
def test_valid_uris_parse(uri, expected):
    assert parse_store_uri(uri) == expected


def test_relative_local_path_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_store_uri("runs") == StoreURI("file", "", str(tmp_path / "runs"))
    assert str(parse_store_uri("s3://abc/x")) == "s3://abc/x"


@pytest.mark.parametrize(
    "uri", ["s3://abc/x/y", "gs://abc", "az://myaccount1/ckpt/runs/llama", "az://abc/ckpt", "/abs/path"]
)
def test_a_parsed_uri_prints_as_written(uri):
    assert str(parse_store_uri(uri)) == uri
    assert parse_store_uri(str(parse_store_uri(uri))) == parse_store_uri(uri)


@pytest.mark.parametrize(
    "uri, message",
    [
        ("http://host/x", f"unsupported store scheme 'http://' in 'http://host/x'; expected {FORMS}"),
        ("ftp://a/b", f"unsupported store scheme 'ftp://' in 'ftp://a/b'; expected {FORMS}"),
        # Issue 31, item 13: one slash short made a local folder named `s3:` in the working directory.
        ("s3:/bucket/x", f"store 's3:/bucket/x' is missing a slash after 's3:'; expected {FORMS}"),
        ("gs:bucket", f"store 'gs:bucket' is missing a slash after 'gs:'; expected {FORMS}"),
        ("AZ:/acct/c", f"store 'AZ:/acct/c' is missing a slash after 'AZ:'; expected {FORMS}"),
        ("", f"empty store location; expected {FORMS}"),
        ("s3://", "store 's3://' has no bucket; expected s3://BUCKET/PREFIX"),
        (
            "s3://My_Bucket/x",
            "invalid S3 bucket name 'My_Bucket' in 's3://My_Bucket/x': may contain only "
            "lowercase letters, digits, dots and hyphens; expected s3://BUCKET/PREFIX",
        ),
        (
            "s3://ab",
            "invalid S3 bucket name 'ab' in 's3://ab': must be 3-63 characters long, not 2; "
            "expected s3://BUCKET/PREFIX",
        ),
        (
            "s3://-abc",
            "invalid S3 bucket name '-abc' in 's3://-abc': must start and end with a letter or "
            "digit; expected s3://BUCKET/PREFIX",
        ),
        (
            "s3://a..b",
            "invalid S3 bucket name 'a..b' in 's3://a..b': must not contain two adjacent dots; "
            "expected s3://BUCKET/PREFIX",
        ),
        (
            "s3://10.0.0.1",
            "invalid S3 bucket name '10.0.0.1' in 's3://10.0.0.1': must not be an IP address; "
            "expected s3://BUCKET/PREFIX",
        ),
        (
            "s3://under_score",
            "invalid S3 bucket name 'under_score' in 's3://under_score': may contain only "
            "lowercase letters, digits, dots and hyphens; expected s3://BUCKET/PREFIX",
        ),
        (
            "gs://" + "a" * 64,
            f"invalid GCS bucket name '{'a' * 64}' in 'gs://{'a' * 64}': must be 3-63 "
            "characters long (up to 222 with dots), not 64; expected gs://BUCKET/PREFIX",
        ),
        (
            "gs://google-ckpt",
            "invalid GCS bucket name 'google-ckpt' in 'gs://google-ckpt': must not start "
            "with 'goog' or contain 'google'; expected gs://BUCKET/PREFIX",
        ),
        ("az://", f"store 'az://' has no storage account; expected {AZ_FORM}"),
        ("az://myaccount1", f"store 'az://myaccount1' has no container; expected {AZ_FORM}"),
        ("az://myaccount1/", f"store 'az://myaccount1/' has no container; expected {AZ_FORM}"),
        (
            "az://ab/ckpt",
            f"invalid Azure storage account name 'ab' in 'az://ab/ckpt': must be 3-24 characters long, "
            f"not 2; expected {AZ_FORM}",
        ),
        (
            "az://My_Account/ckpt",
            "invalid Azure storage account name 'My_Account' in 'az://My_Account/ckpt': may "
            f"contain only lowercase letters and digits; expected {AZ_FORM}",
        ),
        # the old az://CONTAINER/PREFIX form: a container name is rarely a valid account name
        (
            "az://container-1/runs",
            "invalid Azure storage account name 'container-1' in 'az://container-1/runs': may "
            f"contain only lowercase letters and digits; expected {AZ_FORM}",
        ),
        (
            "az://myaccount1/Container",
            "invalid Azure container name 'Container' in 'az://myaccount1/Container': may "
            f"contain only lowercase letters, digits and hyphens; expected {AZ_FORM}",
        ),
        (
            "az://myaccount1/ckpt/a//b",
            f"store 'az://myaccount1/ckpt/a//b' has an empty, '.' or '..' path segment; expected {AZ_FORM}",
        ),
        ("s3://abc/a//b", "store 's3://abc/a//b' has an empty, '.' or '..' path segment; expected s3://BUCKET/PREFIX"),
        ("gs://abc/../x", "store 'gs://abc/../x' has an empty, '.' or '..' path segment; expected gs://BUCKET/PREFIX"),
        ("file://host/x", "store 'file://host/x' is not a local file URI; expected file:///ABSOLUTE/PATH"),
    ],
)
def test_bad_uris_say_what_is_wrong_and_what_is_expected(uri, message):
    with pytest.raises(UsageError) as caught:
        parse_store_uri(uri)
    assert str(caught.value) == message
    assert "\n" not in str(caught.value)


def test_parsing_imports_no_cloud_sdk():
    code = (
        "import sys, skyspot.storage as s; s.parse_store_uri('gs://abc/x'); s.open_store('s3://abc/x'); "
        "s.open_store('az://abc/ckpt/x'); s.mount_source('az://abc/ckpt/x'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore', 'google', 'azure')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- bucket mounts


@pytest.mark.parametrize(
    "uri, source, name",
    [
        ("s3://my-ckpts/runs/llama", "s3://my-ckpts", "my-ckpts"),
        ("gs://my-ckpts", "gs://my-ckpts", "my-ckpts"),
        ("az://myaccount1/ckpts/runs", "https://myaccount1.blob.core.windows.net/ckpts", "ckpts"),
    ],
)
def test_mount_source_is_a_bucket_skypilot_mounts(uri, source, name):
    """What SkyPilot 0.14.1 does with a MOUNT file mount: the task loads offline, and the checks its
    server runs before creating the storage (Storage.construct) accept the source and name the bucket."""
    from sky import Task
    from sky.data import data_utils

    assert mount_source(uri) == source
    task = Task.from_yaml_config(
        {"run": "true", "file_mounts": {"/skyspot/store": {"source": source, "mode": "MOUNT"}}}
    )
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

    task = Task.from_yaml_config(
        {"run": "true", "file_mounts": {"/skyspot/store": {"source": "az://myaccount1/ckpts", "mode": "MOUNT"}}}
    )
    storage = task.storage_mounts["/skyspot/store"]
    with pytest.raises(StorageSourceError, match="Supported paths"):
        storage._validate_storage_spec(storage.name)
    with pytest.raises(ValueError, match="local path"):
        mount_source("/mnt/ckpts")
