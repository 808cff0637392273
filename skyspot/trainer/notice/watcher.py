"""The notice watcher's core: which cloud a node is on and where its metadata service answers, the
`Notice` a watcher delivers, the per-path threads with their backoff, and `Watcher`, which runs one
cloud's protocol (the module its class in skyspot/clouds/ names as `notice_watcher`:
skyspot/trainer/notice/aws.py, gcp.py, azure.py, each with `bind(w) -> Binding`). The core knows no
cloud by name: where to ask comes from the cloud's class, and a protocol's own state (Azure's VM name
and the events to approve) stays in its binding. The package's docstring
(skyspot/trainer/notice/__init__.py) says what a watcher sees and delivers.
"""

from __future__ import annotations

import atexit
import email.utils
import http.client
import importlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Mapping
from urllib.parse import urlsplit

from skyspot import clouds
from skyspot.clouds.base import endpoint_url

log = logging.getLogger(__name__)

# Notice windows, poll periods, endpoints and their override variables are cloud facts (skyspot/clouds/),
# shared with the CLI's window check and the local executor's metadata server.
SHORT_TIMEOUT_S = 2.0  # ours: the same for one-off reads (GCP upcoming-maintenance, Azure's VM name)
MAX_BACKOFF_S = 30.0  # ours: an unreachable endpoint is retried at least this often

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
    found = clouds.find(cloud)
    return found.name if found is not None else None


def _true(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() == "true"


def watch_target(env: Mapping[str, str] = os.environ) -> tuple[str, str] | None:
    """(cloud, base URL) the watcher would poll, or None when it would not run. Opens nothing.

    The override variable only redirects; it never turns a watcher on. Only SKYPILOT_CLUSTER_INFO
    naming the cloud does, so a laptop with GCE_METADATA_HOST set for other reasons stays quiet.
    """
    cloud = clouds.find(cloud_from_env(env))
    if cloud is None:
        return None
    override = cloud.metadata_override(env)
    if override:
        return cloud.name, endpoint_url(override)
    endpoint = cloud.metadata_endpoint(env)  # None: the cloud's SDK switch for "do not touch metadata"
    return (cloud.name, endpoint) if endpoint else None


def fallback_target(env: Mapping[str, str] = os.environ) -> str | None:
    """The address to use when the metadata host's name does not resolve (GCP's documented IP; no other
    cloud has one), or None. Opens nothing."""
    cloud = clouds.find(cloud_from_env(env))
    return cloud.metadata_fallback(env) if cloud is not None else None


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


def start_notice_watcher(
    on_notice: Callable[[Notice], None],
    on_warning: Callable[[Notice], None] | None = None,
    env: Mapping[str, str] = os.environ,
    poll_interval: float | None = None,
    lead: float | None = None,
) -> Watcher | None:
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
        on_warning=lambda n: target.request_checkpoint(
            n.source, n.action, None if n.action == "rebalance" else n.deadline
        ),
        env=env,
        poll_interval=poll_from_env(env),
    )


# -- HTTP ----------------------------------------------------------------------------------------


class _Unexpected(Exception):
    """The endpoint answered, but not with anything the protocol allows; retried like a network error."""


class _Stopped(Exception):
    """stop() was called while a request was being set up."""


_RETRYABLE = (OSError, http.client.HTTPException, _Unexpected, ValueError)


class MetadataHttp:
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

    def request(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        timeout: float,
        body: bytes | None = None,
        max_bytes: int | None = None,
    ) -> tuple[int, http.client.HTTPMessage, bytes]:
        """One request; `max_bytes`: a longer answer is a ValueError, never read whole."""
        try:
            return self._request(self.base, method, path, headers, timeout, body, max_bytes)
        except socket.gaierror:
            if self.fallback is None or self.base == self.fallback:
                raise
            log.info("metadata host %s does not resolve; using %s from now on", self.base[0], self.fallback[0])
            self.base = self.fallback
            return self._request(self.base, method, path, headers, timeout, body, max_bytes)

    def _request(
        self,
        base: tuple[str, int, str],
        method: str,
        path: str,
        headers: dict[str, str],
        timeout: float,
        body: bytes | None,
        max_bytes: int | None = None,
    ) -> tuple[int, http.client.HTTPMessage, bytes]:
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
            if max_bytes is None:
                return response.status, response.headers, response.read()
            data = response.read(max_bytes + 1)
            if len(data) > max_bytes:
                raise ValueError(f"{path} answered more than {max_bytes} bytes")
            return response.status, response.headers, data
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
            log.warning(
                "cannot reach %s metadata endpoint %s (%s: %s); retrying quietly, SIGTERM still triggers "
                "an emergency checkpoint",
                w.cloud,
                w.endpoint,
                self.name,
                error or type(error).__name__,
            )
        else:
            log.debug("%s metadata endpoint (%s): try %d failed: %r", w.cloud, self.name, self.failures, error)
        return min(self.interval * 2 ** (self.failures - 1), self.max_backoff)


