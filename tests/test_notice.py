"""Preemption-notice watchers against the loopback metadata server, one cloud dialect at a time.

Every test in this module runs with outbound connections and name lookups fenced to 127.0.0.1:
anything else fails loudly, so a watcher that reached for a real metadata address would be caught.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time

import pytest

from skyspot import metadata_server as ms
from skyspot.metadata_server import MetadataServer
from skyspot.trainer import notice
from skyspot.trainer.notice import Notice, start_notice_watcher, watch_target

POLL = 0.05
CLOUDS = ["aws", "gcp", "azure"]
CLOUD_NAMES = {"aws": "AWS", "gcp": "GCP", "azure": "Azure"}  # as SkyPilot's str(cloud) spells them


# -- the fence -------------------------------------------------------------------------------

_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex
_real_getaddrinfo = socket.getaddrinfo
_LOOPBACK = {"127.0.0.1", "localhost"}


class Fence:
    """Connections opened during a test, and any attempt to reach beyond 127.0.0.1."""

    def __init__(self):
        self.opened: list[tuple[str, int]] = []
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


# -- helpers ---------------------------------------------------------------------------------

@pytest.fixture
def server():
    with MetadataServer() as srv:
        yield srv


def cluster_info(cloud: str) -> str:
    """SKYPILOT_CLUSTER_INFO as SkyPilot 0.14 writes it (sky/backends/cloud_vm_ray_backend.py)."""
    return json.dumps({"cluster_name": "sky-test", "cloud": cloud, "region": "r1", "zone": "r1-a"})


def env_for(srv: MetadataServer, cloud: str) -> dict[str, str]:
    return {"SKYPILOT_CLUSTER_INFO": cluster_info(CLOUD_NAMES[cloud]), **srv.env_for(cloud)}


class Recorder:
    """Collects callbacks from the watcher thread."""

    def __init__(self):
        self.notices: list[Notice] = []
        self.rebalances: list[Notice] = []
        self.got_notice = threading.Event()
        self.got_rebalance = threading.Event()

    def on_notice(self, n: Notice) -> None:
        self.notices.append(n)
        self.got_notice.set()

    def on_rebalance(self, n: Notice) -> None:
        self.rebalances.append(n)
        self.got_rebalance.set()


@pytest.fixture
def watchers():
    started = []
    yield started
    for w in started:
        w.stop()


def watch(srv, cloud, rec, watchers, **kwargs):
    w = start_notice_watcher(rec.on_notice, kwargs.pop("on_rebalance", None), env=env_for(srv, cloud),
                             poll_interval=POLL, **kwargs)
    assert w is not None
    watchers.append(w)
    return w


def wait_until(predicate, timeout=3.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def request(srv, method, path, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", int(srv.host_port.rsplit(":", 1)[1]), timeout=5)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.headers), response.read()
    finally:
        conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- which cloud, which endpoint -------------------------------------------------------------

@pytest.mark.parametrize("raw", [None, "", "not json", "[]", '{"cloud": "Kubernetes"}',
                                 '{"cloud": "Lambda", "region": "us-east-1"}', '{"region": "x"}'])
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


def test_aws_metadata_disabled_guards_the_real_imds_but_not_an_explicit_endpoint(server):
    disabled = {"SKYPILOT_CLUSTER_INFO": cluster_info("AWS"), "AWS_EC2_METADATA_DISABLED": "true"}
    assert watch_target(disabled) is None
    assert watch_target({**disabled, **server.env_for("aws")}) == ("aws", server.url)


def test_malformed_override_is_a_warning_not_a_crash(caplog):
    env = {"SKYPILOT_CLUSTER_INFO": cluster_info("AWS"), "AWS_EC2_METADATA_SERVICE_ENDPOINT": "https://x"}
    with caplog.at_level(logging.WARNING):
        assert start_notice_watcher(lambda n: None, env=env) is None
    assert "not watching" in caplog.text


# -- the server speaks each protocol ---------------------------------------------------------

def test_aws_server_requires_a_token_and_answers_404_while_nothing_is_pending(server):
    status, _, _ = request(server, "GET", "/latest/meta-data/spot/instance-action")
    assert status == 401
    status, _, _ = request(server, "PUT", "/latest/api/token")
    assert status == 400  # the TTL header is required
    status, headers, token = request(server, "PUT", "/latest/api/token",
                                     {"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    assert status == 200 and token and headers["X-aws-ec2-metadata-token-ttl-seconds"] == "60"
    auth = {"X-aws-ec2-metadata-token": token.decode()}
    assert request(server, "GET", "/latest/meta-data/spot/instance-action", auth)[0] == 404
    assert request(server, "GET", "/latest/meta-data/events/recommendations/rebalance", auth)[0] == 404

    server.announce_preemption(1_800_000_000.0, action="stop")
    status, _, body = request(server, "GET", "/latest/meta-data/spot/instance-action", auth)
    assert status == 200 and json.loads(body) == {"action": "stop", "time": "2027-01-15T08:00:00Z"}
    server.expire_tokens()
    assert request(server, "GET", "/latest/meta-data/spot/instance-action", auth)[0] == 401
    assert server.count("aws.instance_action", 401) == 2


def test_gcp_and_azure_servers_insist_on_their_headers(server):
    assert request(server, "GET", "/computeMetadata/v1/instance/preempted")[0] == 403
    status, headers, body = request(server, "GET", "/computeMetadata/v1/instance/preempted",
                                    {"Metadata-Flavor": "Google"})
    assert (status, body, headers["Metadata-Flavor"]) == (200, b"FALSE", "Google") and headers["ETag"]
    assert request(server, "GET", "/metadata/scheduledevents?api-version=2020-07-01")[0] == 400
    status, _, body = request(server, "GET", "/metadata/scheduledevents?api-version=2020-07-01",
                              {"Metadata": "true"})
    assert status == 200 and json.loads(body)["Events"] == []


def test_unknown_paths_do_not_pretend_to_be_a_metadata_service(server):
    status, headers, _ = request(server, "GET", "/")
    assert status == 404 and "Metadata-Flavor" not in headers
    assert server.counts["other"] == 1


# -- each cloud end to end -------------------------------------------------------------------

MAIN_ENDPOINT = {"aws": "aws.instance_action", "gcp": "gcp.preempted", "azure": "azure.scheduled_events"}


def settle(srv: MetadataServer, cloud: str, polls: int = 3) -> None:
    """Let the watcher ask `polls` more times (AWS, Azure), or get its first answer and hang again (GCP)."""
    endpoint = MAIN_ENDPOINT[cloud]
    # GCP answers once at once and then hangs, so its first answer may already be in: count from 0.
    target = 1 if cloud == "gcp" else srv.count(endpoint) + polls
    assert wait_until(lambda: srv.count(endpoint) >= target)
    if cloud == "gcp":
        time.sleep(0.1)  # the next GET is now hanging


@pytest.mark.parametrize("cloud", CLOUDS)
def test_nothing_pending_means_no_callback(server, watchers, cloud):
    rec = Recorder()
    w = watch(server, cloud, rec, watchers)
    settle(server, cloud, polls=5)
    assert rec.notices == [] and w.is_alive()
    if cloud == "aws":
        assert server.count("aws.instance_action", 404) >= 5
        assert server.count("aws.token") == 1  # one token serves every poll until it nears expiry
        assert server.count(status=401) == 0
    elif cloud == "gcp":
        assert server.count("gcp.preempted") == 1  # then a hanging GET, not a busy poll
    else:
        assert server.count("azure.scheduled_events", 200) >= 5


@pytest.mark.parametrize("cloud,window", [("aws", 120), ("gcp", 30), ("azure", 30)])
def test_announced_preemption_calls_back_once_with_source_and_deadline(server, watchers, cloud, window):
    rec = Recorder()
    w = watch(server, cloud, rec, watchers)
    settle(server, cloud)
    deadline = time.time() + window
    server.announce_preemption(deadline)

    assert rec.got_notice.wait(3)
    assert wait_until(lambda: not w.is_alive())  # the VM is going; the watcher's work is done
    assert len(rec.notices) == 1  # and with the thread ended, no second callback can come
    n = rec.notices[0]
    assert n.source == cloud
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
    assert rec.got_notice.wait(3)
    assert rec.notices[0].received - announced < 1.0  # not a poll period, let alone the 60 s hang


def test_gcp_reconnects_after_the_hang_times_out(server, watchers, monkeypatch):
    monkeypatch.setattr(notice, "GCP_WAIT_TIMEOUT_S", 1)  # the smallest timeout_sec there is
    rec = Recorder()
    watch(server, "gcp", rec, watchers)
    assert wait_until(lambda: server.count("gcp.preempted", 200) >= 2)  # first answer, then the timeout's
    assert rec.notices == []
    server.announce_preemption(time.time() + 30)
    assert rec.got_notice.wait(3)


@pytest.mark.parametrize("cloud", CLOUDS)
def test_notice_already_pending_at_start_is_seen(server, watchers, cloud):
    server.announce_preemption(time.time() + 20)
    rec = Recorder()
    watch(server, cloud, rec, watchers)
    assert rec.got_notice.wait(3)


def test_aws_rebalance_goes_to_on_rebalance_not_on_notice(server, watchers):
    rec = Recorder()
    w = watch(server, "aws", rec, watchers, on_rebalance=rec.on_rebalance)
    settle(server, "aws")
    server.recommend_rebalance()
    assert rec.got_rebalance.wait(3)
    settle(server, "aws")
    assert len(rec.rebalances) == 1 and rec.notices == []  # once, though every poll still sees it
    assert rec.rebalances[0].action == "rebalance" and rec.rebalances[0].source == "aws"
    assert w.is_alive()  # a rebalance is a warning; keep watching for the notice itself

    server.announce_preemption(time.time() + 120)
    assert rec.got_notice.wait(3)
    assert len(rec.notices) == 1 and len(rec.rebalances) == 1


def test_aws_without_on_rebalance_does_not_poll_it(server, watchers):
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
    assert rec.got_notice.wait(3)


def test_aws_token_is_refreshed_before_it_expires(server, watchers, monkeypatch):
    monkeypatch.setattr(notice, "AWS_TOKEN_TTL_S", 1)  # the smallest TTL IMDS accepts
    monkeypatch.setattr(notice, "AWS_TOKEN_REFRESH_S", 0.5)
    watch(server, "aws", Recorder(), watchers)
    assert wait_until(lambda: server.count("aws.token") >= 3)
    assert server.count(status=401) == 0  # refreshed in time, never rejected


def test_azure_ignores_events_that_are_not_preempt(server, watchers):
    rec = Recorder()
    watch(server, "azure", rec, watchers)
    with server._cond:  # a maintenance Freeze, as Azure schedules them
        server._azure_events = [{"EventId": "E1", "EventType": "Freeze", "ResourceType": "VirtualMachine",
                                 "Resources": [server.vm_name], "EventStatus": "Scheduled",
                                 "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"}]
    settle(server, "azure")
    assert rec.notices == []
    server.announce_preemption(time.time() + 30)
    assert rec.got_notice.wait(3)


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


# -- an endpoint that is down ----------------------------------------------------------------

@pytest.mark.parametrize("cloud", CLOUDS)
def test_unreachable_endpoint_is_retried_quietly_and_recovers(watchers, caplog, cloud):
    port = free_port()  # nothing listens here yet
    stand_in = MetadataServer(port=port)  # not started, so its env_for has no URL yet: spell it out
    env = {"SKYPILOT_CLUSTER_INFO": cluster_info(CLOUD_NAMES[cloud]),
           ms.ENV_VARS[cloud]: {"aws": f"http://127.0.0.1:{port}/", "gcp": f"127.0.0.1:{port}",
                                "azure": f"http://127.0.0.1:{port}"}[cloud]}
    rec = Recorder()
    with caplog.at_level(logging.DEBUG, logger="skyspot.trainer.notice"):
        w = start_notice_watcher(rec.on_notice, env=env, poll_interval=0.02)
        watchers.append(w)
        assert wait_until(lambda: w._failures >= 4)  # well into the backoff
        assert w.is_alive() and rec.notices == []

        stand_in.start()
        try:
            stand_in.announce_preemption(time.time() + 30)
            assert rec.got_notice.wait(3)  # backoff is capped low enough to notice within the window
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
    assert wait_until(lambda: w._failures >= 3)
    assert w.is_alive() and rec.notices == []


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
    w = start_notice_watcher(lambda n: None, env=env_for(server, cloud), poll_interval=POLL)
    settle(server, cloud, polls=1)
    started = time.monotonic()
    w.stop()
    assert time.monotonic() - started < 1.0
    assert not w.is_alive()


def test_server_and_watcher_agree_on_the_variable_names():
    assert ms.ENV_VARS == notice.ENDPOINT_VARS
