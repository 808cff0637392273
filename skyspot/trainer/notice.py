"""Shutdown-warning watchers: learn from the cloud's metadata service that this VM is about to go.

One concept despite its length: three clouds' metadata protocols (IMDSv2 tokens, GCP's hanging GETs,
Azure's Scheduled Events and their approval) all answer the one question "when does this VM go?",
and share the thread, backoff and delivery machinery below; the clouds' published windows and poll
periods themselves live in skyspot/clouds.py.

A VM is told before it is taken away, through endpoints only the VM itself can reach:

    AWS    GET /latest/meta-data/spot/instance-action            spot interruption, 2 min ahead
           GET /latest/meta-data/events/recommendations/rebalance  elevated risk (no shutdown yet)
           GET /latest/meta-data/events/maintenance/scheduled    reboots, stops, retirements, days ahead
    GCP    GET /computeMetadata/v1/instance/preempted            hanging GET: TRUE on preemption (30 s)
           GET /computeMetadata/v1/instance/maintenance-event     hanging GET: TERMINATE_ON_HOST_MAINTENANCE
                                                                  an hour ahead on GPU VMs
    Azure  GET /metadata/scheduledevents                         Preempt (30 s), Reboot, Redeploy,
                                                                  Terminate, Freeze (10-15 min), for
                                                                  the VMs named in Resources

One watcher per node, started by the node's supervisor (supervise.py) before torchrun, so before
the trainer's setup and model load; a trainer started without the supervisor starts its own on the
node leader. Each warning is one of:

    preemption   the VM goes at `deadline` (AWS instance-action, GCP preempted, Azure Preempt):
                 on_notice, once; the trainer saves an emergency checkpoint and exits for recovery.
    shutdown     planned: the VM stops or restarts at `deadline`, minutes to days away (maintenance):
                 on_warning at once (the trainer checkpoints early and keeps training), then
                 on_notice `lead` seconds before the deadline, as for a preemption.
    warning      no shutdown expected (AWS rebalance, Azure Freeze, GCP live migration): on_warning.

    watcher = start_notice_watcher(on_notice=..., on_warning=...)
    ...
    if watcher:
        watcher.stop()          # on Azure, also approves the events acted on (StartRequests)

Which cloud comes from SKYPILOT_CLUSTER_INFO, the JSON SkyPilot sets on every node, e.g.
{"cluster_name": "c1", "cloud": "AWS", "region": "us-east-1", "zone": "us-east-1a"}. Without a known
cloud the watcher does nothing at all: no thread, no socket. Each cloud's endpoint can be redirected
(the local executor and tests serve them on 127.0.0.1, see skyspot.metadata_server), with the
variables the clouds' own SDKs read:

    AWS_EC2_METADATA_SERVICE_ENDPOINT        e.g. http://127.0.0.1:8123/   (botocore's; also
    AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE   IPv6 -> http://[fd00:ec2::254], AWS_EC2_METADATA_V1_DISABLED)
    GCE_METADATA_HOST (or GCE_METADATA_ROOT) e.g. 127.0.0.1:8123            (google-auth's; GCE_METADATA_IP
                                                                           is the fallback when DNS fails)
    SKYSPOT_AZURE_METADATA_ENDPOINT          e.g. http://127.0.0.1:8123     (ours; Azure's SDKs have none)

Every path is watched on its own thread with its own schedule and backoff, so one failing endpoint
never delays another. Requests go through http.client rather than urllib, because urllib honours
HTTP_PROXY and a metadata request must never leave the machine. See docs/notices.md for payloads,
timings and sources.
"""

from __future__ import annotations

import atexit
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

from skyspot.clouds import (AWS_NOTICE_WINDOW_S, AWS_POLL_S, AZURE_NOTICE_WINDOW_S, AZURE_POLL_S,
                            GCP_GPU_MAINTENANCE_NOTICE_S, GCP_MAINTENANCE_NOTICE_S, GCP_NOTICE_WINDOW_S,
                            NOTICE_WINDOWS_S)

log = logging.getLogger(__name__)

# Notice windows and poll periods are cloud facts (skyspot/clouds.py), shared with the CLI's window check.
AWS_MAINTENANCE_POLL_S = 60.0  # ours: scheduled events come days ahead ("at least 14 days" for most)
GCP_RETRY_S = 1.0  # the Compute docs' sample retries a 503 after 1 s; the GET itself hangs
GCP_WAIT_TIMEOUT_S = 60  # timeout_sec of each hanging GET; reconnect with last_etag after it

