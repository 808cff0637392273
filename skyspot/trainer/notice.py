"""Preemption-notice watchers: learn from the cloud's metadata service that this VM is about to go.

A spot VM is told before it is taken away, through an endpoint only the VM itself can reach:

    AWS    GET /latest/meta-data/spot/instance-action        polled; 404 until a notice, then JSON
    GCP    GET /computeMetadata/v1/instance/preempted        a hanging GET that returns TRUE
    Azure  GET /metadata/scheduledevents                     polled; a "Preempt" event with NotBefore

The trainer starts one watcher per node and turns the callback into the same coordinated emergency
checkpoint that SIGTERM triggers; the notice only buys time, since correctness never depends on it.

    watcher = start_notice_watcher(on_notice=flag.set_from_notice)
    ...
    if watcher:
        watcher.stop()

Which cloud comes from SKYPILOT_CLUSTER_INFO, the JSON SkyPilot sets on every node, e.g.
{"cluster_name": "c1", "cloud": "AWS", "region": "us-east-1", "zone": "us-east-1a"}. Without a known
cloud the watcher does nothing at all: no thread, no socket. Each cloud's endpoint can be redirected
(the local executor and tests serve them on 127.0.0.1, see skyspot.metadata_server):

    AWS_EC2_METADATA_SERVICE_ENDPOINT   e.g. http://127.0.0.1:8123/   (the AWS SDKs' own variable)
    GCE_METADATA_HOST                   e.g. 127.0.0.1:8123            (Google's client libraries' own)
    SKYSPOT_AZURE_METADATA_ENDPOINT     e.g. http://127.0.0.1:8123     (ours; Azure SDKs have none)

Requests go through http.client rather than urllib, because urllib honours HTTP_PROXY and a
metadata request must never leave the machine. See docs/notices.md for payloads and sources.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Mapping
from urllib.parse import urlencode, urlsplit

log = logging.getLogger(__name__)

# Notice windows: how long between the notice and the VM going away.
AWS_NOTICE_WINDOW_S = 120.0  # "two minutes before": https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html
GCP_NOTICE_WINDOW_S = 30.0  # ACPI soft off, hard off 30 s later: https://cloud.google.com/compute/docs/instances/spot#preemption-process
AZURE_NOTICE_WINDOW_S = 30.0  # Preempt minimum notice: https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events#event-scheduling

# How often to ask.
AWS_POLL_S = 5.0  # "check for these interruption notices every 5 seconds" (the AWS page above)
AZURE_POLL_S = 1.0  # ours: a 30 s window, and the endpoint is local
GCP_RETRY_S = 1.0  # the Compute docs' sample retries a 503 after 1 s; the GET itself hangs
GCP_WAIT_TIMEOUT_S = 60  # timeout_sec of each hanging GET; reconnect with last_etag after it

AWS_TOKEN_TTL_S = 21600  # IMDSv2 maximum, 6 h: https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html
AWS_TOKEN_REFRESH_S = 60.0  # ours: fetch a new token this long before the old one expires
AWS_TIMEOUT_S = 2.0  # ours: IMDS is on the host, it answers in milliseconds or not at all
AZURE_TIMEOUT_S = 130.0  # first call may take "up to two minutes": the scheduled-events page above
AZURE_API_VERSION = "2020-07-01"  # https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events#version-and-region-availability
MAX_BACKOFF_S = 30.0  # ours: an unreachable endpoint is retried at least this often

ENDPOINT_VARS = {
    "aws": "AWS_EC2_METADATA_SERVICE_ENDPOINT",
    "gcp": "GCE_METADATA_HOST",
    "azure": "SKYSPOT_AZURE_METADATA_ENDPOINT",
}
DEFAULT_ENDPOINTS = {  # what a real VM of each cloud uses when no override is set
    "aws": "http://169.254.169.254",  # IMDS: https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instancedata-data-retrieval.html
    "gcp": "http://metadata.google.internal",  # https://cloud.google.com/compute/docs/metadata/querying-metadata
    "azure": "http://169.254.169.254",  # IMDS: https://learn.microsoft.com/azure/virtual-machines/instance-metadata-service
}

AWS_TOKEN_PATH = "/latest/api/token"
AWS_INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
AWS_REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
GCP_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
AZURE_EVENTS_PATH = "/metadata/scheduledevents"


@dataclass(frozen=True)
class Notice:
    """A cloud's announcement that this VM will be taken away (or, for a rebalance, is at risk)."""

    source: str
    """"aws", "gcp" or "azure"."""
    deadline: float
    """Unix time by which the VM may be gone: the cloud's own figure where it gives one, else
    received + that cloud's window."""
    action: str
    """What will happen: AWS "terminate", "stop" or "hibernate"; GCP and Azure "preempt"; an AWS
    rebalance recommendation "rebalance"."""
    received: float
    """Unix time this process saw the notice."""


