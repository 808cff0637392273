"""Store locations: parsing and validating a store URI, bucket mounts' sources, and keys.

A run root is `s3://BUCKET/PREFIX`, `gs://BUCKET/PREFIX`, `az://ACCOUNT/CONTAINER/PREFIX` or a
local directory. This module runs at CLI start-up (`--store`, `storage.store=`), so it imports
no cloud SDK and nothing heavier than the standard library.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass

from skyspot.errors import UsageError

FORMS = {"s3": "s3://BUCKET/PREFIX", "gs": "gs://BUCKET/PREFIX", "az": "az://ACCOUNT/CONTAINER/PREFIX"}
EXPECTED_FORMS = ", ".join(FORMS.values()) + " or a local path"


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
BUCKET_SCHEMES = ("s3", "gs", "az")


def is_bucket_uri(text: str | os.PathLike) -> bool:
    """Whether `text` names a bucket (s3://, gs://, az://, in any case: a URI's scheme is
    case-insensitive, RFC 3986 3.1). Everything that asks "bucket or this machine?" asks here, so
    `S3://b/x` is a bucket to the validator, to render and to preflight alike; the recipe's
    validators store it as `canonical` spells it."""
    match = _SCHEME_RE.match(os.fspath(text))
    return bool(match) and match.group(1).lower() in BUCKET_SCHEMES


def canonical(uri: str | os.PathLike) -> str:
    """The one spelling of a store location: the scheme in lowercase (`S3://b/x` -> `s3://b/x`), no
    trailing `/`, and a local path (relative, `~/...` or `file:///...`) as an absolute directory of
    this machine. Raises `UsageError` as `parse_store_uri` does."""
    return str(parse_store_uri(uri))


def parse_store_uri(uri: str | os.PathLike) -> StoreURI:
    """Validate a store location; raise `UsageError` with one line saying what is wrong and what is expected."""
    text = os.fspath(uri)
    if not text.strip():
        raise UsageError(f"empty store location; expected {EXPECTED_FORMS}")
    match = _SCHEME_RE.match(text)
    if match is None:
        # `s3:/bucket/x` (a slash short) or `gs:bucket`: a bucket meant, never a local folder named `s3:`.
        typo = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):(?!//)", text)
        if typo and typo.group(1).lower() in BUCKET_SCHEMES + ("file",):
            raise UsageError(f"store {text!r} is missing a slash after '{typo.group(1)}:'; expected {EXPECTED_FORMS}")
        return StoreURI("file", "", os.path.abspath(os.path.expanduser(text)))
    scheme = match.group(1).lower()
    rest = text[match.end() :]
    if scheme == "file":
        host, slash, path = rest.partition("/")
        if host not in ("", "localhost") or not slash:
            raise UsageError(f"store {text!r} is not a local file URI; expected file:///ABSOLUTE/PATH")
        return StoreURI("file", "", os.path.abspath("/" + path))
    if scheme not in BUCKET_SCHEMES:
        raise UsageError(f"unsupported store scheme '{scheme}://' in {text!r}; expected {EXPECTED_FORMS}")
    form = FORMS[scheme]
    account = ""
    if scheme == "az":
        account, _, rest = rest.partition("/")
        if not account:
            raise UsageError(f"store {text!r} has no storage account; expected {form}")
        problem = _azure_account_problem(account)
        if problem:
            raise UsageError(f"invalid Azure storage account name {account!r} in {text!r}: {problem}; expected {form}")
    bucket, _, prefix = rest.partition("/")
    noun = "container" if scheme == "az" else "bucket"
    if not bucket:
        raise UsageError(f"store {text!r} has no {noun}; expected {form}")
    problem = _BUCKET_CHECKS[scheme](bucket)
    if problem:
        raise UsageError(f"invalid {_CLOUD[scheme]} {noun} name {bucket!r} in {text!r}: {problem}; expected {form}")
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


def check_key(key: str) -> str:
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in key.split("/")):
        raise ValueError(f"invalid store key {key!r}: keys are relative, '/'-separated, without '.' or '..'")
    return key