AWS_TOKEN_TTL_S = 21600  # IMDSv2 maximum, 6 h: https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html
AWS_TOKEN_REFRESH_S = 60.0  # ours: fetch a new token this long before the old one expires
AWS_TOKEN_TIMEOUT_S = 1.0  # botocore's DEFAULT_METADATA_SERVICE_TIMEOUT: an unanswered PUT means "use IMDSv1"
AWS_TOKEN_RETRY_S = 300.0  # ours: after falling back to IMDSv1, ask for a token again this often
AWS_TIMEOUT_S = 2.0  # ours: IMDS is on the host, it answers in milliseconds or not at all
SHORT_TIMEOUT_S = 2.0  # ours: the same for one-off reads (GCP upcoming-maintenance, Azure's VM name)
AZURE_FIRST_TIMEOUT_S = 130.0  # first call may take "up to two minutes": the scheduled-events page above
AZURE_TIMEOUT_S = 10.0  # ours: once Scheduled Events answered, a hung request must not blind us for minutes
AZURE_ACK_TIMEOUT_S = 2.0  # ours: approving events on the way out must not hold the exit up
AZURE_API_VERSION = "2020-07-01"  # https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events#version-and-region-availability
AZURE_INSTANCE_API_VERSION = "2021-02-01"  # compute/name with format=text: https://learn.microsoft.com/azure/virtual-machines/instance-metadata-service
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
AWS_IPV6_ENDPOINT = "http://[fd00:ec2::254]"  # botocore METADATA_BASE_URL_IPv6 (Nitro instances)
GCP_DEFAULT_IP = "169.254.169.254"  # google-auth's _GCE_DEFAULT_MDS_IP, overridable with GCE_METADATA_IP

AWS_TOKEN_PATH = "/latest/api/token"
AWS_INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
AWS_REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
AWS_MAINTENANCE_PATH = "/latest/meta-data/events/maintenance/scheduled"
GCP_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
GCP_MAINTENANCE_PATH = "/computeMetadata/v1/instance/maintenance-event"
GCP_UPCOMING_PATH = "/computeMetadata/v1/instance/upcoming-maintenance"
AZURE_EVENTS_PATH = "/metadata/scheduledevents"
AZURE_NAME_PATH = "/metadata/instance/compute/name"

# What each planned event means for a training job. A shutdown stops or restarts the VM; a warning
# leaves it running (a pause of seconds, a live migration, network maintenance).
AWS_SHUTDOWN_CODES = {"instance-reboot", "system-reboot", "instance-stop", "instance-retirement"}
AWS_WARNING_CODES = {"system-maintenance"}  # https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/monitoring-instances-status-check_sched.html
GCP_SHUTDOWN_EVENTS = {"TERMINATE_ON_HOST_MAINTENANCE", "SHUTDOWN_ON_HOST_MAINTENANCE"}
GCP_WARNING_EVENTS = {"MIGRATE_ON_HOST_MAINTENANCE"}
AZURE_SHUTDOWN_TYPES = {"Reboot", "Redeploy", "Terminate"}
AZURE_WARNING_TYPES = {"Freeze"}

KINDS = ("preemption", "shutdown", "warning")


@dataclass(frozen=True)
class Notice:
    """A cloud's warning that this VM will be taken away, stopped or restarted (or is at risk)."""

    source: str
    """"aws", "gcp" or "azure"."""
    deadline: float
    """Unix time by which the VM may be gone: the cloud's own figure where it gives one, else
    received + that cloud's window."""
    action: str
    """What will happen, in the cloud's words, lower case: AWS "terminate", "stop", "hibernate",
    "rebalance", or a scheduled event's code ("system-reboot", "instance-retirement", ...); GCP
    "preempt", "maintenance" or "migrate"; Azure "preempt", "reboot", "redeploy", "terminate", "freeze"."""
    received: float
    """Unix time this process first saw it."""
    kind: str = "preemption"
    """"preemption" (imminent), "shutdown" (planned, ahead of time) or "warning" (no shutdown expected)."""
    event_id: str | None = None
    """The cloud's id for a scheduled event (AWS, Azure), else None."""


# -- where to ask ---------------------------------------------------------------------------------

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


def _override(env: Mapping[str, str], cloud: str) -> str:
    value = env.get(ENDPOINT_VARS[cloud], "").strip()
    if not value and cloud == "gcp":
        value = env.get("GCE_METADATA_ROOT", "").strip()  # google-auth reads the old name second
    return value


def _as_url(value: str) -> str:
    if "://" not in value:  # GCE_METADATA_HOST and GCE_METADATA_IP are host[:port], by Google's convention
        value = "http://" + value
    return value.rstrip("/")


