"""A loopback stand-in for the three clouds' metadata services, as far as preemption notices go.

The local executor runs one per attempt and announces a simulated preemption here before it sends
SIGTERM, so the trainer learns of it exactly the way it would on a cloud VM: through the same paths,
headers, payloads and token flow. Tests use it the same way. One server speaks all three dialects:

    AWS    PUT /latest/api/token                                 IMDSv2 token (required: no token, 401)
           GET /latest/meta-data/spot/instance-action            404, or {"action", "time"}
           GET /latest/meta-data/spot/termination-time           404, or the time
           GET /latest/meta-data/events/recommendations/rebalance  404, or {"noticeTime"}
    GCP    GET /computeMetadata/v1/instance/preempted            FALSE/TRUE, ETag, wait_for_change
    Azure  GET /metadata/scheduledevents?api-version=...         {"DocumentIncarnation", "Events"}

    with MetadataServer() as server:
        env = {**os.environ, **server.env_for("aws"),
               "SKYPILOT_CLUSTER_INFO": json.dumps({"cloud": "AWS", ...})}
        ...
        server.announce_preemption(time.time() + 120)

Every other path answers 404 without the clouds' marker headers, so SDKs that probe for a metadata
service (boto3's credential chain, google-auth's GCE check) conclude there is none. stdlib only.
"""

from __future__ import annotations

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
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)

AWS_MAX_TOKEN_TTL_S = 21600  # IMDSv2 accepts 1..21600: https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html
GCP_DEFAULT_WAIT_S = 300  # ours: how long a hanging GET without timeout_sec waits before answering unchanged

# Endpoint names used by the request counters.
ROUTES = {
    ("PUT", "/latest/api/token"): "aws.token",
    ("GET", "/latest/meta-data/spot/instance-action"): "aws.instance_action",
    ("GET", "/latest/meta-data/spot/termination-time"): "aws.termination_time",
    ("GET", "/latest/meta-data/events/recommendations/rebalance"): "aws.rebalance",
    ("GET", "/computeMetadata/v1/instance/preempted"): "gcp.preempted",
    ("GET", "/metadata/scheduledevents"): "azure.scheduled_events",
}

ENV_VARS = {  # the names skyspot.trainer.notice reads (a test keeps them equal; no import of the trainer here)
    "aws": "AWS_EC2_METADATA_SERVICE_ENDPOINT",
    "gcp": "GCE_METADATA_HOST",
    "azure": "SKYSPOT_AZURE_METADATA_ENDPOINT",
}


