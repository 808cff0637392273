"""A loopback stand-in for the three clouds' metadata services, as far as shutdown warnings go.

The local executor runs one per attempt and announces a simulated preemption or maintenance here,
so the trainer learns of it exactly the way it would on a cloud VM: through the same paths,
headers, payloads and token flow. Tests use it the same way. One server speaks all three dialects,
and is as strict as the clouds are (it is the stand-in the watchers are tested against):

    AWS    PUT /latest/api/token                                 IMDSv2 token (TTL header required)
           GET /latest/meta-data/spot/instance-action            404, or {"action", "time"}
           GET /latest/meta-data/spot/termination-time           404, or the time
           GET /latest/meta-data/events/recommendations/rebalance  404, or {"noticeTime"}
           GET /latest/meta-data/events/maintenance/scheduled    [] or [{"Code", "NotBefore", "State", ...}]
    GCP    GET /computeMetadata/v1/instance/preempted            FALSE/TRUE, ETag, wait_for_change
           GET /computeMetadata/v1/instance/maintenance-event     NONE/TERMINATE_ON_HOST_MAINTENANCE/..., ditto
           GET /computeMetadata/v1/instance/upcoming-maintenance  404, or {"window_start_time", ...}
    Azure  GET /metadata/scheduledevents?api-version=...         {"DocumentIncarnation", "Events"}
           POST /metadata/scheduledevents?api-version=...        {"StartRequests": [{"EventId"}]}
           GET /metadata/instance/compute/name?api-version=...&format=text   the VM's name

and, once `set_instance` has said what the VM is, the instance's identity (what trainer/instance.py reads;
404 before, as on a stand-in that has not said):

    AWS    GET /latest/meta-data/instance-type, instance-life-cycle, placement/availability-zone,
               placement/availability-zone-id, placement/region, ami-id
    GCP    GET /computeMetadata/v1/instance/machine-type (projects/0/machineTypes/T),
               instance/scheduling/preemptible (TRUE/FALSE), instance/zone (projects/0/zones/Z), instance/image
    Azure  GET /metadata/instance/compute?api-version=...   {"vmSize", "priority", "zone", "location", "name",
                                                             "storageProfile": {"imageReference": {"id"}}}

    with MetadataServer() as server:
        env = {**os.environ, **server.env_for(),
               "SKYPILOT_CLUSTER_INFO": json.dumps({"cloud": "AWS", ...})}
        ...
        server.announce_maintenance(time.time() + 3600)   # an hour of warning
        server.announce_preemption(time.time() + 120)

What the clouds do that a kind stand-in would not, each switchable per test:
    aws_tokens = "required"      IMDSv2 only (a GET without a valid token: 401); "optional" allows IMDSv1
    drop_token_puts = True        the token PUT is never answered, as behind a container bridge with the
                                  default hop limit of 1 (the response dies one hop short)
    gcp_etags = False             answers without an ETag (what a proxy or an odd server might do)
    azure_first_call_delay = s    Azure's first Scheduled Events call answers only after s seconds
    azure_events_after = s        events reach the document only s seconds after that first call
    azure_rate_limit = 5          Azure IMDS answers 429 above 5 requests a second (its documented limit)
    fail(endpoint, status, times) answer an endpoint with e.g. 503 (GCP during maintenance) or 500
Every Azure request is checked for a known api-version; scheduled events turn "Started" (NotBefore
blank) once approved with StartRequests or once NotBefore passes.

Every other path answers 404 without the clouds' marker headers, so SDKs that probe for a metadata
service (boto3's credential chain, google-auth's GCE check) conclude there is none. stdlib only.

One module despite its length: one HTTP server whose three clouds' dialects share the state a
test drives (the announced notice, failures, throttling, tokens) and the counters it asserts on.
"""

from __future__ import annotations

import collections
import email.utils
import hashlib
import json
import logging
import secrets
import sys
import threading
import time
import uuid
from collections import Counter
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import parse_qs, urlsplit

from skyspot import clouds
from skyspot.clouds.azure import AZURE_RATE_LIMIT