def _true(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() == "true"


def watch_target(env: Mapping[str, str] = os.environ) -> tuple[str, str] | None:
    """(cloud, base URL) the watcher would poll, or None when it would not run. Opens nothing.

    The override variable only redirects; it never turns a watcher on. Only SKYPILOT_CLUSTER_INFO
    naming the cloud does, so a laptop with GCE_METADATA_HOST set for other reasons stays quiet.
    """
    cloud = cloud_from_env(env)
    if cloud is None:
        return None
    override = _override(env, cloud)
    if override:
        return cloud, _as_url(override)
    # The AWS SDKs' switch for "do not touch IMDS". An explicit endpoint (the local executor's
    # loopback server) still counts, since it is not the IMDS that switch guards.
    if cloud == "aws" and _true(env, "AWS_EC2_METADATA_DISABLED"):
        return None
    if cloud == "aws" and _aws_ipv6(env):
        return cloud, AWS_IPV6_ENDPOINT
    return cloud, DEFAULT_ENDPOINTS[cloud]


def _aws_ipv6(env: Mapping[str, str]) -> bool:
    """botocore's resolve_imds_endpoint_mode: the mode variable, else AWS_IMDS_USE_IPV6; IPv4 by default."""
    mode = env.get("AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE", "").strip().lower()
    if mode:
        if mode not in ("ipv4", "ipv6"):
            log.warning("AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE=%r is neither IPv4 nor IPv6; using IPv4", mode)
            return False
        return mode == "ipv6"
    return _true(env, "AWS_IMDS_USE_IPV6")


def fallback_target(env: Mapping[str, str] = os.environ) -> str | None:
    """GCP only: the address to use when the metadata host's name does not resolve. Opens nothing.

    Google documents 169.254.169.254 beside metadata.google.internal, and google-auth pings
    GCE_METADATA_IP (default that address). With GCE_METADATA_HOST set and no GCE_METADATA_IP there
    is no fallback, so a redirected watcher never reaches a real address.
    """
    if cloud_from_env(env) != "gcp":
        return None
    ip = env.get("GCE_METADATA_IP", "").strip()
    if ip:
        return _as_url(ip)
    return None if _override(env, "gcp") else _as_url(GCP_DEFAULT_IP)


POLL_ENV = "SKYSPOT_NOTICE_POLL_SECONDS"  # the local executor's and the tests' poll period


def poll_from_env(env: Mapping[str, str] = os.environ) -> float | None:
    """POLL_ENV as a positive number of seconds; None (each cloud's own period) when unset or not one."""
    raw = env.get(POLL_ENV, "").strip()
    try:
        poll = float(raw) if raw else None
    except ValueError:
        log.warning("%s=%r is not a number of seconds; polling at each cloud's period", POLL_ENV, raw)
        return None
    return poll if poll is not None and poll > 0 else None


def start_notice_watcher(on_notice: Callable[[Notice], None],
                         on_warning: Callable[[Notice], None] | None = None,
                         env: Mapping[str, str] = os.environ,
                         poll_interval: float | None = None,
                         lead: float | None = None) -> Watcher | None:
    """Watch this VM's cloud for shutdown warnings on daemon threads; None when there is no cloud to watch.

    on_notice is called once, from a watcher thread, with the first preemption (or a planned
    shutdown, `lead` seconds before its deadline); the watcher then ends, since the VM is going
    away. on_warning is called once per planned event or rebalance recommendation, as soon as it
    is seen, and watching goes on; without it AWS's rebalance recommendation is not polled. Both
    should be quick (set a flag). poll_interval overrides every path's polling period (AWS,
    Azure) or retry delay (GCP); lead overrides the cloud's notice window as the time kept before
    a planned shutdown. Tests use small ones.
    """
    for name, value in (("poll_interval", poll_interval), ("lead", lead)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
    target = watch_target(env)
    if target is None:
        return None
    cloud, endpoint = target
    try:
        watcher = Watcher(cloud, endpoint, on_notice, on_warning, poll_interval, lead, env)
    except ValueError as error:  # a malformed override must not stop training
        log.warning("not watching for preemption notices: %s", error)
        return None
    watcher._start()  # only now, so a watcher that could not be built leaves no thread behind
    # A caller that fails before it can call stop() (the trainer's setup) still ends the threads
    # and approves what was acted on; stop() is idempotent.
    atexit.register(watcher.stop, 0.5)
    log.debug("watching %s metadata at %s for shutdown warnings", cloud, endpoint)
    return watcher


def watch_for(target, env: Mapping[str, str] = os.environ) -> Watcher | None:
    """Start this node's watcher, delivering to `target`: the trainer's PreemptionWatch (no supervisor)
    or the supervisor's NoticeFile (preemption.py), both with request_emergency(deadline, source,
    action) and request_checkpoint(source, action, deadline). A preemption, or a planned shutdown
    `lead` before its deadline, is an emergency; a warning is an early checkpoint (a rebalance
    recommendation carries no deadline of its own). Polls at POLL_ENV's period when set."""
    return start_notice_watcher(
        on_notice=lambda n: target.request_emergency(n.deadline, n.source, n.action),
        on_warning=lambda n: target.request_checkpoint(n.source, n.action,
                                                       None if n.action == "rebalance" else n.deadline),
        env=env, poll_interval=poll_from_env(env))


# -- HTTP ----------------------------------------------------------------------------------------

class _Unexpected(Exception):
    """The endpoint answered, but not with anything the protocol allows; retried like a network error."""


class _Stopped(Exception):
    """stop() was called while a request was being set up."""


_RETRYABLE = (OSError, http.client.HTTPException, _Unexpected, ValueError)


class _Http:
    """Requests to the metadata endpoint from several threads, all abortable from another.

    abort() exists for GCP's hanging GETs: shutting the sockets down wakes the blocked reads at
    once, so stop() returns promptly instead of after the hang's timeout. A fallback base is used
    from the first time the main host's name fails to resolve (GCP's documented IP).
    """

    def __init__(self, base_url: str, fallback: str | None = None):
        self.base = self._parse(base_url)
        self.fallback = self._parse(fallback) if fallback else None
        self._lock = threading.Lock()
        self._conns: set[http.client.HTTPConnection] = set()
        self._closed = False

    @staticmethod
    def _parse(url: str) -> tuple[str, int, str]:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"metadata endpoint must be http://host[:port], got {url!r}")
        return parts.hostname, parts.port or 80, parts.path.rstrip("/")

    def request(self, method: str, path: str, headers: dict[str, str], timeout: float,
                body: bytes | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
        try:
            return self._request(self.base, method, path, headers, timeout, body)
        except socket.gaierror:
            if self.fallback is None or self.base == self.fallback:
                raise
            log.info("metadata host %s does not resolve; using %s from now on", self.base[0], self.fallback[0])
            self.base = self.fallback
            return self._request(self.base, method, path, headers, timeout, body)

    def _request(self, base: tuple[str, int, str], method: str, path: str, headers: dict[str, str],
                 timeout: float, body: bytes | None) -> tuple[int, http.client.HTTPMessage, bytes]:
        host, port, prefix = base
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        with self._lock:
            if self._closed:
                raise _Stopped()
            self._conns.add(conn)
        try:
            conn.connect()
            with self._lock:  # abort() may have run while we connected, before there was a socket
                if self._closed:
                    raise _Stopped()
            conn.request(method, prefix + path, body=body, headers=headers)
            response = conn.getresponse()
            return response.status, response.headers, response.read()
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def abort(self) -> None:
        with self._lock:
            self._closed = True
            socks = [c.sock for c in self._conns if c.sock is not None]
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# -- the watcher ---------------------------------------------------------------------------------

class _Path:
    """One endpoint watched on its own thread: its own schedule, failures and backoff."""

    def __init__(self, watcher: Watcher, name: str, interval: float, step: Callable[[], float | None]):
        self.watcher = watcher
        self.name = name
        self.interval = interval
        self.max_backoff = max(interval, min(MAX_BACKOFF_S, 8 * interval))
        self.step = step
        """One request and what follows from it; returns the delay before the next (None: the interval)."""
        self.failures = 0
        self.thread = threading.Thread(target=self.run, name=f"skyspot-notice-{name}", daemon=True)

    def run(self) -> None:
        w = self.watcher
        try:
            while not w._done.is_set():
                try:
                    delay = self.step()
                    self._ok()
                except _RETRYABLE as error:
                    if w._done.is_set():
                        return
                    delay = self._failed(error)
                if delay is None:
                    delay = self.interval
                if delay > 0 and w._done.wait(delay):
                    return
        except _Stopped:
            pass
        except Exception:  # a bug here must not take the trainer down; SIGTERM still works
            log.exception("%s notice watcher (%s) failed; its warnings will not be seen", w.cloud, self.name)

    def _ok(self) -> None:
        if self.failures and self.watcher._warned:
            log.info("%s metadata endpoint %s answers again (%s)", self.watcher.cloud, self.watcher.endpoint, self.name)
        self.failures = 0

    def _failed(self, error: BaseException) -> float:
        """Note a failed request; return how long to wait before the next. One warning per watcher, then quiet."""
        self.failures += 1
        w = self.watcher
        with w._lock:
            first, w._warned = not w._warned, True
        if first:
            log.warning("cannot reach %s metadata endpoint %s (%s: %s); retrying quietly, SIGTERM still triggers "
                        "an emergency checkpoint", w.cloud, w.endpoint, self.name, error or type(error).__name__)
        else:
            log.debug("%s metadata endpoint (%s): try %d failed: %r", w.cloud, self.name, self.failures, error)
        return min(self.interval * 2 ** (self.failures - 1), self.max_backoff)


class Watcher:
    """A running watcher: daemon threads watching one cloud's metadata endpoints. Call stop() when done."""

    def __init__(self, cloud: str, endpoint: str, on_notice: Callable[[Notice], None],
                 on_warning: Callable[[Notice], None] | None, poll_interval: float | None,
                 lead: float | None = None, env: Mapping[str, str] = os.environ):
        self.cloud = cloud
        self.endpoint = endpoint
        self.notice: Notice | None = None
        """The notice delivered to on_notice, once there is one."""
        self.warnings: list[Notice] = []
        """Every notice delivered to on_warning, in order."""
        self._on_notice = on_notice
        self._on_warning = on_warning
        self._poll = poll_interval
        self._lead = float(lead) if lead is not None else NOTICE_WINDOWS_S[cloud]
        self._env = dict(env)
        self._http = _Http(endpoint, fallback_target(env) if cloud == "gcp" else None)
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._warned = False
        self._plans: dict[str, Notice] = {}
        """Planned shutdowns not yet due, by key: on_notice fires `lead` before the earliest."""
        self._warned_keys: set[str] = set()
        self._acked: list[dict] = []
        """Azure events acted on, to approve on the way out."""
        self._vm_name: str | None = None
        self._final_hook: Callable[[Notice], None] | None = None
        """Called with the final notice before on_notice (Azure remembers the event to approve)."""
        self._paths = {"aws": _aws_paths, "gcp": _gcp_paths, "azure": _azure_paths}[cloud](self)
        self._alarm = threading.Thread(target=self._alarm_loop, name=f"skyspot-notice-{cloud}-alarm", daemon=True)

    @property
    def failures(self) -> int:
        """Consecutive failed requests on the path failing most, 0 when all answer."""
        return max(p.failures for p in self._paths)

    def _start(self) -> None:
        for path in self._paths:
            path.thread.start()
        self._alarm.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop watching; returns once the threads have ended or after `timeout` seconds (they are daemons).

        On Azure, events this watcher acted on (a Preempt, or a planned shutdown it turned into an
        exit) are approved with StartRequests first, when they name this VM alone: the checkpoint is
        made, so the platform need not wait for NotBefore.
        """
        self._done.set()
        with self._cond:
            self._cond.notify_all()
        self._http.abort()
        end = time.monotonic() + timeout
        for thread in [p.thread for p in self._paths] + [self._alarm]:
            if thread is not threading.current_thread() and thread.is_alive():
                thread.join(max(0.0, end - time.monotonic()))
        if self._acked:
            _azure_approve(self)

    def is_alive(self) -> bool:
        return any(p.thread.is_alive() for p in self._paths)

    def _period(self, default: float) -> float:
        return float(self._poll) if self._poll is not None else default

    # -- delivering -----------------------------------------------------------------------------

    def _deliver(self, notice: Notice) -> None:
        """The one final notice: on_notice, then every thread ends."""
        with self._cond:
            if self.notice is not None:
                return
            self.notice = notice
            self._done.set()
            self._cond.notify_all()
        self._http.abort()  # wake the other paths' hanging GETs; their work is done
        if self._final_hook is not None:
            self._final_hook(notice)
        if notice.kind == "preemption":
            log.warning("preemption notice from %s: %s, deadline in %.0f s", notice.source, notice.action,
                        notice.deadline - time.time())
        else:
            log.warning("planned shutdown from %s (%s) is %.0f s away: emergency checkpoint, then exit for recovery",
                        notice.source, notice.action, notice.deadline - time.time())
        try:
            self._on_notice(notice)
        except Exception:
            log.exception("on_notice callback failed")

    def _warn(self, key: str, notice: Notice) -> None:
        """on_warning once per key (a rebalance recommendation, a planned event)."""
        with self._lock:
            if key in self._warned_keys or self._done.is_set():
                return
            self._warned_keys.add(key)
            self.warnings.append(notice)
        log.warning("%s warning from %s: %s %s", notice.kind, notice.source, notice.action,
                    f"at {datetime.fromtimestamp(notice.deadline).isoformat(timespec='seconds')}"
                    if notice.kind == "shutdown" else "(no shutdown expected)")
        if self._on_warning is None:
            return
        try:
            self._on_warning(notice)
        except Exception:
            log.exception("on_warning callback failed")

    def _plan(self, key: str, notice: Notice) -> None:
        """A planned shutdown: warn now; on_notice `lead` seconds before its deadline, unless cancelled."""
        self._warn(key, notice)
        with self._cond:
            known = self._plans.get(key)
            if known is None or known.deadline != notice.deadline:
                self._plans[key] = notice if known is None else Notice(
                    notice.source, notice.deadline, notice.action, known.received, notice.kind, notice.event_id)
                self._cond.notify_all()

    def _cancel(self, key: str) -> None:
        with self._cond:
            notice = self._plans.pop(key, None)
            if notice is not None:
                self._cond.notify_all()
        if notice is not None:
            log.info("planned %s from %s is off (cancelled or done)", notice.action, notice.source)

    def _planned_keys(self, prefix: str) -> set[str]:
        with self._lock:
            return {k for k in self._plans if k.startswith(prefix)}

    def _alarm_loop(self) -> None:
        with self._cond:
            while not self._done.is_set():
                due = min(self._plans.items(), key=lambda kv: kv[1].deadline, default=None)
                wait = None if due is None else due[1].deadline - self._lead - time.time()
                if wait is not None and wait <= 0:
                    notice = due[1]
                    break
                self._cond.wait(wait)
            else:
                return
        self._deliver(notice)


# -- AWS: IMDS, three paths polled ----------------------------------------------------------------

class _AwsSession:
    """IMDSv2 tokens shared by the AWS paths, falling back to IMDSv1 as botocore does.

    botocore (utils.IMDSFetcher._fetch_metadata_token) asks for a token with a 1 s timeout; if the
    PUT times out, cannot connect, or is answered 403, 404 or 405, it sends the GET without a token.
    That is what saves a container behind the default hop limit of 1, where the PUT's answer never
    arrives. AWS_EC2_METADATA_V1_DISABLED=true forbids the fallback. Here the fallback lasts until a
    tokenless GET is refused (401: the instance requires IMDSv2) or AWS_TOKEN_RETRY_S has passed.
    """

    def __init__(self, w: Watcher):
        self.w = w
        self.lock = threading.Lock()
        self.token: str | None = None
        self.expires = 0.0
        self.v1_until = 0.0
        self.v1_allowed = not _true(w._env, "AWS_EC2_METADATA_V1_DISABLED")

    def _headers(self) -> dict[str, str]:
        """Token headers for the next GET ({} in IMDSv1 mode). Fetches a token when needed."""
        with self.lock:
            now = time.monotonic()
            if self.token is not None and now < self.expires - AWS_TOKEN_REFRESH_S:
                return {"X-aws-ec2-metadata-token": self.token}
            if now < self.v1_until:
                return {}
            try:
                status, _, body = self.w._http.request(
                    "PUT", AWS_TOKEN_PATH, {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)},
                    AWS_TOKEN_TIMEOUT_S)
            except _Stopped:
                raise
            except (OSError, http.client.HTTPException) as error:  # timed out, refused, reset: no answer
                return self._no_token(f"no answer ({error or type(error).__name__})")
            if status == 200 and body:
                self.token, self.expires = body.decode().strip(), now + AWS_TOKEN_TTL_S
                return {"X-aws-ec2-metadata-token": self.token}
            if status in (403, 404, 405):
                return self._no_token(f"answered {status}")
            raise _Unexpected(f"token PUT answered {status}")

    def _no_token(self, why: str) -> dict[str, str]:
        if not self.v1_allowed:
            raise _Unexpected(f"IMDSv2 token PUT: {why}, and AWS_EC2_METADATA_V1_DISABLED forbids IMDSv1")
        log.info("IMDSv2 token PUT: %s; asking without a token (IMDSv1), as botocore does", why)
        self.v1_until = time.monotonic() + AWS_TOKEN_RETRY_S
        return {}

    def get(self, path: str) -> tuple[int, bytes]:
        for _ in (1, 2):
            headers = self._headers()
            status, _, body = self.w._http.request("GET", path, headers, AWS_TIMEOUT_S)
            if status != 401:
                return status, body
            with self.lock:  # expired, from a previous instance, or IMDSv2 required: one fresh try
                if not headers:
                    self.v1_until = 0.0
                elif self.token == headers["X-aws-ec2-metadata-token"]:
                    self.token = None  # (another path may have replaced it already)
        raise _Unexpected("IMDS refused the request (401)")


def _aws_paths(w: Watcher) -> list[_Path]:
    session = _AwsSession(w)
    rebalances_seen: set[bytes] = set()

    def instance_action() -> None:
        status, body = session.get(AWS_INSTANCE_ACTION_PATH)
        if status == 200:
            w._deliver(_aws_notice(body, time.time()))
        elif status != 404:
            raise _Unexpected(f"instance-action answered {status}")

    def rebalance() -> None:
        status, body = session.get(AWS_REBALANCE_PATH)
        if status == 200 and body not in rebalances_seen:
            rebalances_seen.add(body)
            received = time.time()
            # No deadline comes with it; the soonest a reclaim can land is a full notice away.
            w._warn(f"rebalance:{body!r}", Notice("aws", received + AWS_NOTICE_WINDOW_S, "rebalance", received,
                                                  "warning"))
        elif status not in (200, 404):
            raise _Unexpected(f"rebalance answered {status}")

    def maintenance() -> None:
        status, body = session.get(AWS_MAINTENANCE_PATH)
        if status == 404:
            events = []
        elif status == 200:
            events = json.loads(body or b"[]")
            if not isinstance(events, list):
                raise _Unexpected("scheduled events are not a list")
        else:
            raise _Unexpected(f"scheduled events answered {status}")
        received, active = time.time(), set()
        for event in events:
            if not isinstance(event, dict) or str(event.get("State", "active")).lower() != "active":
                continue
            code, event_id = str(event.get("Code", "")).lower(), str(event.get("EventId", ""))
            key = f"aws:{event_id or code}"
            deadline = _http_date(event.get("NotBefore")) or received + AWS_NOTICE_WINDOW_S
            if code in AWS_SHUTDOWN_CODES:
                active.add(key)
                w._plan(key, Notice("aws", deadline, code, received, "shutdown", event_id or None))
            elif code in AWS_WARNING_CODES:
                w._warn(key, Notice("aws", deadline, code, received, "warning", event_id or None))
        for key in w._planned_keys("aws:") - active:
            w._cancel(key)

    paths = [_Path(w, "aws-instance-action", w._period(AWS_POLL_S), instance_action)]
    if w._on_warning is not None:
        paths.append(_Path(w, "aws-rebalance", w._period(AWS_POLL_S), rebalance))
    paths.append(_Path(w, "aws-maintenance", w._period(AWS_MAINTENANCE_POLL_S), maintenance))
    return paths


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


# -- GCP: hanging GETs on instance/preempted and instance/maintenance-event -----------------------

def _gcp_paths(w: Watcher) -> list[_Path]:
    gpus = w._env.get("SKYPILOT_NUM_GPUS_PER_NODE", "").strip()
    maintenance_notice = GCP_GPU_MAINTENANCE_NOTICE_S if gpus not in ("", "0") else GCP_MAINTENANCE_NOTICE_S
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
            w._warn(f"gcp:migrate:{received}", Notice("gcp", received + GCP_MAINTENANCE_NOTICE_S, "migrate", received,
                                                      "warning"))
        elif value == "NONE":
            for key in w._planned_keys("gcp:"):
                w._cancel(key)
        else:
            log.warning("unknown GCP maintenance-event %r; treating it as a planned shutdown", value)
            planned[0] += 1
            w._plan(f"gcp:maintenance:{planned[0]}", Notice("gcp", received + maintenance_notice, "maintenance",
                                                            received, "shutdown"))

    interval = w._period(GCP_RETRY_S)
    return [_Path(w, "gcp-preempted", interval, _gcp_hanging(w, GCP_PREEMPTED_PATH, preempted, interval)),
            _Path(w, "gcp-maintenance-event", interval, _gcp_hanging(w, GCP_MAINTENANCE_PATH, maintenance, interval))]


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
        status, headers, body = w._http.request("GET", f"{path}?{query}", {"Metadata-Flavor": "Google"},
                                                GCP_WAIT_TIMEOUT_S + 10)
        if status != 200:  # 503 during host maintenance is documented; retry it like a network error
            raise _Unexpected(f"{path.rsplit('/', 1)[-1]} answered {status}")
        on_value(body.decode(errors="replace").strip())
        etag = headers.get("ETag")
        if not etag:
            if not state["complained"]:
                state["complained"] = True
                log.warning("GCP metadata answered %s without an ETag; asking every %.1f s instead of hanging",
                            path, interval)
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


# -- Azure: Scheduled Events, polled ---------------------------------------------------------------

def _azure_paths(w: Watcher) -> list[_Path]:
    """Poll Scheduled Events for events naming this VM in Resources.

    Events go to every VM of an availability set or scale-set placement group, so only those whose
    Resources name this VM (compute/name from instance metadata) count. Until the name is known
    (instance metadata not answering) every event counts: a needless checkpoint beats a lost one.
    """
    events_path = f"{AZURE_EVENTS_PATH}?{urlencode({'api-version': AZURE_API_VERSION})}"
    name_path = f"{AZURE_NAME_PATH}?{urlencode({'api-version': AZURE_INSTANCE_API_VERSION, 'format': 'text'})}"
    state = {"answered": False, "name_tries": 0}
    seen: dict[str, dict] = {}  # EventId -> the event as last seen, to approve the one acted on
    w._final_hook = lambda notice: _azure_acted(w, seen.get(notice.event_id or ""), w._vm_name)

    def vm_name() -> str | None:
        if w._vm_name is None:
            state["name_tries"] += 1
            try:
                status, _, body = w._http.request("GET", name_path, {"Metadata": "true"}, SHORT_TIMEOUT_S)
                if status == 200 and body.strip():
                    w._vm_name = body.decode().strip().strip('"')
                    log.debug("Azure VM name: %s", w._vm_name)
                elif state["name_tries"] == 1:
                    log.warning("Azure instance metadata did not give this VM's name (%s); every scheduled "
                                "event counts as ours until it does", status)
            except (OSError, http.client.HTTPException) as error:
                if state["name_tries"] == 1:
                    log.warning("Azure instance metadata did not give this VM's name (%s); every scheduled "
                                "event counts as ours until it does", error)
        return w._vm_name

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
                w._deliver(Notice("azure", not_before or received + AZURE_NOTICE_WINDOW_S, etype.lower(),
                                  received, "preemption" if etype == "Preempt" else "shutdown", event_id or None))
                return
            if etype in AZURE_SHUTDOWN_TYPES:
                current.add(key)
                w._plan(key, Notice("azure", not_before or received + AZURE_NOTICE_WINDOW_S, etype.lower(),
                                    received, "shutdown", event_id or None))
            elif etype in AZURE_WARNING_TYPES and not started:
                w._warn(key, Notice("azure", not_before or received, etype.lower(), received, "warning",
                                    event_id or None))
        for key in w._planned_keys("azure:") - current:
            w._cancel(key)

    return [_Path(w, "azure-scheduled-events", w._period(AZURE_POLL_S), step)]


def _names_us(event: dict, name: str | None) -> bool:
    resources = event.get("Resources")
    if name is None or not isinstance(resources, list) or not resources:
        return True
    return any(isinstance(r, str) and r.strip().lower() == name.lower() for r in resources)


def _azure_acted(w: Watcher, event: dict | None, name: str | None) -> None:
    """Remember an event we are about to act on, to approve it on the way out if it is ours alone.

    Approving lets an event proceed for every VM in its Resources (the Azure page above), so an
    event that also names other VMs is left to them and to NotBefore.
    """
    resources = event.get("Resources") if event else None
    if (name is not None and isinstance(resources, list) and len(resources) == 1
            and str(resources[0]).strip().lower() == name.lower() and event and event.get("EventId")):
        w._acked.append(event)


def _azure_approve(w: Watcher) -> None:
    """POST StartRequests for the events acted on; errors are logged, never raised."""
    ids = [e["EventId"] for e in w._acked]
    w._acked = []
    path = f"{AZURE_EVENTS_PATH}?{urlencode({'api-version': AZURE_API_VERSION})}"
    body = json.dumps({"StartRequests": [{"EventId": i} for i in ids]}).encode()
    end = time.monotonic() + AZURE_ACK_TIMEOUT_S
    status: object = None
    while True:
        try:
            status, _, _ = _Http(w.endpoint).request(
                "POST", path, {"Metadata": "true", "Content-Type": "application/json"},
                max(0.1, end - time.monotonic()), body)
        except Exception as error:  # the exit goes on; the event starts at NotBefore anyway
            status = repr(error)
        if status == 200:
            log.info("approved Azure scheduled event(s) %s: the checkpoint is made, no need to wait", ", ".join(ids))
            return
        if status not in (429, 500, 502, 503, 504) or time.monotonic() + 0.25 > end:
            break
        time.sleep(0.25)  # throttled (5 requests a second) or busy: once more while the budget lasts
    log.warning("could not approve Azure scheduled event(s) %s (%s); they start at NotBefore", ", ".join(ids), status)


def _http_date(value: object) -> float | None:
    """'Mon, 19 Sep 2016 18:29:47 GMT' (Azure) or '21 Jan 2019 09:00:43 GMT' (AWS) -> unix time;
    None when blank (an Azure event that has started) or unreadable."""
    if not isinstance(value, str) or not value.strip():
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None

