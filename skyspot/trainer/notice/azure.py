"""Azure: Scheduled Events (Preempt, Reboot, Redeploy, Terminate, Freeze) for the VMs named in
Resources, and their approval (StartRequests) on the way out (docs/notices.md). The paths, API versions,
event types, window and poll period are Azure's facts, in skyspot/clouds/azure.py; the protocol, and its
state (this VM's name, the events acted on), are here.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
from typing import Any, Callable, Mapping
from urllib.parse import urlencode

from skyspot.clouds.azure import (
    AZURE_API_VERSION,
    AZURE_COMPUTE_PATH,
    AZURE_EVENTS_PATH,
    AZURE_INSTANCE_API_VERSION,
    AZURE_NAME_PATH,
    AZURE_NOTICE_WINDOW_S,
    AZURE_POLL_S,
    AZURE_SHUTDOWN_TYPES,
    AZURE_WARNING_TYPES,
)
from skyspot.trainer.notice.watcher import (
    SHORT_TIMEOUT_S,
    Binding,
    Notice,
    Watcher,
    MetadataHttp,
    _Path,
    _Unexpected,
    _http_date,
)

log = logging.getLogger(__name__)

AZURE_FIRST_TIMEOUT_S = 130.0  # first call may take "up to two minutes": the scheduled-events page above
AZURE_TIMEOUT_S = 10.0  # ours: once Scheduled Events answered, a hung request must not blind us for minutes
AZURE_ACK_TIMEOUT_S = 2.0  # ours: approving events on the way out must not hold the exit up


# -- Azure: Scheduled Events, polled ---------------------------------------------------------------


def bind(w: Watcher) -> Binding:
    """Poll Scheduled Events for events naming this VM in Resources.

    Events go to every VM of an availability set or scale-set placement group, so only those whose
    Resources name this VM (compute/name from instance metadata) count. Until the name is known
    (instance metadata not answering) every event counts: a needless checkpoint beats a lost one.
    """
    events_path = f"{AZURE_EVENTS_PATH}?{urlencode({'api-version': AZURE_API_VERSION})}"
    name_path = f"{AZURE_NAME_PATH}?{urlencode({'api-version': AZURE_INSTANCE_API_VERSION, 'format': 'text'})}"
    state: dict = {"answered": False, "name_tries": 0, "vm_name": None}
    seen: dict[str, dict] = {}  # EventId -> the event as last seen, to approve the one acted on
    acked: list[dict] = []  # the events acted on, to approve on the way out

    def vm_name() -> str | None:
        if state["vm_name"] is None:
            state["name_tries"] += 1
            try:
                status, _, body = w._http.request("GET", name_path, {"Metadata": "true"}, SHORT_TIMEOUT_S)
                if status == 200 and body.strip():
                    state["vm_name"] = body.decode().strip().strip('"')
                    log.debug("Azure VM name: %s", state["vm_name"])
                elif state["name_tries"] == 1:
                    log.warning(
                        "Azure instance metadata did not give this VM's name (%s); every scheduled "
                        "event counts as ours until it does",
                        status,
                    )
            except (OSError, http.client.HTTPException) as error:
                if state["name_tries"] == 1:
                    log.warning(
                        "Azure instance metadata did not give this VM's name (%s); every scheduled "
                        "event counts as ours until it does",
                        error,
                    )
        return state["vm_name"]

    def step() -> None:
        # The first request turns Scheduled Events on for this VM and may take two minutes; it goes
        # out before anything else.
        timeout = AZURE_TIMEOUT_S if state["answered"] else AZURE_FIRST_TIMEOUT_S
        status, _, body = w._http.request("GET", events_path, {"Metadata": "true"}, timeout)
        if status != 200:  # 429 above 5 requests a second, 5xx: back off
            raise _Unexpected(f"scheduledevents answered {status}")
        state["answered"] = True
        doc = json.loads(body)
        if not isinstance(doc, dict):
            raise _Unexpected("scheduledevents answered something other than a JSON object")
        events = doc.get("Events") or []
        name = vm_name()
        received, current = time.time(), set()
        for event in events:
            if not isinstance(event, dict) or not _names_us(event, name):
                continue
            etype, event_id = str(event.get("EventType", "")), str(event.get("EventId", ""))
            started = str(event.get("EventStatus", "")).lower() == "started"
            not_before = _http_date(event.get("NotBefore"))
            key = f"azure:{event_id or etype}"
            seen[event_id] = event
            if etype == "Preempt" or (etype in AZURE_SHUTDOWN_TYPES and started):
                # Imminent (a started Reboot came without notice, e.g. a host failure). NotBefore is
                # blank once an event has started: then a Preempt's minimum notice from now.
                w._deliver(
                    Notice(
                        "azure",
                        not_before or received + AZURE_NOTICE_WINDOW_S,
                        etype.lower(),
                        received,
                        "preemption" if etype == "Preempt" else "shutdown",
                        event_id or None,
                    )
                )
                return
            if etype in AZURE_SHUTDOWN_TYPES:
                current.add(key)
                w._plan(
                    key,
                    Notice(
                        "azure",
                        not_before or received + AZURE_NOTICE_WINDOW_S,
                        etype.lower(),
                        received,
                        "shutdown",
                        event_id or None,
                    ),
                )
            elif etype in AZURE_WARNING_TYPES and not started:
                w._warn(
                    key, Notice("azure", not_before or received, etype.lower(), received, "warning", event_id or None)
                )
        for key in w._planned_keys("azure:") - current:
            w._cancel(key)

    return Binding(
        [_Path(w, "azure-scheduled-events", w._period(AZURE_POLL_S), step)],
        on_final=lambda notice: _azure_acted(acked, seen.get(notice.event_id or ""), state["vm_name"]),
        on_stop=lambda: _approve(w.endpoint, acked),
    )


def _names_us(event: dict, name: str | None) -> bool:
    resources = event.get("Resources")
    if name is None or not isinstance(resources, list) or not resources:
        return True
    return any(isinstance(r, str) and r.strip().lower() == name.lower() for r in resources)


def _azure_acted(acked: list[dict], event: dict | None, name: str | None) -> None:
    """Remember an event we are about to act on, to approve it on the way out if it is ours alone.

    Approving lets an event proceed for every VM in its Resources (the Azure page above), so an
    event that also names other VMs is left to them and to NotBefore.
    """
    resources = event.get("Resources") if event else None
    if (
        name is not None
        and isinstance(resources, list)
        and len(resources) == 1
        and str(resources[0]).strip().lower() == name.lower()
        and event
        and event.get("EventId")
    ):
        acked.append(event)


def _approve(endpoint: str, acked: list[dict]) -> None:
    """POST StartRequests for the events acted on (none: nothing to do); errors are logged, never raised."""
    if not acked:
        return
    ids = [e["EventId"] for e in acked]
    del acked[:]
    path = f"{AZURE_EVENTS_PATH}?{urlencode({'api-version': AZURE_API_VERSION})}"
    body = json.dumps({"StartRequests": [{"EventId": i} for i in ids]}).encode()
    end = time.monotonic() + AZURE_ACK_TIMEOUT_S
    status: object = None
    while True:
        try:
            status, _, _ = MetadataHttp(endpoint).request(
                "POST",
                path,
                {"Metadata": "true", "Content-Type": "application/json"},
                max(0.1, end - time.monotonic()),
                body,
            )
        except Exception as error:  # the exit goes on; the event starts at NotBefore anyway
            status = repr(error)
        if status == 200:
            log.info("approved Azure scheduled event(s) %s: the checkpoint is made, no need to wait", ", ".join(ids))
            return
        if status not in (429, 500, 502, 503, 504) or time.monotonic() + 0.25 > end:
            break
        time.sleep(0.25)  # throttled (5 requests a second) or busy: once more while the budget lasts
    log.warning("could not approve Azure scheduled event(s) %s (%s); they start at NotBefore", ", ".join(ids), status)


# -- what the node is (trainer/instance.py) ---------------------------------------------------------


def read_instance(http: MetadataHttp, environ: Mapping[str, str], left: Callable[[], float]) -> dict[str, Any]:
    """The IMDS compute document's vmSize, priority (Spot | Low | Regular), zone, location and image
    reference (its id, or publisher:offer:sku:version). `left()` gives the request's timeout."""
    path = f"{AZURE_COMPUTE_PATH}?api-version={AZURE_INSTANCE_API_VERSION}"
    status, _, body = http.request("GET", path, {"Metadata": "true"}, left())
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
        image = (
            reference.get("id")
            or ":".join(str(reference[k]) for k in ("publisher", "offer", "sku", "version") if reference.get(k))
            or None
        )
    return {
        "instance_type": compute.get("vmSize"),
        "capacity": priority,
        "spot": priority.lower() in ("spot", "low"),
        "zone": compute.get("zone") or None,
        "region": compute.get("location") or None,
        "image": image,
    }