def cloud_from_env(env: Mapping[str, str] = os.environ) -> str | None:
    """The cloud SKYPILOT_CLUSTER_INFO names: "aws", "gcp" or "azure"; None if unset, malformed or another cloud."""
    raw = env.get("SKYPILOT_CLUSTER_INFO")
    if not raw:
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        log.debug("SKYPILOT_CLUSTER_INFO is not JSON; no preemption-notice watcher")
        return None
    cloud = info.get("cloud") if isinstance(info, dict) else None
    if not isinstance(cloud, str):
        return None
    cloud = cloud.strip().lower()
    return cloud if cloud in ENDPOINT_VARS else None


def watch_target(env: Mapping[str, str] = os.environ) -> tuple[str, str] | None:
    """(cloud, base URL) the watcher would poll, or None when it would not run. Opens nothing.

    The override variable only redirects; it never turns a watcher on. Only SKYPILOT_CLUSTER_INFO
    naming the cloud does, so a laptop with GCE_METADATA_HOST set for other reasons stays quiet.
    """
    cloud = cloud_from_env(env)
    if cloud is None:
        return None
    override = env.get(ENDPOINT_VARS[cloud], "").strip()
    if not override:
        # The AWS SDKs' switch for "do not touch IMDS". An explicit endpoint (the local executor's
        # loopback server) still counts, since it is not the IMDS that switch guards.
        if cloud == "aws" and env.get("AWS_EC2_METADATA_DISABLED", "").strip().lower() == "true":
            return None
        return cloud, DEFAULT_ENDPOINTS[cloud]
    if "://" not in override:  # GCE_METADATA_HOST is host[:port], by Google's convention
        override = "http://" + override
    return cloud, override.rstrip("/")


def start_notice_watcher(on_notice: Callable[[Notice], None],
                         on_rebalance: Callable[[Notice], None] | None = None,
                         env: Mapping[str, str] = os.environ,
                         poll_interval: float | None = None) -> Watcher | None:
    """Watch this VM's cloud for a preemption notice on a daemon thread; None when there is no cloud to watch.

    on_notice is called once, from the watcher thread, with the first notice; the watcher then ends,
    since the VM is going away. on_rebalance (AWS only) is called once per rebalance recommendation
    and polling continues. Both callbacks should be quick (set a flag). poll_interval overrides the
    cloud's polling period (AWS, Azure) or retry delay (GCP); tests use a small one.
    """
    if poll_interval is not None and not poll_interval > 0:
        raise ValueError(f"poll_interval must be positive, got {poll_interval!r}")
    target = watch_target(env)
    if target is None:
        return None
    cloud, endpoint = target
    try:
        watcher = Watcher(cloud, endpoint, on_notice, on_rebalance, poll_interval)
    except ValueError as error:  # a malformed override must not stop training
        log.warning("not watching for preemption notices: %s", error)
        return None
    watcher._thread.start()  # only now, so a watcher that could not be built leaves no thread behind
    log.debug("watching %s metadata at %s for preemption notices", cloud, endpoint)
    return watcher


class _Unexpected(Exception):
    """The endpoint answered, but not with anything the protocol allows; retried like a network error."""


