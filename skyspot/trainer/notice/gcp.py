"""GCP: the metadata server's hanging GETs (`preempted`, `maintenance-event`, reconnecting with the last
ETag) and the upcoming-maintenance window start (docs/notices.md). The paths, events, windows and retry
period are GCP's facts, in skyspot/clouds/gcp.py; the protocol is here.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime
from typing import Any, Callable, Mapping
from urllib.parse import urlencode

from skyspot.clouds.gcp import (
    GCP_IMAGE_PATH,
    GCP_INSTANCE_PATHS,
    GCP_MAINTENANCE_NOTICE_S,
    GCP_MAINTENANCE_PATH,
    GCP_NOTICE_WINDOW_S,
    GCP_PREEMPTED_PATH,
    GCP_RETRY_S,
    GCP_SHUTDOWN_EVENTS,
    GCP_UPCOMING_PATH,
    GCP_WARNING_EVENTS,
    maintenance_notice_s,
)
from skyspot.trainer.notice.watcher import (
    SHORT_TIMEOUT_S,
    Binding,
    MetadataHttp,
    Notice,
    Watcher,
    _Path,
    _RETRYABLE,
    _Stopped,
    _Unexpected,
)

log = logging.getLogger(__name__)

GCP_WAIT_TIMEOUT_S = 60  # timeout_sec of each hanging GET; reconnect with last_etag after it


# -- GCP: hanging GETs on instance/preempted and instance/maintenance-event -----------------------


def bind(w: Watcher) -> Binding:
    maintenance_notice = maintenance_notice_s(w._env)
    last_event = ["NONE"]
    planned = [0]  # a new key per planned event, so a second one in an attempt is warned of too

    def preempted(value: str) -> None:
        if value.upper() == "TRUE":
            received = time.time()
            w._deliver(Notice("gcp", received + GCP_NOTICE_WINDOW_S, "preempt", received))

    def maintenance(value: str) -> None:
        value = value.upper()
        if value == last_event[0]:
            return
        last_event[0] = value
        received = time.time()
        if value in GCP_SHUTDOWN_EVENTS:
            planned[0] += 1
            deadline = _gcp_window_start(w) or received + maintenance_notice
            w._plan(f"gcp:maintenance:{planned[0]}", Notice("gcp", deadline, "maintenance", received, "shutdown"))
        elif value in GCP_WARNING_EVENTS:
            w._warn(
                f"gcp:migrate:{received}",
                Notice("gcp", received + GCP_MAINTENANCE_NOTICE_S, "migrate", received, "warning"),
            )
        elif value == "NONE":
            for key in w._planned_keys("gcp:"):
                w._cancel(key)
        else:
            log.warning("unknown GCP maintenance-event %r; treating it as a planned shutdown", value)
            planned[0] += 1
            w._plan(
                f"gcp:maintenance:{planned[0]}",
                Notice("gcp", received + maintenance_notice, "maintenance", received, "shutdown"),
            )

    interval = w._period(GCP_RETRY_S)
    return Binding(
        [
            _Path(w, "gcp-preempted", interval, _gcp_hanging(w, GCP_PREEMPTED_PATH, preempted, interval)),
            _Path(w, "gcp-maintenance-event", interval, _gcp_hanging(w, GCP_MAINTENANCE_PATH, maintenance, interval)),
        ]
    )


def _gcp_hanging(w: Watcher, path: str, on_value: Callable[[str], None], interval: float) -> Callable[[], float]:
    """One hanging GET per call, reconnecting with last_etag after each answer.

    Starting from last_etag=0 (as Google's own sample does) makes the first call return the current
    value at once, so a warning already pending when the watcher starts is not missed. An answer
    without an ETag, or one that came back at once with the ETag we sent, means the server does not
    hang: then ask again only after `interval`, never in a busy loop.
    """
    state = {"etag": "0", "complained": False}

    def step() -> float:
        sent = state["etag"]
        query = urlencode({"wait_for_change": "true", "last_etag": sent, "timeout_sec": GCP_WAIT_TIMEOUT_S})
        asked = time.monotonic()
        status, headers, body = w._http.request(
            "GET", f"{path}?{query}", {"Metadata-Flavor": "Google"}, GCP_WAIT_TIMEOUT_S + 10
        )
        if status != 200:  # 503 during host maintenance is documented; retry it like a network error
            raise _Unexpected(f"{path.rsplit('/', 1)[-1]} answered {status}")
        on_value(body.decode(errors="replace").strip())
        etag = headers.get("ETag")
        if not etag:
            if not state["complained"]:
                state["complained"] = True
                log.warning(
                    "GCP metadata answered %s without an ETag; asking every %.1f s instead of hanging", path, interval
                )
            state["etag"] = "0"
            return interval
        state["etag"] = etag
        if etag == sent and time.monotonic() - asked < min(1.0, GCP_WAIT_TIMEOUT_S / 2):
            return interval  # answered at once with nothing new: the server is not hanging
        return 0.0

    return step


def _gcp_window_start(w: Watcher) -> float | None:
    """instance/upcoming-maintenance's window_start_time, when the server has it (None otherwise)."""
    try:
        status, _, body = w._http.request("GET", GCP_UPCOMING_PATH, {"Metadata-Flavor": "Google"}, SHORT_TIMEOUT_S)
        if status != 200:
            return None
        doc = json.loads(body)
        raw = doc.get("window_start_time") or doc.get("windowStartTime")
        return datetime.fromisoformat(str(raw).replace("Z", "+00:00")).timestamp() if raw else None
    except _Stopped:
        raise
    except (*_RETRYABLE, AttributeError, TypeError) as error:
        log.debug("GCP upcoming-maintenance unreadable: %r", error)
        return None


# -- what the node is (trainer/instance.py) ---------------------------------------------------------


def read_instance(http: MetadataHttp, environ: Mapping[str, str], left: Callable[[], float]) -> dict[str, Any]:
    """Machine type, scheduling/preemptible (TRUE for Spot and preemptible VMs alike), zone, and the
    image where the server says it. `left()` gives each request's timeout and raises once the reading's
    budget is spent."""
    headers = {"Metadata-Flavor": "Google"}
    values: dict[str, str] = {}
    for key, path in GCP_INSTANCE_PATHS.items():
        status, _, body = http.request("GET", path, headers, left())
        if status != 200:
            raise ValueError(f"{path} answered {status}")
        values[key] = body.decode().strip()
    image = None
    try:  # optional: what it cannot say costs nothing of the rest
        status, _, body = http.request("GET", GCP_IMAGE_PATH, headers, left())
        if status == 200:
            image = body.decode().strip().rsplit("/", 1)[-1] or None
    except Exception:  # noqa: BLE001 - optional, as above
        pass
    zone = values["zone"].rsplit("/", 1)[-1]  # projects/123/zones/us-central1-a
    preemptible = values["preemptible"].upper()
    return {
        "instance_type": values["machine_type"].rsplit("/", 1)[-1],
        "capacity": preemptible,
        "spot": preemptible == "TRUE",
        "zone": zone,
        "region": zone.rsplit("-", 1)[0],
        "image": image,
    }