@dataclass
class Binding:
    """One cloud's protocol bound to a watcher (what its module's `bind(w)` returns): the paths to watch,
    and the protocol's own hooks, so its state lives with it and not in the core."""

    paths: list[_Path]
    on_final: Callable[[Notice], None] | None = None
    """Called with the final notice before on_notice (Azure remembers the event to approve)."""
    on_stop: Callable[[], None] | None = None
    """Called on every stop(), once the threads have ended (Azure approves the events acted on); idempotent."""


class Watcher:
    """A running watcher: daemon threads watching one cloud's metadata endpoints. Call stop() when done."""

    def __init__(
        self,
        cloud: str,
        endpoint: str,
        on_notice: Callable[[Notice], None],
        on_warning: Callable[[Notice], None] | None,
        poll_interval: float | None,
        lead: float | None = None,
        env: Mapping[str, str] = os.environ,
    ):
        self.cloud = cloud
        self.endpoint = endpoint
        self.notice: Notice | None = None
        """The notice delivered to on_notice, once there is one."""
        self.warnings: list[Notice] = []
        """Every notice delivered to on_warning, in order."""
        self._on_notice = on_notice
        self._on_warning = on_warning
        self._poll = poll_interval
        facts = clouds.get(cloud)
        self._lead = float(lead) if lead is not None else facts.notice_window_s
        self._env = dict(env)
        self._http = MetadataHttp(endpoint, facts.metadata_fallback(env))
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._warned = False
        self._plans: dict[str, Notice] = {}
        """Planned shutdowns not yet due, by key: on_notice fires `lead` before the earliest."""
        self._warned_keys: set[str] = set()
        # The cloud's protocol, by the name its class binds: the core never imports a cloud's module
        # (each imports the core).
        self._binding: Binding = importlib.import_module(facts.notice_watcher).bind(self)
        self._paths = self._binding.paths
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

        Then the cloud's protocol finishes (`Binding.on_stop`): on Azure, events this watcher acted on
        (a Preempt, or a planned shutdown it turned into an exit) are approved with StartRequests when
        they name this VM alone: the checkpoint is made, so the platform need not wait for NotBefore.
        """
        self._done.set()
        with self._cond:
            self._cond.notify_all()
        self._http.abort()
        end = time.monotonic() + timeout
        for thread in [p.thread for p in self._paths] + [self._alarm]:
            if thread is not threading.current_thread() and thread.is_alive():
                thread.join(max(0.0, end - time.monotonic()))
        if self._binding.on_stop is not None:
            self._binding.on_stop()

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
        if self._binding.on_final is not None:
            self._binding.on_final(notice)
        if notice.kind == "preemption":
            log.warning(
                "preemption notice from %s: %s, deadline in %.0f s",
                notice.source,
                notice.action,
                notice.deadline - time.time(),
            )
        else:
            log.warning(
                "planned shutdown from %s (%s) is %.0f s away: emergency checkpoint, then exit for recovery",
                notice.source,
                notice.action,
                notice.deadline - time.time(),
            )
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
        log.warning(
            "%s warning from %s: %s %s",
            notice.kind,
            notice.source,
            notice.action,
            f"at {datetime.fromtimestamp(notice.deadline).isoformat(timespec='seconds')}"
            if notice.kind == "shutdown"
            else "(no shutdown expected)",
        )
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
                self._plans[key] = (
                    notice
                    if known is None
                    else Notice(
                        notice.source, notice.deadline, notice.action, known.received, notice.kind, notice.event_id
                    )
                )
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


def _http_date(value: object) -> float | None:
    """'Mon, 19 Sep 2016 18:29:47 GMT' (Azure) or '21 Jan 2019 09:00:43 GMT' (AWS) -> unix time;
    None when blank (an Azure event that has started) or unreadable."""
    if not isinstance(value, str) or not value.strip():
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