class _Http:
    """One request at a time to the metadata endpoint, abortable from another thread.

    abort() exists for GCP's hanging GET: shutting the socket down wakes the blocked read at once,
    so stop() returns promptly instead of after the hang's timeout.
    """

    def __init__(self, base_url: str):
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"metadata endpoint must be http://host[:port], got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._closed = False

    def request(self, method: str, path: str, headers: dict[str, str],
                timeout: float) -> tuple[int, http.client.HTTPMessage, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        with self._lock:
            if self._closed:
                raise _Stopped()
            self._conn = conn
        try:
            conn.connect()
            with self._lock:  # abort() may have run while we connected, before there was a socket
                if self._closed:
                    raise _Stopped()
            conn.request(method, self.prefix + path, headers=headers)
            response = conn.getresponse()
            return response.status, response.headers, response.read()
        finally:
            with self._lock:
                self._conn = None
            conn.close()

    def abort(self) -> None:
        with self._lock:
            self._closed = True
            sock = self._conn.sock if self._conn is not None else None
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class _Stopped(Exception):
    """stop() was called while a request was being set up."""


_RETRYABLE = (OSError, http.client.HTTPException, _Unexpected, ValueError)


class Watcher:
    """A running watcher: a daemon thread polling one cloud's metadata endpoint. Call stop() when done."""

    def __init__(self, cloud: str, endpoint: str, on_notice: Callable[[Notice], None],
                 on_rebalance: Callable[[Notice], None] | None, poll_interval: float | None):
        self.cloud = cloud
        self.endpoint = endpoint
        self.notice: Notice | None = None
        """The notice delivered, once there is one."""
        self._on_notice = on_notice
        self._on_rebalance = on_rebalance
        default = {"aws": AWS_POLL_S, "gcp": GCP_RETRY_S, "azure": AZURE_POLL_S}[cloud]
        self._interval = float(poll_interval) if poll_interval is not None else default
        self._max_backoff = max(self._interval, min(MAX_BACKOFF_S, 8 * self._interval))
        self._http = _Http(endpoint)
        self._stop = threading.Event()
        self._failures = 0
        self._warned = False
        self._thread = threading.Thread(target=self._run, name=f"skyspot-notice-{cloud}", daemon=True)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop watching; returns once the thread has ended or after `timeout` seconds (it is a daemon either way)."""
        self._stop.set()
        self._http.abort()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        poll = {"aws": _watch_aws, "gcp": _watch_gcp, "azure": _watch_azure}[self.cloud]
        try:
            poll(self)
        except _Stopped:
            pass
        except Exception:  # a bug here must not take the trainer down; SIGTERM still works
            log.exception("preemption-notice watcher for %s failed; notices will not be seen", self.cloud)

    def _sleep(self, seconds: float) -> bool:
        """Wait, waking early on stop(); True while the watcher should go on."""
        return not self._stop.wait(seconds)

    def _ok(self) -> None:
        if self._failures and self._warned:
            log.info("%s metadata endpoint %s answers again", self.cloud, self.endpoint)
        self._failures = 0

    def _failed(self, error: BaseException) -> float:
        """Note a failed request; return how long to wait before the next. Warns once per watcher, then stays quiet."""
        self._failures += 1
        if not self._warned:
            self._warned = True
            log.warning("cannot reach %s metadata endpoint %s (%s); retrying quietly, SIGTERM still triggers "
                        "an emergency checkpoint", self.cloud, self.endpoint, error or type(error).__name__)
        else:
            log.debug("%s metadata endpoint: try %d failed: %r", self.cloud, self._failures, error)
        return min(self._interval * 2 ** (self._failures - 1), self._max_backoff)

    def _deliver(self, notice: Notice) -> None:
        self.notice = notice
        log.warning("preemption notice from %s: %s, deadline in %.0f s", notice.source, notice.action,
                    notice.deadline - notice.received)
        try:
            self._on_notice(notice)
        except Exception:
            log.exception("on_notice callback failed")

    def _deliver_rebalance(self, notice: Notice) -> None:
        log.info("rebalance recommendation from %s: this spot VM is at elevated risk of interruption",
                 notice.source)
        try:
            self._on_rebalance(notice)  # type: ignore[misc]  # only polled when set
        except Exception:
            log.exception("on_rebalance callback failed")


# -- AWS: IMDSv2, polled ------------------------------------------------------------------------

def _watch_aws(w: Watcher) -> None:
    """Poll spot/instance-action (and the rebalance recommendation when asked) with an IMDSv2 token."""
    token: str | None = None
    token_expires = 0.0
    rebalances_seen: set[str] = set()

    def get(path: str) -> tuple[int, bytes]:
        nonlocal token, token_expires
        for attempt in (1, 2):
            if token is None or time.monotonic() > token_expires - AWS_TOKEN_REFRESH_S:
                asked = time.monotonic()
                status, _, body = w._http.request(
                    "PUT", AWS_TOKEN_PATH, {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)},
                    AWS_TIMEOUT_S)
                if status != 200 or not body:
                    raise _Unexpected(f"token PUT answered {status}")
                token, token_expires = body.decode().strip(), asked + AWS_TOKEN_TTL_S
            status, _, body = w._http.request("GET", path, {"X-aws-ec2-metadata-token": token}, AWS_TIMEOUT_S)
            if status != 401:
                return status, body
            token = None  # expired or from a previous instance; one fresh token, then give up
        raise _Unexpected("token rejected (401)")

    while not w._stop.is_set():
        delay = w._interval
        try:
            status, body = get(AWS_INSTANCE_ACTION_PATH)
            if status == 200:
                w._deliver(_aws_notice(body, time.time()))
                return
            if status != 404:
                raise _Unexpected(f"instance-action answered {status}")
            if w._on_rebalance is not None:
                status, body = get(AWS_REBALANCE_PATH)
                if status == 200 and body not in rebalances_seen:
                    rebalances_seen.add(body)
                    received = time.time()
                    # No deadline comes with it; the soonest a reclaim can land is a full notice away.
                    w._deliver_rebalance(Notice("aws", received + AWS_NOTICE_WINDOW_S, "rebalance", received))
                elif status not in (200, 404):
                    raise _Unexpected(f"rebalance answered {status}")
            w._ok()
        except _RETRYABLE as error:
            delay = w._failed(error)
        w._sleep(delay)


def _aws_notice(body: bytes, received: float) -> Notice:
    """Parse {"action": "terminate", "time": "2026-11-29T08:22:00Z"}. A 200 means a notice even if the body is odd."""
    action, deadline = "terminate", received + AWS_NOTICE_WINDOW_S
    try:
        doc = json.loads(body)
        action = str(doc.get("action") or action)
        deadline = datetime.fromisoformat(doc["time"].replace("Z", "+00:00")).timestamp()
    except (ValueError, KeyError, TypeError, AttributeError):
        log.warning("unreadable AWS instance-action %r; assuming a two-minute warning", body[:200])
    return Notice("aws", deadline, action, received)


# -- GCP: hanging GET on instance/preempted -------------------------------------------------------

def _watch_gcp(w: Watcher) -> None:
    """Hang on instance/preempted until it reads TRUE, reconnecting with last_etag after each timeout.

    Starting from last_etag=0 (as Google's own sample does) makes the first call return the current
    value at once, so a notice already pending when the watcher starts is not missed.
    """
    etag = "0"
    while not w._stop.is_set():
        query = urlencode({"wait_for_change": "true", "last_etag": etag, "timeout_sec": GCP_WAIT_TIMEOUT_S})
        try:
            status, headers, body = w._http.request(
                "GET", f"{GCP_PREEMPTED_PATH}?{query}", {"Metadata-Flavor": "Google"}, GCP_WAIT_TIMEOUT_S + 10)
            if status != 200:  # 503 during host maintenance is documented; retry it like a network error
                raise _Unexpected(f"instance/preempted answered {status}")
            etag = headers.get("ETag") or "0"
            w._ok()
            if body.strip().upper() == b"TRUE":
                received = time.time()
                w._deliver(Notice("gcp", received + GCP_NOTICE_WINDOW_S, "preempt", received))
                return
        except _RETRYABLE as error:
            if w._stop.is_set():
                return
            w._sleep(w._failed(error))


# -- Azure: Scheduled Events, polled -------------------------------------------------------------

def _watch_azure(w: Watcher) -> None:
    """Poll Scheduled Events for an event of type Preempt; other types (Freeze, Reboot, ...) are not ours.

    Every Preempt in the document counts, not only ones naming this VM: a VM in a shared availability
    set may see a neighbour's, and with ZeRO-3 any node's loss ends the step for all of them anyway.
    """
    path = f"{AZURE_EVENTS_PATH}?{urlencode({'api-version': AZURE_API_VERSION})}"
    while not w._stop.is_set():
        delay = w._interval
        try:
            status, _, body = w._http.request("GET", path, {"Metadata": "true"}, AZURE_TIMEOUT_S)
            if status != 200:
                raise _Unexpected(f"scheduledevents answered {status}")
            events = json.loads(body).get("Events") or []
            w._ok()
            for event in events:
                if isinstance(event, dict) and event.get("EventType") == "Preempt":
                    received = time.time()
                    deadline = _rfc1123(event.get("NotBefore")) or received + AZURE_NOTICE_WINDOW_S
                    w._deliver(Notice("azure", deadline, "preempt", received))
                    return
        except (*_RETRYABLE, AttributeError) as error:
            delay = w._failed(error)
        w._sleep(delay)


def _rfc1123(value: object) -> float | None:
    """'Mon, 19 Sep 2016 18:29:47 GMT' -> unix time; None when blank (the event has started) or unreadable."""
    if not isinstance(value, str) or not value.strip():
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
