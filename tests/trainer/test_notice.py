"""Shutdown-warning watchers against the loopback metadata server, one cloud dialect at a time.

Every test in this module runs with outbound connections and name lookups fenced to 127.0.0.1:
anything else fails loudly, so a watcher that reached for a real metadata address would be caught.
Names under `.invalid` (reserved, RFC 2606) fail to resolve inside the fence, as a broken DNS
would, and never reach a resolver.

The server is as strict as the clouds (tokens, hop limit, api-versions, rate limit, ETags, hanging
GETs, Resources, first-call delay); a few tests run the same scenario through botocore's IMDS
fetcher and google-auth's metadata client to show the server behaves as the real services do.
Timings are asserted as poll counts or ratios measured in the same run, never as tight
wall-clock bounds.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from skyspot.executors.local import metadata_server as ms
from skyspot.executors.local.metadata_server import MetadataServer
from skyspot.ports import free_port
from skyspot import clouds
from skyspot.trainer.notice import aws as notice_aws
from skyspot.trainer.notice import gcp as notice_gcp
from skyspot.trainer.notice.watcher import MetadataHttp
from skyspot.trainer.notice import Notice, fallback_target, start_notice_watcher, watch_target

POLL = 0.05
AZURE_POLL = 0.3  # Azure IMDS answers 429 above 5 requests a second; stay under it, as a VM must
CLOUDS = ["aws", "gcp", "azure"]
CLOUD_NAMES = {"aws": "AWS", "gcp": "GCP", "azure": "Azure"}  # as SkyPilot's str(cloud) spells them


def poll_for(cloud: str) -> float:
    return AZURE_POLL if cloud == "azure" else POLL


# -- the fence -------------------------------------------------------------------------------

_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex
_real_getaddrinfo = socket.getaddrinfo
_LOOPBACK = {"127.0.0.1", "localhost"}


class Fence:
    """Connections opened during a test, names looked up, and any attempt to reach beyond 127.0.0.1."""

    def __init__(self):
        self.opened: list[tuple[str, int]] = []
        self.unresolved: list[str] = []
        self.violations: list[str] = []

    def check(self, what: str, host: object) -> None:
        if host not in _LOOPBACK:
            self.violations.append(f"{what} {host!r}")
            raise AssertionError(f"test tried to {what} {host!r}; only 127.0.0.1 is allowed")


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """Every TCP connect and name lookup in this module must be 127.0.0.1; record the connects.

    Violations also fail the test at teardown, since one raised inside a watcher thread would be
    caught and logged there rather than reach pytest.
    """
    fence = Fence()

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            fence.check("connect to", address[0])
            fence.opened.append(tuple(address[:2]))
        return _real_connect(sock, address)

    def connect_ex(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            fence.check("connect to", address[0])
            fence.opened.append(tuple(address[:2]))
        return _real_connect_ex(sock, address)

    def getaddrinfo(host, *args, **kwargs):
        if isinstance(host, str) and host.endswith(".invalid"):
            fence.unresolved.append(host)
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        fence.check("resolve", host)
        return _real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield fence
    assert fence.violations == [], "a test reached beyond 127.0.0.1"


def test_the_fence_stops_real_metadata_addresses(loopback_only):
    for host in ("169.254.169.254", "metadata.google.internal"):
        with pytest.raises(AssertionError):
            socket.create_connection((host, 80), timeout=0.1)
    assert len(loopback_only.violations) == 2
    loopback_only.violations.clear()
    with pytest.raises(socket.gaierror):  # a broken DNS, played without asking one
        socket.create_connection(("metadata.invalid", 80), timeout=0.1)
    assert loopback_only.violations == [] and loopback_only.unresolved == ["metadata.invalid"]


# -- helpers ---------------------------------------------------------------------------------


@pytest.fixture
def server():
    with MetadataServer() as srv:
        yield srv


def cluster_info(cloud: str) -> str:
    """SKYPILOT_CLUSTER_INFO as SkyPilot 0.14 writes it (sky/backends/cloud_vm_ray_backend.py)."""
    return json.dumps({"cluster_name": "sky-test", "cloud": cloud, "region": "r1", "zone": "r1-a"})


def env_for(srv: MetadataServer, cloud: str, **extra: str) -> dict[str, str]:
    return {"SKYPILOT_CLUSTER_INFO": cluster_info(CLOUD_NAMES[cloud]), **srv.env_for(cloud), **extra}


class Recorder:
    """Collects callbacks from the watcher threads, with the time each came."""

    def __init__(self):
        self.notices: list[Notice] = []
        self.warnings: list[Notice] = []
        self.notice_at: list[float] = []
        self.got_notice = threading.Event()
        self.got_warning = threading.Event()

    def on_notice(self, n: Notice) -> None:
        self.notice_at.append(time.time())
        self.notices.append(n)
        self.got_notice.set()

    def on_warning(self, n: Notice) -> None:
        self.warnings.append(n)
        self.got_warning.set()


@pytest.fixture
def watchers():
    started = []
    yield started
    for w in started:
        w.stop()


def watch(srv, cloud, rec, watchers, warnings=False, env_extra=None, **kwargs):
    kwargs.setdefault("poll_interval", poll_for(cloud))
    w = start_notice_watcher(
        rec.on_notice, rec.on_warning if warnings else None, env=env_for(srv, cloud, **(env_extra or {})), **kwargs
    )
    assert w is not None
    watchers.append(w)
    return w


def wait_until(predicate, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def request(srv, method, path, headers=None, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", int(srv.host_port.rsplit(":", 1)[1]), timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.headers), response.read()
    finally:
        conn.close()


MAIN_ENDPOINT = {"aws": "aws.instance_action", "gcp": "gcp.preempted", "azure": "azure.scheduled_events"}


def settle(srv: MetadataServer, cloud: str, polls: int = 3) -> None:
    """Let the watcher ask `polls` more times (AWS, Azure), or get its first answers and hang again (GCP)."""
    if cloud == "gcp":
        # GCP answers each path once at once and then hangs, so count from 0.
        assert wait_until(lambda: srv.count("gcp.preempted") >= 1 and srv.count("gcp.maintenance_event") >= 1)
        time.sleep(0.1)  # the next GETs are now hanging
        return
    endpoint = MAIN_ENDPOINT[cloud]
    target = srv.count(endpoint) + polls
    assert wait_until(lambda: srv.count(endpoint) >= target)


# -- which cloud, which endpoint -------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        None,
        "",
        "not json",
        "[]",
        '{"cloud": "Kubernetes"}',
        '{"cloud": "Lambda", "region": "us-east-1"}',
        '{"region": "x"}',
    ],
)
def test_unknown_or_unset_cloud_starts_nothing(server, loopback_only, raw):
    env = {**server.env_for(None)}  # every override set: still nothing, the cloud decides
    if raw is not None:
        env["SKYPILOT_CLUSTER_INFO"] = raw
    threads_before = set(threading.enumerate())

    assert start_notice_watcher(lambda n: None, env=env, poll_interval=POLL) is None

    time.sleep(2 * POLL)
    assert set(threading.enumerate()) - threads_before == set()  # no thread started
    assert loopback_only.opened == []
    assert server.count() == 0


@pytest.mark.parametrize("name", ["AWS", "aws", "Aws", " AWS "])
def test_cloud_name_is_case_insensitive(name):
    assert watch_target({"SKYPILOT_CLUSTER_INFO": json.dumps({"cloud": name})}) == ("aws", "http://169.254.169.254")


def test_known_cloud_without_override_targets_the_real_address_but_tests_never_start_it():
    # On a real VM this is right; here we only inspect the target and never start a watcher.
    assert watch_target({"SKYPILOT_CLUSTER_INFO": cluster_info("GCP")}) == ("gcp", "http://metadata.google.internal")
    assert watch_target({"SKYPILOT_CLUSTER_INFO": cluster_info("Azure")}) == ("azure", "http://169.254.169.254")


def test_overrides_redirect_each_cloud(server):
    for cloud in CLOUDS:
        assert watch_target(env_for(server, cloud)) == (cloud, server.url)
    # google-auth reads GCE_METADATA_HOST, then its old name GCE_METADATA_ROOT
    assert watch_target({"SKYPILOT_CLUSTER_INFO": cluster_info("GCP"), "GCE_METADATA_ROOT": server.host_port}) == (
        "gcp",
        server.url,
    )


def test_aws_metadata_disabled_guards_the_real_imds_but_not_an_explicit_endpoint(server):
    disabled = {"SKYPILOT_CLUSTER_INFO": cluster_info("AWS"), "AWS_EC2_METADATA_DISABLED": "true"}
    assert watch_target(disabled) is None
    assert watch_target({**disabled, **server.env_for("aws")}) == ("aws", server.url)


def test_malformed_override_is_a_warning_not_a_crash(caplog):
    env = {"SKYPILOT_CLUSTER_INFO": cluster_info("AWS"), "AWS_EC2_METADATA_SERVICE_ENDPOINT": "https://x"}
    with caplog.at_level(logging.WARNING):
        assert start_notice_watcher(lambda n: None, env=env) is None
    assert "not watching" in caplog.text


@pytest.mark.parametrize(
    "extra",
    [
        {"AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE": "IPv6"},
        {"AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE": "ipv6"},
        {"AWS_IMDS_USE_IPV6": "true"},
    ],
)
def test_aws_ipv6_mode_targets_the_ipv6_imds_as_botocore_does(extra):
    from botocore.utils import IMDSFetcher

    env = {"SKYPILOT_CLUSTER_INFO": cluster_info("AWS"), **extra}
    assert watch_target(env) == ("aws", "http://[fd00:ec2::254]")
    botocore_url = IMDSFetcher(config={"ec2_metadata_service_endpoint_mode": "ipv6"}).get_base_url()
    assert watch_target(env)[1] == botocore_url.rstrip("/")  # the same address, no connection made
    assert MetadataHttp(watch_target(env)[1]).base == ("fd00:ec2::254", 80, "")  # an IPv6 literal is usable


def test_aws_explicit_endpoint_wins_over_ipv6_mode_and_a_bad_mode_means_ipv4(server, caplog):
    ipv6 = {"SKYPILOT_CLUSTER_INFO": cluster_info("AWS"), "AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE": "IPv6"}
    assert watch_target({**ipv6, "AWS_EC2_METADATA_SERVICE_ENDPOINT": server.url + "/"}) == ("aws", server.url)
    with caplog.at_level(logging.WARNING):
        bad = {**ipv6, "AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE": "ipv5"}
        assert watch_target(bad) == ("aws", "http://169.254.169.254")
    assert "neither IPv4 nor IPv6" in caplog.text


def test_gcp_fallback_is_the_documented_ip_unless_redirected(server, monkeypatch):
    gcp = {"SKYPILOT_CLUSTER_INFO": cluster_info("GCP")}
    assert fallback_target(gcp) == "http://169.254.169.254"  # inspected only; never started here
    assert fallback_target({**gcp, "GCE_METADATA_HOST": server.host_port}) is None  # a redirect never leaks
    assert fallback_target({**gcp, **server.env_for("gcp")}) == server.url
    assert fallback_target({"SKYPILOT_CLUSTER_INFO": cluster_info("AWS")}) is None
    # google-auth's own fallback address is the same variable, read the same way
    from google.auth.compute_engine import _metadata

    monkeypatch.setenv("GCE_METADATA_IP", server.host_port)
    assert _metadata._get_metadata_ip_root(False) == fallback_target({**gcp, "GCE_METADATA_IP": server.host_port})


# -- the server speaks each protocol ---------------------------------------------------------


def test_aws_server_requires_a_token_and_answers_404_while_nothing_is_pending(server):
    status, _, _ = request(server, "GET", "/latest/meta-data/spot/instance-action")
    assert status == 401
    status, _, _ = request(server, "PUT", "/latest/api/token")
    assert status == 400  # the TTL header is required
    status, headers, token = request(server, "PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    assert status == 200 and token and headers["X-aws-ec2-metadata-token-ttl-seconds"] == "60"
    auth = {"X-aws-ec2-metadata-token": token.decode()}
    assert request(server, "GET", "/latest/meta-data/spot/instance-action", auth)[0] == 404
    assert request(server, "GET", "/latest/meta-data/events/recommendations/rebalance", auth)[0] == 404
    assert request(server, "GET", "/latest/meta-data/events/maintenance/scheduled", auth)[2] == b"[]"

    server.announce_preemption(1_800_000_000.0, action="stop")
    status, _, body = request(server, "GET", "/latest/meta-data/spot/instance-action", auth)
    assert status == 200 and json.loads(body) == {"action": "stop", "time": "2027-01-15T08:00:00Z"}
    server.announce_maintenance(1_800_000_000.0)
    (event,) = json.loads(request(server, "GET", "/latest/meta-data/events/maintenance/scheduled", auth)[2])
    assert (event["Code"], event["NotBefore"], event["State"]) == (
        "system-reboot",
        "15 Jan 2027 08:00:00 GMT",
        "active",
    )
    server.expire_tokens()
    assert request(server, "GET", "/latest/meta-data/spot/instance-action", auth)[0] == 401
    assert server.count("aws.instance_action", 401) == 2


def test_aws_server_with_imdsv1_allowed_answers_without_a_token(server):
    server.aws_tokens = "optional"
    assert request(server, "GET", "/latest/meta-data/spot/instance-action")[0] == 404
    assert (
        request(server, "GET", "/latest/meta-data/spot/instance-action", {"X-aws-ec2-metadata-token": "forged"})[0]
        == 401
    )  # a token sent must still be valid


def test_gcp_server_insists_on_its_header_and_serves_maintenance(server):
    assert request(server, "GET", "/computeMetadata/v1/instance/preempted")[0] == 403
    status, headers, body = request(
        server, "GET", "/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"}
    )
    assert (status, body, headers["Metadata-Flavor"]) == (200, b"FALSE", "Google") and headers["ETag"]
    flavour = {"Metadata-Flavor": "Google"}
    assert request(server, "GET", "/computeMetadata/v1/instance/maintenance-event", flavour)[2] == b"NONE"
    assert request(server, "GET", "/computeMetadata/v1/instance/upcoming-maintenance", flavour)[0] == 404
    server.announce_maintenance(1_800_000_000.0)
    assert (
        request(server, "GET", "/computeMetadata/v1/instance/maintenance-event", flavour)[2]
        == b"TERMINATE_ON_HOST_MAINTENANCE"
    )
    status, headers, body = request(server, "GET", "/computeMetadata/v1/instance/upcoming-maintenance", flavour)
    assert status == 200 and json.loads(body)["window_start_time"] == "2027-01-15T08:00:00Z"
    server.cancel_maintenance()
    assert request(server, "GET", "/computeMetadata/v1/instance/maintenance-event", flavour)[2] == b"NONE"


def test_azure_server_checks_header_api_version_and_rate(server):
    path = "/metadata/scheduledevents?api-version=2020-07-01"
    assert request(server, "GET", path)[0] == 400  # no Metadata header
    status, _, body = request(server, "GET", "/metadata/scheduledevents?api-version=2099-01-01", {"Metadata": "true"})
    assert status == 400 and "2020-07-01" in json.loads(body)["newest-versions"]
    assert request(server, "GET", "/metadata/scheduledevents", {"Metadata": "true"})[0] == 400
    status, _, body = request(server, "GET", path, {"Metadata": "true"})
    assert status == 200 and json.loads(body)["Events"] == []
    name = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
    assert request(server, "GET", name, {"Metadata": "true"})[2] == server.vm_name.encode()
    statuses = [request(server, "GET", path, {"Metadata": "true"})[0] for _ in range(8)]
    assert 429 in statuses  # 5 a second per VM, as Azure IMDS documents


def test_azure_server_events_start_when_approved_or_due(server):
    path = "/metadata/scheduledevents?api-version=2020-07-01"
    due = server.add_azure_event("Reboot", time.time() - 1)
    later = server.add_azure_event("Redeploy", time.time() + 600)
    events = {e["EventId"]: e for e in json.loads(request(server, "GET", path, {"Metadata": "true"})[2])["Events"]}
    assert (events[due]["EventStatus"], events[due]["NotBefore"]) == ("Started", "")
    assert events[later]["EventStatus"] == "Scheduled" and events[later]["NotBefore"].endswith("GMT")
    bad = json.dumps({"StartRequests": [{"EventId": "nope"}]})
    assert request(server, "POST", path, {"Metadata": "true"}, bad)[0] == 400
    ok = json.dumps({"StartRequests": [{"EventId": later}]})
    assert request(server, "POST", path, {"Metadata": "true"}, ok)[0] == 200
    events = {e["EventId"]: e for e in json.loads(request(server, "GET", path, {"Metadata": "true"})[2])["Events"]}
    assert events[later]["EventStatus"] == "Started" and server.start_requests == [later]


def test_unknown_paths_do_not_pretend_to_be_a_metadata_service(server):
    status, headers, _ = request(server, "GET", "/")
    assert status == 404 and "Metadata-Flavor" not in headers
    assert server.counts["other"] == 1


def test_env_for_points_every_sdk_variable_here(server):
    env = server.env_for()
    assert env["AWS_EC2_METADATA_SERVICE_ENDPOINT"] == server.url + "/"
    assert env["AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE"] == "IPv4"
    assert env["GCE_METADATA_HOST"] == env["GCE_METADATA_ROOT"] == env["GCE_METADATA_IP"] == server.host_port
    assert env["SKYSPOT_AZURE_METADATA_ENDPOINT"] == env["AZURE_POD_IDENTITY_AUTHORITY_HOST"] == server.url
    assert set(server.env_for("gcp")) == {
        "GCE_METADATA_HOST",
        "GCE_METADATA_ROOT",
        "GCE_METADATA_IP",
        "GCE_METADATA_MTLS_MODE",
    }
    assert server.env_for("gcp")["GCE_METADATA_MTLS_MODE"] == "none"


def test_google_auth_own_gce_check_asks_the_loopback_server_and_finds_no_gce(server, monkeypatch, loopback_only):
    from google.auth.compute_engine import _metadata
    from google.auth.transport.requests import Request

    for key, value in server.env_for("gcp").items():
        monkeypatch.setenv(key, value)
    assert _metadata.ping(Request(), timeout=2, retry_count=1) is False
    assert server.counts["other"] == 1  # it asked here (GCE_METADATA_IP), and nowhere else
    assert {host for host, _ in loopback_only.opened} == {"127.0.0.1"}


# -- each cloud end to end -------------------------------------------------------------------


@pytest.mark.parametrize("cloud", CLOUDS)
def test_nothing_pending_means_no_callback(server, watchers, cloud):
    rec = Recorder()
    w = watch(server, cloud, rec, watchers, warnings=True)
    settle(server, cloud, polls=5)
    assert rec.notices == [] and rec.warnings == [] and w.is_alive()
    if cloud == "aws":
        assert server.count("aws.instance_action", 404) >= 5
        assert server.count("aws.token") == 1  # one token serves every path until it nears expiry
        assert server.count(status=401) == 0
    elif cloud == "gcp":
        # then hanging GETs, not busy polls: one answer per path
        assert server.count("gcp.preempted") == 1 and server.count("gcp.maintenance_event") == 1
    else:
        assert server.count("azure.scheduled_events", 200) >= 5
        assert server.count("azure.vm_name") == 1  # the name is asked once
        assert server.count(status=429) == 0  # the watcher's pace stays under Azure's limit


@pytest.mark.parametrize("cloud,window", [("aws", 120), ("gcp", 30), ("azure", 30)])
def test_announced_preemption_calls_back_once_with_source_and_deadline(server, watchers, cloud, window):
    rec = Recorder()
    w = watch(server, cloud, rec, watchers)
    settle(server, cloud)
    deadline = time.time() + window
    server.announce_preemption(deadline)

    assert rec.got_notice.wait(5)
    assert wait_until(lambda: not w.is_alive())  # the VM is going; the watcher's work is done
    assert len(rec.notices) == 1  # and with the threads ended, no second callback can come
    n = rec.notices[0]
    assert n.source == cloud and n.kind == "preemption"
    assert n.deadline == pytest.approx(deadline, abs=1.0)
    assert n.received == pytest.approx(time.time(), abs=2.0)
    assert n.action == ("terminate" if cloud == "aws" else "preempt")
    assert w.notice == n


def test_gcp_hanging_get_returns_the_moment_preemption_is_announced(server, watchers):
    rec = Recorder()
    watch(server, "gcp", rec, watchers)
    settle(server, "gcp")
    announced = time.time()
    server.announce_preemption(announced + 30)
    assert rec.got_notice.wait(5)
    assert server.count("gcp.preempted") == 2  # the hanging GET itself answered: no poll in between
    assert rec.notices[0].received - announced < 1.0  # not a poll period, let alone the 60 s hang


def test_gcp_reconnects_after_the_hang_times_out(server, watchers, monkeypatch):
    monkeypatch.setattr(notice_gcp, "GCP_WAIT_TIMEOUT_S", 1)  # the smallest timeout_sec there is
    rec = Recorder()
    watch(server, "gcp", rec, watchers)
    assert wait_until(lambda: server.count("gcp.preempted", 200) >= 2)  # first answer, then the timeout's
    assert rec.notices == []
    server.announce_preemption(time.time() + 30)
    assert rec.got_notice.wait(5)


@pytest.mark.parametrize("cloud", CLOUDS)
def test_notice_already_pending_at_start_is_seen(server, watchers, cloud):
    server.announce_preemption(time.time() + 20)
    rec = Recorder()
    watch(server, cloud, rec, watchers)
    assert rec.got_notice.wait(5)


def test_aws_rebalance_goes_to_on_warning_not_on_notice(server, watchers):
    rec = Recorder()
    w = watch(server, "aws", rec, watchers, warnings=True)
    settle(server, "aws")
    server.recommend_rebalance()
    assert rec.got_warning.wait(5)
    settle(server, "aws")
    assert len(rec.warnings) == 1 and rec.notices == []  # once, though every poll still sees it
    assert (rec.warnings[0].action, rec.warnings[0].kind, rec.warnings[0].source) == ("rebalance", "warning", "aws")
    assert w.is_alive()  # a rebalance is a warning; keep watching for the notice itself

    server.announce_preemption(time.time() + 120)
    assert rec.got_notice.wait(5)
    assert len(rec.notices) == 1 and len(rec.warnings) == 1


def test_aws_without_on_warning_does_not_poll_rebalance(server, watchers):
    watch(server, "aws", Recorder(), watchers)
    settle(server, "aws")
    assert server.count("aws.rebalance") == 0


def test_aws_rejected_token_is_replaced_and_polling_goes_on(server, watchers):
    rec = Recorder()
    watch(server, "aws", rec, watchers)
    settle(server, "aws")
    server.expire_tokens()
    settle(server, "aws")
    assert server.count("aws.token") == 2
    server.announce_preemption(time.time() + 120)
    assert rec.got_notice.wait(5)


def test_aws_token_is_refreshed_before_it_expires(server, watchers, monkeypatch):
    monkeypatch.setattr(notice_aws, "AWS_TOKEN_TTL_S", 1)  # the smallest TTL IMDS accepts
    monkeypatch.setattr(notice_aws, "AWS_TOKEN_REFRESH_S", 0.5)
    watch(server, "aws", Recorder(), watchers)
    assert wait_until(lambda: server.count("aws.token") >= 3)
    assert server.count(status=401) == 0  # refreshed in time, never rejected


def test_reset_gives_a_fresh_instance_for_the_next_attempt(server, watchers):
    server.announce_preemption(time.time() + 30)
    server.reset()
    rec = Recorder()
    for cloud in CLOUDS:
        watch(server, cloud, rec, watchers)
    for cloud in CLOUDS:
        settle(server, cloud)
    assert rec.notices == []
    server.announce_preemption(time.time() + 30)
    assert wait_until(lambda: len(rec.notices) == 3)
    assert sorted(n.source for n in rec.notices) == sorted(CLOUDS)


# -- 1. planned shutdowns ----------------------------------------------------------------------


@pytest.mark.parametrize("cloud,action", [("aws", "system-reboot"), ("gcp", "maintenance"), ("azure", "reboot")])
def test_planned_shutdown_warns_at_once_and_calls_on_notice_lead_seconds_before_it(server, watchers, cloud, action):
    """An hour of warning, time-scaled: 4 s ahead, the exit kept 1.5 s before it (the cloud's window, scaled)."""
    rec = Recorder()
    w = watch(server, cloud, rec, watchers, warnings=True, lead=1.5)
    settle(server, cloud)
    deadline = time.time() + 4.0
    server.announce_maintenance(deadline)

    assert rec.got_warning.wait(3)
    (warning,) = rec.warnings
    assert (warning.source, warning.action, warning.kind) == (cloud, action, "shutdown")
    assert warning.deadline == pytest.approx(deadline, abs=1.0)  # the cloud's own time, to its second
    assert rec.notices == [] and w.is_alive()  # training goes on after the early checkpoint

    assert rec.got_notice.wait(6)
    (final,) = rec.notices
    assert (final.action, final.kind, final.deadline) == (action, "shutdown", warning.deadline)
    assert final.received == warning.received  # first seen then
    assert rec.notice_at[0] >= warning.deadline - 1.5 - 0.05  # not before deadline - lead (a lower bound)
    assert rec.notice_at[0] < warning.deadline  # and before the shutdown itself
    assert wait_until(lambda: not w.is_alive())


def test_gcp_maintenance_without_a_window_assumes_googles_notice(server, watchers):
    """No upcoming-maintenance answer: an hour on a GPU VM, 60 s otherwise (Google's figures)."""
    server.fail("gcp.upcoming_maintenance", 404)
    recs = {}
    for gpus in ("8", "0"):
        recs[gpus] = Recorder()
        watch(server, "gcp", recs[gpus], watchers, warnings=True, env_extra={"SKYPILOT_NUM_GPUS_PER_NODE": gpus})
    settle(server, "gcp")
    server.announce_maintenance(time.time() + 600)
    assert wait_until(lambda: all(r.warnings for r in recs.values()))
    for gpus, expected in (("8", 3600.0), ("0", 60.0)):
        w = recs[gpus].warnings[0]
        assert w.deadline - w.received == pytest.approx(expected)


@pytest.mark.parametrize("cloud", CLOUDS)
def test_cancelled_maintenance_changes_nothing_more(server, watchers, cloud):
    rec = Recorder()
    w = watch(server, cloud, rec, watchers, warnings=True, lead=0.5)
    settle(server, cloud)
    deadline = time.time() + 2.5
    server.announce_maintenance(deadline)
    assert rec.got_warning.wait(3)
    server.cancel_maintenance()
    settle(server, cloud)
    time.sleep(max(0.0, deadline - time.time()) + 0.3)
    assert rec.notices == [] and w.is_alive()  # no exit for a shutdown that will not come


@pytest.mark.parametrize("cloud", CLOUDS)
def test_maintenance_announced_again_after_a_cancelled_one_is_warned_of_again(server, watchers, cloud):
    rec = Recorder()
    watch(server, cloud, rec, watchers, warnings=True)
    settle(server, cloud)
    server.announce_maintenance(time.time() + 3600)
    assert wait_until(lambda: len(rec.warnings) == 1)
    answered = server.count("gcp.maintenance_event")
    server.cancel_maintenance()
    if cloud == "gcp":  # the hanging GET answers NONE, then hangs again
        assert wait_until(lambda: server.count("gcp.maintenance_event") > answered)
    settle(server, cloud)
    server.announce_maintenance(time.time() + 7200)
    assert wait_until(lambda: len(rec.warnings) == 2)  # a new early checkpoint for the new date
    assert rec.warnings[1].deadline - rec.warnings[0].deadline == pytest.approx(3600, abs=2)
    assert rec.notices == []


@pytest.mark.parametrize(
    "cloud,kwargs,action",
    [
        ("aws", {"aws_code": "system-maintenance"}, "system-maintenance"),
        ("gcp", {"gcp_value": "MIGRATE_ON_HOST_MAINTENANCE"}, "migrate"),
        ("azure", {"azure_type": "Freeze"}, "freeze"),
    ],
)
def test_maintenance_that_keeps_the_vm_running_is_a_warning_only(server, watchers, cloud, kwargs, action):
    rec = Recorder()
    w = watch(server, cloud, rec, watchers, warnings=True, lead=0.5)
    settle(server, cloud)
    deadline = time.time() + 1.0
    server.announce_maintenance(deadline, **kwargs)
    assert rec.got_warning.wait(3)
    assert (rec.warnings[0].action, rec.warnings[0].kind) == (action, "warning")
    time.sleep(max(0.0, deadline - time.time()) + 0.3)
    settle(server, cloud)
    assert rec.notices == [] and len(rec.warnings) == 1 and w.is_alive()


def test_azure_started_reboot_is_imminent(server, watchers):
    """A host failure skips the notice: the event arrives Started, NotBefore blank."""
    rec = Recorder()
    watch(server, "azure", rec, watchers, warnings=True)
    settle(server, "azure")
    server.add_azure_event("Reboot", 0, status="Started")
    assert rec.got_notice.wait(3)
    assert (rec.notices[0].action, rec.notices[0].kind) == ("reboot", "shutdown")


# -- 2. AWS without a token ------------------------------------------------------------------


def test_aws_unanswered_token_put_falls_back_to_imdsv1_and_sees_the_notice(watchers):
    """A container behind the default hop limit: the PUT's answer never arrives; IMDSv1 still works."""
    with MetadataServer(aws_tokens="optional", drop_token_puts=True) as srv:
        rec = Recorder()
        watch(srv, "aws", rec, watchers, warnings=True)
        settle(srv, "aws")
        srv.announce_preemption(time.time() + 120)
        assert rec.got_notice.wait(5)
        assert srv.count("aws.token", 0) >= 1 and srv.count("aws.token", 200) == 0  # never answered
        assert srv.count("aws.token") <= 2  # not asked again on every poll
        for w in watchers:
            w.stop()


def test_botocore_reads_the_same_notice_through_the_same_unanswered_put():
    from botocore.utils import IMDSFetcher

    with MetadataServer(aws_tokens="optional", drop_token_puts=True) as srv:
        srv.announce_preemption(1_800_000_000.0)
        fetcher = IMDSFetcher(timeout=0.5, base_url=srv.url + "/", env={})
        token = fetcher._fetch_metadata_token()  # times out, as behind the hop limit
        assert token is None
        response = fetcher._get_request("latest/meta-data/spot/instance-action", lambda r: False, token)
        assert response.status_code == 200 and json.loads(response.content)["action"] == "terminate"
        srv.aws_tokens = "required"  # IMDSv2 only: botocore is as blind as we are
        assert fetcher._get_request("latest/meta-data/spot/instance-action", lambda r: False, None).status_code == 401


@pytest.mark.parametrize("tokens,extra", [("required", {}), ("optional", {"AWS_EC2_METADATA_V1_DISABLED": "true"})])
def test_aws_without_token_or_imdsv1_keeps_trying_quietly(watchers, tokens, extra):
    with MetadataServer(aws_tokens=tokens, drop_token_puts=True) as srv:
        rec = Recorder()
        w = watch(srv, "aws", rec, watchers, env_extra=extra)
        srv.announce_preemption(time.time() + 120)
        assert wait_until(lambda: w.failures >= 2, timeout=20)  # each try waits out an unanswered PUT
        assert rec.notices == [] and w.is_alive()  # blind, as botocore would be, but alive
        srv.drop_token_puts = False  # the hop limit raised: tokens come through
        assert rec.got_notice.wait(10)
        for w in watchers:
            w.stop()


# -- 3. independent paths -----------------------------------------------------------------------


def test_aws_failing_rebalance_path_does_not_delay_the_interruption_notice(server, watchers):
    server.fail("aws.rebalance", 500)
    rec = Recorder()
    w = watch(server, "aws", rec, watchers, warnings=True)
    rebalance = next(p for p in w._paths if p.name == "aws-rebalance")
    assert wait_until(lambda: rebalance.failures >= 5)  # its backoff is now 8 polls long

    before_ia, before_rb = server.count("aws.instance_action"), server.count("aws.rebalance")
    assert wait_until(lambda: server.count("aws.instance_action") >= before_ia + 16)
    rb = server.count("aws.rebalance") - before_rb
    assert rb <= 4  # 16 interruption polls meanwhile: the two schedules are independent

    announced_polls = server.count("aws.instance_action")
    server.announce_preemption(time.time() + 120)
    assert rec.got_notice.wait(5)
    # seen by the first poll after the announcement (at most one was already in flight): one poll period
    assert server.count("aws.instance_action", 200) == 1
    assert server.count("aws.instance_action") - announced_polls <= 2


def test_gcp_paths_hang_independently(server, watchers):
    server.fail("gcp.maintenance_event", 503)
    rec = Recorder()
    w = watch(server, "gcp", rec, watchers, warnings=True)
    maintenance = next(p for p in w._paths if p.name == "gcp-maintenance-event")
    assert wait_until(lambda: maintenance.failures >= 4)
    server.announce_preemption(time.time() + 30)
    assert rec.got_notice.wait(5)
    assert server.count("gcp.preempted") == 2  # its hanging GET answered; the failing path held nothing up


# -- 4. GCP DNS --------------------------------------------------------------------------------


def test_gcp_falls_back_to_the_metadata_ip_when_the_host_does_not_resolve(server, watchers, loopback_only):
    port = server.host_port.rsplit(":", 1)[1]
    rec = Recorder()
    w = start_notice_watcher(
        rec.on_notice,
        env={
            "SKYPILOT_CLUSTER_INFO": cluster_info("GCP"),
            "GCE_METADATA_HOST": f"metadata.invalid:{port}",
            "GCE_METADATA_IP": server.host_port,
        },
        poll_interval=POLL,
    )
    watchers.append(w)
    settle(server, "gcp")
    server.announce_preemption(time.time() + 30)
    assert rec.got_notice.wait(5)
    assert loopback_only.unresolved and set(loopback_only.unresolved) == {"metadata.invalid"}
    assert {host for host, _ in loopback_only.opened} == {"127.0.0.1"}


# -- 5. Azure: only this VM's events -----------------------------------------------------------


def test_azure_neighbours_events_change_nothing(server, watchers):
    rec = Recorder()
    w = watch(server, "azure", rec, watchers, warnings=True)
    settle(server, "azure")
    server.add_azure_event("Preempt", time.time() + 30, resources=["neighbour-1"])
    server.add_azure_event("Reboot", time.time() + 900, resources=["neighbour-1", "neighbour-2"])
    settle(server, "azure", polls=4)
    assert rec.notices == [] and rec.warnings == [] and w.is_alive()

    server.add_azure_event("Preempt", time.time() + 30, resources=["neighbour-1", server.vm_name.upper()])
    assert rec.got_notice.wait(3)  # ours, however Azure spells the name


def test_azure_without_a_vm_name_counts_every_event(server, watchers, caplog):
    server.fail("azure.vm_name", 500)
    rec = Recorder()
    with caplog.at_level(logging.WARNING):
        watch(server, "azure", rec, watchers)
        settle(server, "azure")
        server.announce_preemption(time.time() + 30, resources=["neighbour-1"])
        assert rec.got_notice.wait(3)  # a needless checkpoint beats a lost one
    assert "every scheduled event counts as ours" in caplog.text


def test_azure_acted_on_events_are_approved_on_stop_when_they_name_this_vm_alone(server, watchers):
    rec = Recorder()
    w = watch(server, "azure", rec, watchers)
    settle(server, "azure")
    server.announce_preemption(time.time() + 30)
    assert rec.got_notice.wait(3)
    assert server.start_requests == []  # not while the checkpoint is being made
    w.stop()
    assert server.start_requests == [rec.notices[0].event_id]

    shared = Recorder()
    server.reset()
    w = watch(server, "azure", shared, watchers)
    settle(server, "azure")
    server.announce_preemption(time.time() + 30, resources=[server.vm_name, "neighbour-1"])
    assert shared.got_notice.wait(3)
    w.stop()
    assert len(server.start_requests) == 1  # approving would start it for the neighbour too


# -- 6. Azure: the first request early -----------------------------------------------------------


def test_azure_events_flow_only_after_the_first_request_so_it_goes_out_first(watchers):
    """Scheduled Events start with the first request (slow to answer) and events follow later."""
    with MetadataServer(azure_first_call_delay=0.5, azure_events_after=1.0) as srv:
        rec = Recorder()
        srv.announce_preemption(time.time() + 30)  # already pending when the VM starts watching
        started = time.time()
        watch(srv, "azure", rec, watchers)
        assert wait_until(lambda: srv.count("azure.scheduled_events") >= 1)
        assert srv.counts["azure.vm_name"] <= 1  # the events request went out first
        assert rec.got_notice.wait(5)
        assert rec.notice_at[0] - started >= 1.0  # not before events flow: the earlier asked, the sooner
        for w in watchers:
            w.stop()


def test_trainer_starts_the_watcher_before_setup_and_model_load(server, monkeypatch, tmp_path):
    """loop.setup: the node leader's first Azure request goes out before the recipe is even loaded."""
    from skyspot.trainer import cluster, loop
    from skyspot.trainer.preemption import PreemptionWatch

    for key, value in env_for(server, "azure", SKYSPOT_NOTICE_POLL_SECONDS=str(AZURE_POLL), RANK="0").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(cluster, "from_environment", lambda: SimpleNamespace(is_node_leader=True))
    started = []
    real_start = loop._start_notice_watcher
    monkeypatch.setattr(loop, "_start_notice_watcher", lambda watch: started.append(real_start(watch)) or started[-1])

    class SetupGoesOn(Exception):
        pass

    asked_before_recipe = []

    def load_recipe(*args, **kwargs):
        asked_before_recipe.append(wait_until(lambda: server.count("azure.scheduled_events") >= 1))
        raise SetupGoesOn()

    monkeypatch.setattr(loop, "load_recipe", load_recipe)
    watch_ = PreemptionWatch()
    try:
        with pytest.raises(SetupGoesOn):
            loop.setup(SimpleNamespace(recipe="tiny", overrides=[], store=None, run_dir=tmp_path), watch_)
        assert asked_before_recipe == [True]
        server.announce_preemption(time.time() + 30)
        assert wait_until(lambda: watch_.emergency)  # and its notices reach the flag the loop votes on
        pending = watch_.take()
        assert pending.deadline is not None and pending.notices[0]["source"] == "azure"
    finally:
        for w in started:
            if w is not None:
                w.stop()


def test_trainer_wires_warnings_to_an_early_checkpoint_with_their_cause(server, monkeypatch):
    from skyspot.trainer import loop
    from skyspot.trainer.preemption import PreemptionWatch

    for key, value in env_for(server, "gcp", SKYSPOT_NOTICE_POLL_SECONDS=str(POLL)).items():
        monkeypatch.setenv(key, value)
    watch_ = PreemptionWatch()
    w = loop._start_notice_watcher(watch_)
    try:
        settle(server, "gcp")
        deadline = time.time() + 3600
        server.announce_maintenance(deadline)
        taken = []
        assert wait_until(lambda: taken.append(watch_.take()) or taken[-1].checkpoint)
        pending = taken[-1]
        assert not pending.emergency  # an hour ahead: an early checkpoint, and training goes on
        (seen,) = pending.notices  # the event the loop writes says what it was
        assert (seen["source"], seen["action"]) == ("gcp", "maintenance")
        assert seen["deadline"] == pytest.approx(deadline, abs=1.0)
    finally:
        w.stop()


# -- 7. GCP without ETags ------------------------------------------------------------------------


def test_gcp_answers_without_etag_are_polled_not_spun(watchers):
    with MetadataServer(gcp_etags=False) as srv:
        rec = Recorder()
        poll = 0.1
        watch(srv, "gcp", rec, watchers, poll_interval=poll)
        began = time.monotonic()
        time.sleep(1.0)
        asked = srv.count("gcp.preempted")
        elapsed = time.monotonic() - began
        assert asked <= elapsed / poll + 2  # one request per interval, not hundreds a second
        srv.announce_preemption(time.time() + 30)
        assert rec.got_notice.wait(3)  # and the notice still comes within an interval or so
        for w in watchers:
            w.stop()


def test_gcp_503_is_retried_as_google_auth_retries_it(server, watchers):
    from google.auth.compute_engine import _metadata
    from google.auth.transport.requests import Request

    root = f"{server.url}/computeMetadata/v1/"
    server.fail("gcp.maintenance_event", 503, times=2)
    assert _metadata.get(Request(), "instance/maintenance-event", root=root, retry_count=3) == "NONE"
    assert server.count("gcp.maintenance_event", 503) == 2

    server.fail("gcp.preempted", 503, times=3)
    rec = Recorder()
    watch(server, "gcp", rec, watchers)
    server.announce_preemption(time.time() + 30)
    assert rec.got_notice.wait(5)
    assert _metadata.get(Request(), "instance/preempted", root=root) == "TRUE"


# -- an endpoint that is down or slow ------------------------------------------------------------


@pytest.mark.parametrize("cloud", CLOUDS)
def test_unreachable_endpoint_is_retried_quietly_and_recovers(watchers, caplog, cloud):
    port = free_port()  # nothing listens here yet
    stand_in = MetadataServer(port=port)  # not started, so its env_for has no URL yet: spell it out
    env = {
        "SKYPILOT_CLUSTER_INFO": cluster_info(CLOUD_NAMES[cloud]),
        ms.ENV_VARS[cloud]: {
            "aws": f"http://127.0.0.1:{port}/",
            "gcp": f"127.0.0.1:{port}",
            "azure": f"http://127.0.0.1:{port}",
        }[cloud],
    }
    rec = Recorder()
    with caplog.at_level(logging.DEBUG, logger="skyspot.trainer.notice"):
        w = start_notice_watcher(rec.on_notice, env=env, poll_interval=0.02)
        watchers.append(w)
        assert wait_until(lambda: w.failures >= 4)  # well into the backoff
        assert w.is_alive() and rec.notices == []

        stand_in.start()
        try:
            stand_in.announce_preemption(time.time() + 30)
            assert rec.got_notice.wait(5)  # backoff is capped low enough to notice within the window
        finally:
            stand_in.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([m for m in warnings if "retrying quietly" in m]) == 1  # one warning, then debug only
    assert len(warnings) == 2 and "preemption notice" in warnings[1]


@pytest.mark.parametrize("cloud", CLOUDS)
def test_server_going_away_mid_watch_does_not_crash_the_watcher(watchers, cloud):
    srv = MetadataServer().start()
    rec = Recorder()
    w = watch(srv, cloud, rec, watchers)
    settle(srv, cloud)
    srv.stop()
    assert wait_until(lambda: w.failures >= 3)
    assert w.is_alive() and rec.notices == []


def test_azure_throttled_watcher_backs_off_and_still_sees_the_notice(watchers):
    with MetadataServer(azure_rate_limit=2) as srv:
        rec = Recorder()
        w = watch(srv, "azure", rec, watchers, poll_interval=0.05)
        assert wait_until(lambda: srv.count(status=429) >= 1)
        srv.announce_preemption(time.time() + 30)
        assert rec.got_notice.wait(5)
        w.stop()


def test_a_failing_callback_is_logged_not_raised(server, watchers, caplog):
    def boom(n):
        raise RuntimeError("callback bug")

    w = start_notice_watcher(boom, env=env_for(server, "aws"), poll_interval=POLL)
    watchers.append(w)
    server.announce_preemption(time.time() + 120)
    with caplog.at_level(logging.ERROR):
        assert wait_until(lambda: w.notice is not None)
        assert wait_until(lambda: "on_notice callback failed" in caplog.text)


# -- stopping --------------------------------------------------------------------------------


@pytest.mark.parametrize("cloud", CLOUDS)
def test_stop_is_prompt_even_during_a_hanging_get(server, cloud):
    w = start_notice_watcher(lambda n: None, env=env_for(server, cloud), poll_interval=poll_for(cloud))
    settle(server, cloud, polls=1)
    started = time.monotonic()
    w.stop()
    assert time.monotonic() - started < 1.0
    assert not w.is_alive()


def test_server_and_watcher_agree_on_the_variable_names():
    assert ms.ENV_VARS == {c.name: c.metadata_endpoint_var for c in clouds.all()}
    with MetadataServer() as srv:  # it points each cloud's watcher at itself by that cloud's own variable
        for cloud in clouds.all():
            assert cloud.metadata_endpoint_var in srv.env_for(cloud.name)