log = logging.getLogger(__name__)

AWS_MAX_TOKEN_TTL_S = 21600  # IMDSv2 accepts 1..21600: https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html
GCP_DEFAULT_WAIT_S = 300  # ours: how long a hanging GET without timeout_sec waits before answering unchanged
DROPPED_HOLD_S = 60.0  # ours: how long a dropped token PUT keeps its connection before closing it unanswered

# api-versions Azure IMDS accepts (https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events
# "Version and region availability"; instance-metadata-service "Supported API versions"). Others: 400.
AZURE_EVENTS_VERSIONS = ("2017-08-01", "2017-11-01", "2019-01-01", "2019-04-01", "2019-08-01", "2020-07-01")
AZURE_INSTANCE_VERSIONS = (
    "2017-04-02",
    "2017-08-01",
    "2017-10-01",
    "2017-12-01",
    "2018-02-01",
    "2018-04-02",
    "2018-10-01",
    "2019-02-01",
    "2019-03-11",
    "2019-04-30",
    "2019-06-01",
    "2019-06-04",
    "2019-08-01",
    "2019-08-15",
    "2019-11-01",
    "2020-06-01",
    "2020-07-15",
    "2020-09-01",
    "2020-10-01",
    "2020-12-01",
    "2021-01-01",
    "2021-02-01",
    "2021-03-01",
    "2021-05-01",
    "2021-10-01",
    "2021-11-01",
    "2021-11-15",
    "2021-12-13",
    "2023-07-01",
    "2023-11-15",
    "2024-03-15",
)

# Endpoint names used by the request counters and by fail().
ROUTES = {
    ("PUT", "/latest/api/token"): "aws.token",
    ("GET", "/latest/meta-data/spot/instance-action"): "aws.instance_action",
    ("GET", "/latest/meta-data/spot/termination-time"): "aws.termination_time",
    ("GET", "/latest/meta-data/events/recommendations/rebalance"): "aws.rebalance",
    ("GET", "/latest/meta-data/events/maintenance/scheduled"): "aws.maintenance",
    ("GET", "/computeMetadata/v1/instance/preempted"): "gcp.preempted",
    ("GET", "/computeMetadata/v1/instance/maintenance-event"): "gcp.maintenance_event",
    ("GET", "/computeMetadata/v1/instance/upcoming-maintenance"): "gcp.upcoming_maintenance",
    ("GET", "/metadata/scheduledevents"): "azure.scheduled_events",
    ("POST", "/metadata/scheduledevents"): "azure.start_requests",
    ("GET", "/metadata/instance/compute/name"): "azure.vm_name",
    ("GET", "/latest/meta-data/instance-type"): "aws.instance_type",
    ("GET", "/latest/meta-data/instance-life-cycle"): "aws.instance_life_cycle",
    ("GET", "/latest/meta-data/placement/availability-zone"): "aws.availability_zone",
    ("GET", "/latest/meta-data/placement/availability-zone-id"): "aws.availability_zone_id",
    ("GET", "/latest/meta-data/placement/region"): "aws.region",
    ("GET", "/latest/meta-data/ami-id"): "aws.ami_id",
    ("GET", "/computeMetadata/v1/instance/machine-type"): "gcp.machine_type",
    ("GET", "/computeMetadata/v1/instance/scheduling/preemptible"): "gcp.preemptible",
    ("GET", "/computeMetadata/v1/instance/zone"): "gcp.zone",
    ("GET", "/computeMetadata/v1/instance/image"): "gcp.image",
    ("GET", "/metadata/instance/compute"): "azure.compute",
}

# The variable each cloud's watcher reads for its endpoint (skyspot/clouds/, the cloud's class).
ENV_VARS = {c.name: c.metadata_endpoint_var for c in clouds.all()}

GCP_KEYS = {"gcp.preempted": "preempted", "gcp.maintenance_event": "maintenance-event"}


