"""What this node runs on, as its cloud's own metadata service says: instance type, capacity, zone.

SKYPILOT_CLUSTER_INFO names the cloud, region and zone but not the instance type or whether it is
spot, so without this a cloud run whose SkyPilot queue cannot be read is priced as nothing. The node
leader asks once, at start, and the trainer's `start` event carries the answer (`where`, and the
metadata as read in `instance`):

    AWS    IMDSv2  /latest/meta-data/instance-type, instance-life-cycle (spot | on-demand | scheduled),
                   placement/availability-zone, placement/availability-zone-id, placement/region, ami-id
    GCP            /computeMetadata/v1/instance/machine-type, scheduling/preemptible (TRUE | FALSE), zone,
                   image (optional)
    Azure  IMDS    /metadata/instance/compute?api-version=2021-02-01: vmSize, priority (Spot | Low | Regular),
                   zone, location, storageProfile.imageReference (id, or publisher:offer:sku:version)

Where to ask is the notice watchers' decision, made once (notice.watch_target): only on a node whose
SKYPILOT_CLUSTER_INFO names one of the three clouds, at the address that cloud's SDKs use or the
override they read (AWS_EC2_METADATA_SERVICE_ENDPOINT, GCE_METADATA_HOST, SKYSPOT_AZURE_METADATA_ENDPOINT);
off a cloud node nothing is sent anywhere. Each request has a short timeout and the first failure ends
the reading: a node without a metadata service starts at most a few seconds later, never fails.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from types import SimpleNamespace
from typing import Any, Mapping, Optional

from skyspot.clouds.azure import AZURE_INSTANCE_API_VERSION
from skyspot.trainer.notice.aws import AwsSession
from skyspot.trainer.notice.watcher import MetadataHttp, fallback_target, watch_target

log = logging.getLogger(__name__)

TIMEOUT_S = 1.0  # ours: a metadata service answers in milliseconds; one that does not is not there
BUDGET_S = 4.0  # ours: the most the whole reading may take

AWS_PATHS = {  # https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instancedata-data-categories.html
    "instance_type": "/latest/meta-data/instance-type",
    "lifecycle": "/latest/meta-data/instance-life-cycle",
    "zone": "/latest/meta-data/placement/availability-zone",
    "zone_id": "/latest/meta-data/placement/availability-zone-id",
    "region": "/latest/meta-data/placement/region",
    "image": "/latest/meta-data/ami-id",  # the node's facts (trainer/node_facts.py); optional
}
GCP_PATHS = {  # https://cloud.google.com/compute/docs/metadata/predefined-metadata-keys
    "machine_type": "/computeMetadata/v1/instance/machine-type",
    "preemptible": "/computeMetadata/v1/instance/scheduling/preemptible",
    "zone": "/computeMetadata/v1/instance/zone",
}
GCP_IMAGE_PATH = "/computeMetadata/v1/instance/image"  # optional: projects/P/global/images/NAME
AZURE_COMPUTE_PATH = "/metadata/instance/compute"  # https://learn.microsoft.com/azure/virtual-machines/instance-metadata-service


def read(environ: Mapping[str, str]) -> Optional[dict[str, Any]]:
    """This node's instance as its cloud's metadata service reports it; None off a cloud node or when it
    does not answer. Keys: cloud, instance_type, spot (bool), capacity (the cloud's word), zone, region,
    image, and on AWS zone_id (what the price data's AWS zones are).

    Bounded every way a metadata service (or something squatting its address) can misbehave: the whole
    reading ends within BUDGET_S however slowly the bytes come (it runs on a thread of its own and the
    sockets are shut when the budget is spent), no answer is read past MAX_BODY, any exception is a
    service that did not answer, and a value that is not a short printable string is dropped
    (`_clean`). A start never fails here."""
    target = watch_target(environ)
    if target is None:
        return None
    cloud, endpoint = target
    start = time.monotonic()
    try:
        http = MetadataHttp(endpoint, fallback_target(environ))
    except Exception as error:  # noqa: BLE001 - an endpoint that is not http://host:port
        log.info("instance metadata: %s endpoint %s unusable (%s)", cloud, endpoint, error)
        return None
    box: dict[str, Any] = {}

    def ask() -> None:
        try:
            box["found"] = {"aws": _aws, "gcp": _gcp, "azure": _azure}[cloud](_Capped(http), environ, start)
        except Exception as error:  # noqa: BLE001 - a garbage status line, a 429, a list for a document ...
            box["error"] = error

    worker = threading.Thread(target=ask, name="skyspot-instance-metadata", daemon=True)
    worker.start()
    worker.join(BUDGET_S)
    if worker.is_alive():
        http.abort()  # wakes the blocked read; the thread ends on its own
        log.info("instance metadata: %s at %s took more than %.0fs; not read", cloud, endpoint, BUDGET_S)
        return None
    if "error" in box:
        log.info("instance metadata: %s at %s did not answer (%s)", cloud, endpoint, box["error"])
        return None
    found = _clean(box.get("found"))
    if not found or not found.get("instance_type"):
        return None
    return {"cloud": cloud, **found, "source": f"{cloud} metadata", "seconds": round(time.monotonic() - start, 3)}


MAX_BODY = 64 * 1024  # ours: every answer read here is a few bytes; Azure's compute document a few KB
_VALUE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]{0,126}[\x21-\x7e])?")  # printable ASCII, 1-128 chars, trimmed


def _clean(found: Any) -> Optional[dict[str, Any]]:
    """What the reader returned, each value kept only if it is what the field holds: `spot` a bool, every
    other a short printable string (a nested object, a number, NaN or a megabyte of text is dropped)."""
    if not isinstance(found, dict):
        return None
    out: dict[str, Any] = {}
    for key, value in found.items():
        if key == "spot":
            out[key] = value if isinstance(value, bool) else None
        else:
            out[key] = value if isinstance(value, str) and _VALUE.fullmatch(value) else None
    return out


class _Capped:
    """The metadata HTTP client with every answer capped at MAX_BODY (the notice watchers' own is not)."""

    def __init__(self, http: MetadataHttp):
        self._http = http

    def request(self, method: str, path: str, headers: dict, timeout: float, body: Optional[bytes] = None):
        return self._http.request(method, path, headers, timeout, body, max_bytes=MAX_BODY)


def where_with(where: Mapping[str, Any], instance: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """`where` (from SKYPILOT_CLUSTER_INFO) with what the metadata service said in place of what it lacks:
    instance type and spot always (SkyPilot does not say them), zone and region where it said nothing."""
    merged = dict(where)
    if not instance:
        return merged
    for key in ("instance_type", "spot", "zone_id"):
        if instance.get(key) not in (None, ""):
            merged[key] = instance[key]
    for key in ("zone", "region"):
        if merged.get(key) in (None, "", "unknown") and instance.get(key):
            merged[key] = instance[key]
    if merged.get("cloud") in (None, "", "unknown"):
        merged["cloud"] = instance["cloud"]
    return merged


def _left(start: float) -> None:
    if time.monotonic() - start > BUDGET_S:
        raise TimeoutError("instance metadata: out of time")


def _aws(http: MetadataHttp, environ: Mapping[str, str], start: float) -> dict[str, Any]:
    # The notice watcher's IMDSv2 session (token, IMDSv1 fallback as botocore does), used once.
    session = AwsSession(SimpleNamespace(_http=http, _env=environ))
    values: dict[str, str] = {}
    for key, path in AWS_PATHS.items():
        _left(start)
        status, body = session.get(path)
        if status == 200:
            values[key] = body.decode().strip()
        elif key in ("instance_type", "lifecycle"):
            raise ValueError(f"{path} answered {status}")
    lifecycle = values.get("lifecycle", "")
    return {"instance_type": values.get("instance_type"), "capacity": lifecycle, "spot": lifecycle == "spot",
            "zone": values.get("zone"), "zone_id": values.get("zone_id"), "region": values.get("region"),
            "image": values.get("image")}


def _gcp(http: MetadataHttp, environ: Mapping[str, str], start: float) -> dict[str, Any]:
    values: dict[str, str] = {}
    for key, path in GCP_PATHS.items():
        _left(start)
        status, _, body = http.request("GET", path, {"Metadata-Flavor": "Google"}, TIMEOUT_S)
        if status != 200:
            raise ValueError(f"{path} answered {status}")
        values[key] = body.decode().strip()
    image = None
    try:  # optional: what it cannot say costs nothing of the rest
        _left(start)
        status, _, body = http.request("GET", GCP_IMAGE_PATH, {"Metadata-Flavor": "Google"}, TIMEOUT_S)
        if status == 200:
            image = body.decode().strip().rsplit("/", 1)[-1] or None
    except Exception:  # noqa: BLE001 - optional, as above
        pass
    zone = values["zone"].rsplit("/", 1)[-1]  # projects/123/zones/us-central1-a
    preemptible = values["preemptible"].upper()  # TRUE for Spot and preemptible VMs alike
    return {"instance_type": values["machine_type"].rsplit("/", 1)[-1], "capacity": preemptible,
            "spot": preemptible == "TRUE", "zone": zone, "region": zone.rsplit("-", 1)[0], "image": image}


def _azure(http: MetadataHttp, environ: Mapping[str, str], start: float) -> dict[str, Any]:
    path = f"{AZURE_COMPUTE_PATH}?api-version={AZURE_INSTANCE_API_VERSION}"
    status, _, body = http.request("GET", path, {"Metadata": "true"}, TIMEOUT_S)
    if status != 200:
        raise ValueError(f"{AZURE_COMPUTE_PATH} answered {status}")
    compute = json.loads(body)
    if not isinstance(compute, dict):
        raise ValueError(f"{AZURE_COMPUTE_PATH} answered a {type(compute).__name__}, not a document")
    priority = compute.get("priority") if isinstance(compute.get("priority"), str) else ""
    image = None
    profile = compute.get("storageProfile")
    reference = profile.get("imageReference") if isinstance(profile, dict) else None
    if isinstance(reference, dict):  # optional: an odd one costs nothing of the rest
        image = reference.get("id") or ":".join(str(reference[k]) for k in ("publisher", "offer", "sku", "version")
                                                if reference.get(k)) or None
    return {"instance_type": compute.get("vmSize"), "capacity": priority,
            "spot": priority.lower() in ("spot", "low"), "zone": compute.get("zone") or None,
            "region": compute.get("location") or None, "image": image}
