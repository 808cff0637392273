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

import importlib
import logging
import re
import threading
import time
from typing import Any, Mapping, Optional

from skyspot import clouds
from skyspot.trainer.notice.watcher import MetadataHttp, fallback_target, watch_target

log = logging.getLogger(__name__)

TIMEOUT_S = 1.0  # ours: a metadata service answers in milliseconds; one that does not is not there
BUDGET_S = 4.0  # ours: the most the whole reading may take


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
    # The cloud's own reader, beside its notice protocol (clouds.Cloud.notice_watcher names the module).
    reader = importlib.import_module(clouds.get(cloud).notice_watcher).read_instance

    def left() -> float:
        """The timeout for the next request; TimeoutError once the whole reading's budget is spent."""
        remaining = BUDGET_S - (time.monotonic() - start)
        if remaining <= 0:
            raise TimeoutError("instance metadata: out of time")
        return min(TIMEOUT_S, remaining)

    def ask() -> None:
        try:
            box["found"] = reader(_Capped(http), environ, left)
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