class MetadataServer:
    """The three clouds' warning endpoints on one loopback port, plus controls to make warnings appear.

    State is one "instance": nothing pending until announced; reset() starts a fresh one.
    Requests are served thread-per-request, so a GCP hanging GET never blocks the others.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        vm_name: str = "skyspot-local-vm",
        *,
        aws_tokens: str = "required",
        drop_token_puts: bool = False,
        gcp_etags: bool = True,
        azure_first_call_delay: float = 0.0,
        azure_events_after: float = 0.0,
        azure_rate_limit: Optional[int] = AZURE_RATE_LIMIT,
    ):
        if aws_tokens not in ("required", "optional"):
            raise ValueError(f"aws_tokens must be 'required' or 'optional', got {aws_tokens!r}")
        self._host = host
        self._port = port
        self.vm_name = vm_name
        self.aws_tokens = aws_tokens
        """"required": IMDSv2 only; "optional": a GET without a token is answered too (IMDSv1)."""
        self.drop_token_puts = drop_token_puts
        """The token PUT is never answered (a container behind the default hop limit of 1)."""
        self.gcp_etags = gcp_etags
        """False: GCP answers carry no ETag header."""
        self.azure_first_call_delay = azure_first_call_delay
        """Seconds Azure's first Scheduled Events call of an instance takes ("up to two minutes")."""
        self.azure_events_after = azure_events_after
        """Seconds after that first call before events reach the document ("within 5 minutes")."""
        self.azure_rate_limit = azure_rate_limit
        """Azure IMDS requests a second before 429 (None: no limit)."""
        self._cond = threading.Condition()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._requests: list[tuple[str, int]] = []
        self._tokens: dict[str, float] = {}
        self._failures: dict[str, list] = {}
        self._azure_recent: collections.deque[float] = collections.deque()
        self._instance: dict | None = None
        self.start_requests: list[str] = []
        """EventIds approved with StartRequests, in order."""
        self._reset_state()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> MetadataServer:
        """Bind and serve on a daemon thread; returns self."""
        httpd = _Server((self._host, self._port), _Handler)
        httpd.metadata = self
        self._httpd = httpd
        self._closing = False
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="skyspot-metadata-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, wake any hanging GET or held PUT, and free the port."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def __enter__(self) -> MetadataServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def host_port(self) -> str:
        """'127.0.0.1:PORT', the form GCE_METADATA_HOST takes."""
        if self._httpd is None:
            raise RuntimeError("MetadataServer is not started")
        host, port = self._httpd.server_address[:2]
        return f"{host}:{port}"

    @property
    def url(self) -> str:
        """'http://127.0.0.1:PORT'."""
        return f"http://{self.host_port}"

    def env_for(self, cloud: str | None = None) -> dict[str, str]:
        """Every variable that points cloud's watcher, and that cloud's SDKs, here; all clouds' when None.

        Each cloud says which (its class's `metadata_redirect_env`, skyspot/clouds/): our watcher reads
        the first of each group, the rest are what the SDKs on a node read, so that nothing on a node
        under test reaches for a real metadata address. It does not set SKYPILOT_CLUSTER_INFO, which says
        which cloud the node is on and is the executor's to write.
        """
        if cloud is None:
            return {k: v for c in clouds.all() for k, v in c.metadata_redirect_env(self.url).items()}
        return clouds.get(cloud).metadata_redirect_env(self.url)

    # -- controls -----------------------------------------------------------------------------

    def announce_preemption(
        self, deadline_ts: float, action: str = "terminate", resources: list[str] | None = None
    ) -> None:
        """Make all three clouds announce that this VM goes at deadline_ts (unix time).

        AWS: instance-action appears with `action`. GCP: preempted turns TRUE, waking hanging GETs.
        Azure: a Scheduled Event of type Preempt appears with NotBefore = deadline, for `resources`
        (default: this VM only; name other VMs to play a neighbour's eviction).
        """
        with self._cond:
            self._instance_action = {"action": action, "time": _iso_z(deadline_ts)}
            self._set_gcp("preempted", "TRUE")
            self._add_azure(_azure_event("Preempt", deadline_ts, resources or [self.vm_name]))

    def announce_maintenance(
        self,
        deadline_ts: float,
        azure_type: str = "Reboot",
        aws_code: str = "system-reboot",
        gcp_value: str = "TERMINATE_ON_HOST_MAINTENANCE",
        resources: list[str] | None = None,
    ) -> None:
        """Make all three clouds announce planned maintenance that stops this VM at deadline_ts.

        GCP: maintenance-event turns gcp_value (what a GPU VM sees an hour ahead) and
        upcoming-maintenance gives the window. Azure: an event of azure_type (Reboot, Redeploy,
        Terminate, Freeze) for `resources`. AWS: a scheduled event with aws_code.
        """
        with self._cond:
            self._set_gcp("maintenance-event", gcp_value)
            self._upcoming = {
                "can_reschedule": False,
                "latest_window_start_time": _iso_z(deadline_ts),
                "maintenance_status": "PENDING",
                "type": "SCHEDULED",
                "window_end_time": _iso_z(deadline_ts + 3600),
                "window_start_time": _iso_z(deadline_ts),
            }
            self._add_azure(_azure_event(azure_type, deadline_ts, resources or [self.vm_name]))
            self._aws_events.append(
                {
                    "NotBefore": _aws_date(deadline_ts),
                    "Code": aws_code,
                    "Description": "scheduled maintenance",
                    "EventId": f"instance-event-{secrets.token_hex(8)}",
                    "NotAfter": _aws_date(deadline_ts + 3600),
                    "State": "active",
                }
            )

    def cancel_maintenance(self) -> None:
        """Azure and the others call the maintenance off: GCP back to NONE, Azure's event removed, AWS's canceled."""
        with self._cond:
            self._set_gcp("maintenance-event", "NONE")
            self._upcoming = None
            kept = [e for e in self._azure_events if e["EventType"] == "Preempt"]
            if len(kept) != len(self._azure_events):
                self._azure_events = kept
                self._incarnation += 1
            for event in self._aws_events:
                event["State"] = "canceled"
            self._cond.notify_all()

    def add_azure_event(
        self,
        event_type: str,
        not_before_ts: float,
        resources: list[str] | None = None,
        status: str = "Scheduled",
        source: str = "Platform",
    ) -> str:
        """One Azure Scheduled Event as Azure writes it; returns its EventId."""
        event = _azure_event(event_type, not_before_ts, resources or [self.vm_name], status, source)
        with self._cond:
            self._add_azure(event)
        return event["EventId"]

    def set_instance(
        self,
        instance_type: str,
        *,
        spot: bool,
        zone: str,
        region: str,
        zone_id: str | None = None,
        image: str | None = None,
    ) -> None:
        """Say what the VM is, for the identity paths of all three clouds (each in its own spelling:
        AWS life cycle `spot`/`on-demand`, GCP preemptible `TRUE`/`FALSE`, Azure priority `Spot`/`Regular`).
        `image`: the image id (AWS ami-id; GCP instance/image as projects/0/global/images/IMAGE; Azure
        storageProfile.imageReference.id); None: those paths answer 404 (Azure: no storageProfile)."""
        with self._cond:
            self._instance = {
                "instance_type": instance_type,
                "spot": spot,
                "zone": zone,
                "region": region,
                "zone_id": zone_id,
                "image": image,
            }

    def recommend_rebalance(self, notice_ts: float | None = None) -> None:
        """AWS only: a rebalance recommendation appears (the other clouds have no equivalent)."""
        with self._cond:
            self._rebalance = {"noticeTime": _iso_z(time.time() if notice_ts is None else notice_ts)}

    def fail(self, endpoint: str, status: int = 503, times: int | None = None) -> None:
        """Answer `endpoint` ('aws.rebalance', 'gcp.preempted', ...) with `status` (the next `times` requests, or until heal())."""
        if endpoint not in ROUTES.values():
            raise ValueError(f"unknown endpoint {endpoint!r}")
        with self._cond:
            self._failures[endpoint] = [status, times]

    def heal(self, endpoint: str | None = None) -> None:
        """Stop failing `endpoint` (every endpoint when None)."""
        with self._cond:
            if endpoint is None:
                self._failures.clear()
            else:
                self._failures.pop(endpoint, None)

    def reset(self) -> None:
        """Back to nothing pending, as on a freshly launched VM: warnings gone, AWS tokens invalid,
        Azure's Scheduled Events not yet turned on. Counters and settings stay."""
        with self._cond:
            self._reset_state()
            self._tokens.clear()
            self._cond.notify_all()

    def expire_tokens(self) -> None:
        """Invalidate every AWS token issued so far, as a token's TTL running out would."""
        with self._cond:
            self._tokens.clear()

    # -- counters -----------------------------------------------------------------------------

    def count(self, endpoint: str | None = None, status: int | None = None) -> int:
        """Requests served, optionally only to one endpoint ('aws.instance_action', ...) or with one status.

        A request left unanswered (a dropped token PUT) counts with status 0.
        """
        with self._cond:
            return sum(
                1 for e, s in self._requests if (endpoint is None or e == endpoint) and (status is None or s == status)
            )

    @property
    def counts(self) -> Counter[str]:
        """Requests per endpoint name so far ('other' for paths this server does not serve)."""
        with self._cond:
            return Counter(e for e, _ in self._requests)

    # -- internals (called with or by the handler) --------------------------------------------

    def _reset_state(self) -> None:
        self._instance_action: dict[str, str] | None = None
        self._rebalance: dict[str, str] | None = None
        self._aws_events: list[dict[str, str]] = []
        self._generation = getattr(self, "_generation", 0) + 1
        self._gcp: dict[str, str] = {"preempted": "FALSE", "maintenance-event": "NONE"}
        self._gcp_etags = {key: self._etag_for(key, value) for key, value in self._gcp.items()}
        self._upcoming: dict[str, object] | None = None
        self._azure_events: list[dict] = []
        self._incarnation = getattr(self, "_incarnation", 0) + 1
        self._azure_first_call: float | None = None

    def _etag_for(self, key: str, value: str) -> str:
        return hashlib.sha1(f"{self._generation}:{key}:{value}".encode()).hexdigest()[:16]

    def _set_gcp(self, key: str, value: str) -> None:
        if self._gcp[key] != value:
            self._gcp[key] = value
            self._gcp_etags[key] = self._etag_for(key, value)
            self._cond.notify_all()

    def _add_azure(self, event: dict) -> None:
        self._azure_events = [e for e in self._azure_events if e["EventId"] != event["EventId"]] + [event]
        self._incarnation += 1
        self._cond.notify_all()

    def _azure_document(self, now: float) -> dict:
        """The document as Azure would answer now: events turn Started once approved or due."""
        visible = self._azure_first_call is not None and now >= self._azure_first_call + self.azure_events_after
        events = []
        for event in self._azure_events if visible else []:
            if event["EventStatus"] == "Scheduled" and now >= event["_not_before"]:
                event["EventStatus"], event["NotBefore"] = "Started", ""
                self._incarnation += 1
            events.append({k: v for k, v in event.items() if not k.startswith("_")})
        return {"DocumentIncarnation": self._incarnation, "Events": events}

    def _start_events(self, ids: list[str]) -> bool:
        """StartRequests: every id must name a current event; approved ones start now."""
        known = {e["EventId"]: e for e in self._azure_events}
        if not ids or any(i not in known for i in ids):
            return False
        for i in ids:
            known[i]["_not_before"] = 0.0
            self.start_requests.append(i)
        return True

    def _failure(self, endpoint: str) -> int | None:
        """The status to answer `endpoint` with, if it is set to fail."""
        with self._cond:
            rule = self._failures.get(endpoint)
            if rule is None:
                return None
            status, times = rule
            if times is not None:
                rule[1] = times - 1
                if rule[1] <= 0:
                    del self._failures[endpoint]
            return status

    def _throttled(self, now: float) -> bool:
        """Azure's per-VM limit over a sliding second."""
        if self.azure_rate_limit is None:
            return False
        with self._cond:
            recent = self._azure_recent
            while recent and recent[0] <= now - 1.0:
                recent.popleft()
            if len(recent) >= self.azure_rate_limit:
                return True
            recent.append(now)
            return False

    def _record(self, endpoint: str, status: int) -> None:
        with self._cond:
            self._requests.append((endpoint, status))