class MetadataServer:
    """The three clouds' notice endpoints on one loopback port, plus controls to make notices appear.

    State is one "instance": nothing pending until announce_preemption(); reset() starts a fresh one.
    Requests are served thread-per-request, so a GCP hanging GET never blocks the others.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, vm_name: str = "skyspot-local-vm"):
        self._host = host
        self._port = port
        self.vm_name = vm_name
        self._cond = threading.Condition()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._requests: list[tuple[str, int]] = []
        self._tokens: dict[str, float] = {}
        self._reset_state()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> MetadataServer:
        """Bind and serve on a daemon thread; returns self."""
        httpd = _Server((self._host, self._port), _Handler)
        httpd.metadata = self
        self._httpd = httpd
        self._closing = False
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="skyspot-metadata-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, wake any hanging GET, and free the port."""
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
        """The variable that points cloud's watcher here; all three when cloud is None.

        Setting all three is harmless and is what the local executor does: whatever code looks for
        any cloud's metadata then finds this server, never a real address. It does not set
        SKYPILOT_CLUSTER_INFO, which says which cloud the node is on and is the executor's to write.
        """
        values = {"aws": self.url + "/", "gcp": self.host_port, "azure": self.url}
        if cloud is None:
            return {ENV_VARS[c]: v for c, v in values.items()}
        key = cloud.strip().lower()
        if key not in values:
            raise ValueError(f"unknown cloud {cloud!r}; expected one of aws, gcp, azure")
        return {ENV_VARS[key]: values[key]}

    # -- controls -----------------------------------------------------------------------------

    def announce_preemption(self, deadline_ts: float, action: str = "terminate") -> None:
        """Make all three clouds announce that this VM goes at deadline_ts (unix time).

        AWS: instance-action appears with `action`. GCP: preempted turns TRUE, waking hanging GETs.
        Azure: a Scheduled Event of type Preempt appears with NotBefore = deadline.
        """
        with self._cond:
            self._instance_action = {"action": action, "time": _iso_z(deadline_ts)}
            self._set_preempted(True)
            self._azure_events = [{
                "EventId": str(uuid.uuid4()).upper(),
                "EventType": "Preempt",
                "ResourceType": "VirtualMachine",
                "Resources": [self.vm_name],
                "EventStatus": "Scheduled",
                "NotBefore": email.utils.formatdate(deadline_ts, usegmt=True),
                "Description": "",
                "EventSource": "Platform",
                "DurationInSeconds": -1,
            }]
            self._incarnation += 1
            self._cond.notify_all()

    def recommend_rebalance(self, notice_ts: float | None = None) -> None:
        """AWS only: a rebalance recommendation appears (the other clouds have no equivalent here)."""
        with self._cond:
            self._rebalance = {"noticeTime": _iso_z(time.time() if notice_ts is None else notice_ts)}

    def reset(self) -> None:
        """Back to nothing pending, as on a freshly launched VM: notices gone, AWS tokens invalid. Counters stay."""
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
        """Requests served, optionally only to one endpoint ('aws.instance_action', ...) or with one status."""
        with self._cond:
            return sum(1 for e, s in self._requests
                       if (endpoint is None or e == endpoint) and (status is None or s == status))

    @property
    def counts(self) -> Counter[str]:
        """Requests per endpoint name so far ('other' for paths this server does not serve)."""
        with self._cond:
            return Counter(e for e, _ in self._requests)

    # -- internals (called with or by the handler) --------------------------------------------

    def _reset_state(self) -> None:
        self._instance_action: dict[str, str] | None = None
        self._rebalance: dict[str, str] | None = None
        self._preempted = False
        self._generation = getattr(self, "_generation", 0) + 1
        self._gcp_etag = self._etag_for(False)
        self._azure_events: list[dict[str, object]] = []
        self._incarnation = getattr(self, "_incarnation", 0) + 1

    def _etag_for(self, value: bool) -> str:
        return hashlib.sha1(f"{self._generation}:{value}".encode()).hexdigest()[:16]

    def _set_preempted(self, value: bool) -> None:
        if value != self._preempted:
            self._preempted = value
            self._gcp_etag = self._etag_for(value)

    def _record(self, endpoint: str, status: int) -> None:
        with self._cond:
            self._requests.append((endpoint, status))


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

    def _dispatch(self, method: str) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        endpoint = ROUTES.get((method, parts.path.rstrip("/") or "/"), "other")
        handler = getattr(self, "_" + endpoint.replace(".", "_"), None)
        if handler is None:
            self._send(endpoint, 404, b"Not Found", "text/plain")
        else:
            handler(endpoint, query)

    def _send(self, endpoint: str, status: int, body: bytes, content_type: str,
              headers: dict[str, str] | None = None) -> None:
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
        raw = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
        ttl = int(raw) if raw.strip().isdigit() else 0
        if not 1 <= ttl <= AWS_MAX_TOKEN_TTL_S:
            self._send(endpoint, 400, b"Bad Request", "text/plain")
            return
        token = secrets.token_urlsafe(32)
        with self.md._cond:
            self.md._tokens[token] = time.monotonic() + ttl
        self._send(endpoint, 200, token.encode(), "text/plain",
                   {"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)})

    def _aws_authorised(self, endpoint: str) -> bool:
        token = self.headers.get("X-aws-ec2-metadata-token", "")
        with self.md._cond:
            expires = self.md._tokens.get(token)
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

    # -- GCP ----------------------------------------------------------------------------------

    def _gcp_preempted(self, endpoint: str, query: dict[str, str]) -> None:
        if self.headers.get("Metadata-Flavor") != "Google":
            self._send(endpoint, 403, b"Missing Metadata-Flavor:Google header.", "text/html")
            return
        md = self.md
        with md._cond:
            if query.get("wait_for_change", "").lower() == "true":
                last = query.get("last_etag") or md._gcp_etag  # no last_etag: wait for the next change
                raw = query.get("timeout_sec", "")
                wait = int(raw) if raw.isdigit() and int(raw) > 0 else GCP_DEFAULT_WAIT_S
                md._cond.wait_for(lambda: md._gcp_etag != last or md._closing, timeout=wait)
            value, etag = md._preempted, md._gcp_etag
        self._send(endpoint, 200, b"TRUE" if value else b"FALSE", "application/text",
                   {"ETag": etag, "Metadata-Flavor": "Google"})

    # -- Azure --------------------------------------------------------------------------------

    def _azure_scheduled_events(self, endpoint: str, query: dict[str, str]) -> None:
        if self.headers.get("Metadata", "").lower() != "true":
            self._azure_error(endpoint, "Bad request. Required metadata header not specified")
        elif "api-version" not in query:
            self._azure_error(endpoint, "Bad request. api-version was not specified in the request")
        else:
            with self.md._cond:
                document = {"DocumentIncarnation": self.md._incarnation, "Events": list(self.md._azure_events)}
            self._send(endpoint, 200, json.dumps(document).encode(), "application/json; charset=utf-8")

    def _azure_error(self, endpoint: str, message: str) -> None:
        self._send(endpoint, 400, json.dumps({"error": message}).encode(), "application/json; charset=utf-8")


def _iso_z(ts: float) -> str:
    """2026-11-29T08:22:00Z, the form IMDS uses for times."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