def _azure_event(
    event_type: str, not_before_ts: float, resources: list[str], status: str = "Scheduled", source: str = "Platform"
) -> dict:
    return {
        "EventId": str(uuid.uuid4()).upper(),
        "EventType": event_type,
        "ResourceType": "VirtualMachine",
        "Resources": list(resources),
        "EventStatus": status,
        "NotBefore": "" if status == "Started" else email.utils.formatdate(not_before_ts, usegmt=True),
        "Description": "",
        "EventSource": source,
        "DurationInSeconds": -1,
        "_not_before": 0.0 if status == "Started" else not_before_ts,
    }


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # a hanging GET must not hold up stop()
    metadata: MetadataServer

    def handle_error(self, request: object, client_address: tuple[str, int]) -> None:
        """A client that hung up mid-answer (a watcher stopping during a hanging GET) is normal, not a traceback."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("metadata server: client %s went away", client_address)
        else:
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    server_version = "skyspot-metadata"

    @property
    def md(self) -> MetadataServer:
        return self.server.metadata  # type: ignore[attr-defined]  # our _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        log.debug("metadata server: " + format, *args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        endpoint = ROUTES.get((method, parts.path.rstrip("/") or "/"), "other")
        handler = getattr(self, "_" + endpoint.replace(".", "_"), None)
        if endpoint.startswith("azure."):
            if self._azure_checks(endpoint, query):
                handler(endpoint, query)
            return
        failure = self.md._failure(endpoint) if handler is not None else None
        if handler is None:
            self._send(endpoint, 404, b"Not Found", "text/plain")
        elif failure is not None:
            self._send(endpoint, failure, b"Service Unavailable" if failure == 503 else b"Error", "text/plain")
        else:
            handler(endpoint, query)

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _send(
        self, endpoint: str, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        self.md._record(endpoint, status)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    # -- AWS ----------------------------------------------------------------------------------

    def _aws_token(self, endpoint: str, query: dict[str, str]) -> None:
        md = self.md
        if md.drop_token_puts:
            # The answer would leave with IP TTL = hop limit and die one hop short of a container:
            # to the client it is never answered. Hold the connection, then close it without a word.
            md._record(endpoint, 0)
            with md._cond:
                md._cond.wait_for(lambda: md._closing, timeout=DROPPED_HOLD_S)
            self.close_connection = True
            return
        raw = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
        ttl = int(raw) if raw.strip().isdigit() else 0
        if not 1 <= ttl <= AWS_MAX_TOKEN_TTL_S:
            self._send(endpoint, 400, b"Bad Request", "text/plain")
            return
        token = secrets.token_urlsafe(32)
        with md._cond:
            md._tokens[token] = time.monotonic() + ttl
        self._send(endpoint, 200, token.encode(), "text/plain", {"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)})

    def _aws_authorised(self, endpoint: str) -> bool:
        token = self.headers.get("X-aws-ec2-metadata-token")
        if token is None and self.md.aws_tokens == "optional":
            return True  # IMDSv1
        with self.md._cond:
            expires = self.md._tokens.get(token or "")
        if expires is None or time.monotonic() > expires:
            self._send(endpoint, 401, b"Unauthorized", "text/plain")
            return False
        return True

    def _aws_document(self, endpoint: str, document: object) -> None:
        if not self._aws_authorised(endpoint):
            return
        if document is None:
            self._send(endpoint, 404, b"Not Found", "text/plain")
        elif isinstance(document, str):
            self._send(endpoint, 200, document.encode(), "text/plain")
        else:
            self._send(endpoint, 200, json.dumps(document).encode(), "text/plain")

    def _aws_instance_action(self, endpoint: str, query: dict[str, str]) -> None:
        self._aws_document(endpoint, self.md._instance_action)

    def _aws_termination_time(self, endpoint: str, query: dict[str, str]) -> None:
        action = self.md._instance_action
        self._aws_document(endpoint, action["time"] if action and action["action"] == "terminate" else None)

    def _aws_rebalance(self, endpoint: str, query: dict[str, str]) -> None:
        self._aws_document(endpoint, self.md._rebalance)

    def _aws_maintenance(self, endpoint: str, query: dict[str, str]) -> None:
        with self.md._cond:
            events = [dict(e) for e in self.md._aws_events]
        self._aws_document(endpoint, events)

    def _aws_identity(self, endpoint: str, query: dict[str, str]) -> None:
        instance = self.md._instance
        value = None
        if instance is not None:
            value = {
                "aws.instance_type": instance["instance_type"],
                "aws.instance_life_cycle": "spot" if instance["spot"] else "on-demand",
                "aws.availability_zone": instance["zone"],
                "aws.availability_zone_id": instance["zone_id"],
                "aws.region": instance["region"],
                "aws.ami_id": instance.get("image"),
            }[endpoint]
        self._aws_document(endpoint, value)

    _aws_instance_type = _aws_identity
    _aws_instance_life_cycle = _aws_identity
    _aws_availability_zone = _aws_identity
    _aws_availability_zone_id = _aws_identity
    _aws_region = _aws_identity
    _aws_ami_id = _aws_identity

    # -- GCP ----------------------------------------------------------------------------------

    def _gcp_identity(self, endpoint: str, query: dict[str, str]) -> None:
        if not self._gcp_flavoured(endpoint):
            return
        instance = self.md._instance
        if instance is None:
            self._send(endpoint, 404, b"Not Found", "text/html", {"Metadata-Flavor": "Google"})
            return
        if endpoint == "gcp.image" and not instance.get("image"):
            self._send(endpoint, 404, b"Not Found", "text/html", {"Metadata-Flavor": "Google"})
            return
        value = {
            "gcp.image": f"projects/0/global/images/{instance.get('image')}",
            "gcp.machine_type": f"projects/0/machineTypes/{instance['instance_type']}",
            "gcp.preemptible": "TRUE" if instance["spot"] else "FALSE",
            "gcp.zone": f"projects/0/zones/{instance['zone']}",
        }[endpoint]
        self._send(endpoint, 200, value.encode(), "application/text", {"Metadata-Flavor": "Google"})

    _gcp_machine_type = _gcp_identity
    _gcp_preemptible = _gcp_identity
    _gcp_zone = _gcp_identity
    _gcp_image = _gcp_identity

    def _gcp_flavoured(self, endpoint: str) -> bool:
        if self.headers.get("Metadata-Flavor") != "Google":
            self._send(endpoint, 403, b"Missing Metadata-Flavor:Google header.", "text/html")
            return False
        return True

    def _gcp_headers(self, etag: str) -> dict[str, str]:
        headers = {"Metadata-Flavor": "Google"}
        if self.md.gcp_etags:
            headers["ETag"] = etag
        return headers

    def _gcp_value(self, endpoint: str, query: dict[str, str]) -> None:
        if not self._gcp_flavoured(endpoint):
            return
        md, key = self.md, GCP_KEYS[endpoint]
        with md._cond:
            if query.get("wait_for_change", "").lower() == "true":
                last = query.get("last_etag") or md._gcp_etags[key]  # no last_etag: wait for the next change
                raw = query.get("timeout_sec", "")
                wait = int(raw) if raw.isdigit() and int(raw) > 0 else GCP_DEFAULT_WAIT_S
                md._cond.wait_for(lambda: md._gcp_etags[key] != last or md._closing, timeout=wait)
            value, etag = md._gcp[key], md._gcp_etags[key]
        self._send(endpoint, 200, value.encode(), "application/text", self._gcp_headers(etag))

    _gcp_preempted = _gcp_value
    _gcp_maintenance_event = _gcp_value

    def _gcp_upcoming_maintenance(self, endpoint: str, query: dict[str, str]) -> None:
        if not self._gcp_flavoured(endpoint):
            return
        with self.md._cond:
            doc = dict(self.md._upcoming) if self.md._upcoming else None
        if doc is None:
            self._send(endpoint, 404, b"Not Found", "text/html", {"Metadata-Flavor": "Google"})
        else:
            body = json.dumps(doc).encode()
            self._send(endpoint, 200, body, "application/json", self._gcp_headers(hashlib.sha1(body).hexdigest()[:16]))

    # -- Azure --------------------------------------------------------------------------------

    def _azure_checks(self, endpoint: str, query: dict[str, str]) -> bool:
        """What Azure IMDS checks before anything else: rate, the Metadata header, the api-version."""
        if self.md._throttled(time.monotonic()):
            self._send(endpoint, 429, json.dumps({"error": "Too many requests"}).encode(), "application/json")
            return False
        if self.headers.get("Metadata", "").lower() != "true":
            self._azure_error(endpoint, "Bad request. Required metadata header not specified")
            return False
        versions = AZURE_INSTANCE_VERSIONS if endpoint in ("azure.vm_name", "azure.compute") else AZURE_EVENTS_VERSIONS
        if query.get("api-version") not in versions:
            self._azure_error(
                endpoint,
                "Bad request. api-version is invalid or was not specified in the request. "
                "For more information refer to aka.ms/azureimds",
                {"newest-versions": list(reversed(versions[-3:]))},
            )
            return False
        failure = self.md._failure(endpoint)
        if failure is not None:
            self._send(endpoint, failure, b"Service Unavailable", "text/plain")
            return False
        return True

    def _azure_scheduled_events(self, endpoint: str, query: dict[str, str]) -> None:
        md = self.md
        with md._cond:
            first = md._azure_first_call is None
            if first:
                md._azure_first_call = time.time()  # this request turns Scheduled Events on for the VM
        if first and md.azure_first_call_delay > 0:
            with md._cond:
                md._cond.wait_for(lambda: md._closing, timeout=md.azure_first_call_delay)
        with md._cond:
            document = md._azure_document(time.time())
        self._send(endpoint, 200, json.dumps(document).encode(), "application/json; charset=utf-8")

    def _azure_start_requests(self, endpoint: str, query: dict[str, str]) -> None:
        try:
            requests = json.loads(self._body()).get("StartRequests")
            ids = [r["EventId"] for r in requests]
        except (ValueError, AttributeError, TypeError, KeyError):
            ids = []
        with self.md._cond:
            ok = self.md._start_events(ids)
        if ok:
            self._send(endpoint, 200, b"", "application/json; charset=utf-8")
        else:
            self._azure_error(endpoint, "Bad request. Invalid StartRequests")

    def _azure_vm_name(self, endpoint: str, query: dict[str, str]) -> None:
        if query.get("format") == "text":
            self._send(endpoint, 200, self.md.vm_name.encode(), "text/plain; charset=utf-8")
        else:
            self._send(endpoint, 200, json.dumps(self.md.vm_name).encode(), "application/json; charset=utf-8")

    def _azure_compute(self, endpoint: str, query: dict[str, str]) -> None:
        instance = self.md._instance
        if instance is None:
            self._azure_error(endpoint, "Not found")
            return
        document = {
            "name": self.md.vm_name,
            "vmSize": instance["instance_type"],
            "priority": "Spot" if instance["spot"] else "Regular",
            "zone": instance["zone"] or "",
            "location": instance["region"],
        }
        if instance.get("image"):
            document["storageProfile"] = {"imageReference": {"id": instance["image"]}}
        self._send(endpoint, 200, json.dumps(document).encode(), "application/json; charset=utf-8")

    def _azure_error(self, endpoint: str, message: str, extra: dict | None = None) -> None:
        self._send(
            endpoint, 400, json.dumps({"error": message, **(extra or {})}).encode(), "application/json; charset=utf-8"
        )


def _iso_z(ts: float) -> str:
    """2026-11-29T08:22:00Z, the form IMDS and GCP use for times."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _aws_date(ts: float) -> str:
    """'21 Jan 2019 09:00:43 GMT', the form of AWS scheduled events' NotBefore (the AWS docs' example)."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%d %b %Y %H:%M:%S GMT")
