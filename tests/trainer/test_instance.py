"""The node's own placement from its cloud's metadata service (trainer/instance.py), read from the loopback
stand-in (skyspot/executors/local/metadata_server.py), which speaks each cloud's paths, headers and tokens as the cloud does."""

from __future__ import annotations

import json

import pytest

from skyspot.pricing import cost
from skyspot.events import EventLog
from skyspot.executors.local.metadata_server import MetadataServer
from skyspot.trainer import instance
from skyspot.trainer.cluster import where_from_cluster_info

CLUSTER = {
    "aws": {"cloud": "AWS", "region": "us-east-1", "zone": "us-east-1a"},
    "gcp": {"cloud": "GCP", "region": "us-east5", "zone": "us-east5-a"},
    "azure": {"cloud": "Azure", "region": "eastus", "zone": None},
}
INSTANCES = {
    "aws": ("p4de.24xlarge", "us-east-1a", "us-east-1", "use1-az6"),
    "gcp": ("a2-ultragpu-8g", "us-east5-a", "us-east5", None),
    "azure": ("Standard_ND96amsr_A100_v4", "", "eastus", None),
}


@pytest.fixture
def server():
    with MetadataServer() as md:
        yield md


def env_for(md, cloud):
    return {**md.env_for(cloud), "SKYPILOT_CLUSTER_INFO": json.dumps(CLUSTER[cloud])}


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
@pytest.mark.parametrize("spot", [True, False])
def test_the_node_reads_instance_type_capacity_and_zone_from_its_clouds_metadata(server, cloud, spot):
    instance_type, zone, region, zone_id = INSTANCES[cloud]
    server.set_instance(instance_type, spot=spot, zone=zone, region=region, zone_id=zone_id)
    found = instance.read(env_for(server, cloud))
    assert found["cloud"] == cloud and found["instance_type"] == instance_type and found["spot"] is spot
    assert (
        found["capacity"]
        == {
            "aws": "spot" if spot else "on-demand",
            "gcp": "TRUE" if spot else "FALSE",
            "azure": "Spot" if spot else "Regular",
        }[cloud]
    )
    assert (found["zone"] or "") == zone and found["region"] == region
    if cloud == "aws":
        assert found["zone_id"] == "use1-az6" and server.count("aws.token", 200) == 1  # IMDSv2, one token


@pytest.mark.parametrize(
    "cloud,image,said",
    [
        ("aws", "ami-0a1b2c3d4e5f", "ami-0a1b2c3d4e5f"),
        ("gcp", "skypilot-gcp-gpu-ubuntu-241030", "skypilot-gcp-gpu-ubuntu-241030"),  # projects/0/global/images/NAME
        (
            "azure",
            "/Subscriptions/s/Providers/Microsoft.Compute/Locations/eastus/Publishers/microsoft-dsvm/x",
            "/Subscriptions/s/Providers/Microsoft.Compute/Locations/eastus/Publishers/microsoft-dsvm/x",
        ),
    ],
)
def test_the_node_reads_its_image_where_the_cloud_says_it_and_nothing_breaks_where_it_does_not(
    server, cloud, image, said
):
    instance_type, zone, region, zone_id = INSTANCES[cloud]
    server.set_instance(instance_type, spot=True, zone=zone, region=region, zone_id=zone_id, image=image)
    assert instance.read(env_for(server, cloud))["image"] == said
    server.set_instance(instance_type, spot=True, zone=zone, region=region, zone_id=zone_id)  # no image path
    found = instance.read(env_for(server, cloud))
    assert found["image"] is None and found["instance_type"] == instance_type


def test_off_a_cloud_node_nothing_is_asked_even_with_the_endpoints_set(server):
    server.set_instance("p4de.24xlarge", spot=True, zone="us-east-1a", region="us-east-1")
    assert instance.read(server.env_for()) is None  # no SKYPILOT_CLUSTER_INFO: not a cloud node
    simulated_elsewhere = {**server.env_for(), "SKYPILOT_CLUSTER_INFO": json.dumps({"cloud": "Kubernetes"})}
    assert instance.read(simulated_elsewhere) is None
    assert server.count() == 0


def test_a_metadata_service_that_does_not_say_leaves_the_start_as_it_was(server):
    # A stand-in that was told nothing answers 404, as an endpoint without the identity would.
    env = env_for(server, "gcp")
    assert instance.read(env) is None
    where = where_from_cluster_info(env["SKYPILOT_CLUSTER_INFO"], 1)
    assert instance.where_with(where, None) == where and where["instance_type"] == "unknown"


def test_an_unreachable_metadata_service_costs_a_short_timeout_not_the_start():
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"GCE_METADATA_HOST": f"127.0.0.1:{port}", "SKYPILOT_CLUSTER_INFO": json.dumps(CLUSTER["gcp"])}
    began = time.monotonic()
    assert instance.read(env) is None
    assert time.monotonic() - began < instance.BUDGET_S


def test_a_cloud_run_without_a_queue_record_is_priced_from_what_its_node_read(server):
    """The fresh-node case of issue 22: SkyPilot's queue cannot be read, so only the events say where the
    run was. The node leader's start carries the metadata; another rank's says "unknown"."""
    server.set_instance("p4de.24xlarge", spot=True, zone="us-east-1a", region="us-east-1", zone_id="use1-az6")
    env = env_for(server, "aws")
    found = instance.read(env)
    plain = where_from_cluster_info(env["SKYPILOT_CLUSTER_INFO"], 1)
    assert plain["instance_type"] == "unknown" and plain["spot"] == "unknown"
    t0 = 1_000_000.0
    base = {"run_id": "r", "attempt": 0, "node_rank": 0}
    events = [
        {**base, "ts": t0, "rank": 1, "type": "start", "where": plain},  # a rank that did not ask, first
        {
            **base,
            "ts": t0 + 0.5,
            "rank": 0,
            "type": "start",
            "where": instance.where_with(plain, found),
            "instance": found,
        },
        {**base, "ts": t0 + 3600, "rank": 0, "type": "exit", "code": 0, "reason": "complete", "step": 10},
    ]
    run = cost.run_cost(EventLog(events=events))
    (attempt,) = run.attempts
    assert (attempt.instance_type, attempt.spot, attempt.zone) == ("p4de.24xlarge", True, "us-east-1a")
    # The snapshot's p4de.24xlarge spot price in use1-az6, the zone ID the node read: 8.6505 per node-hour.
    assert attempt.usd_per_hour == 8.6505 and "zone as given" in attempt.price_detail
    assert run.cost_usd == pytest.approx(8.6505)  # one hour, from the first start to the exit
    without = cost.run_cost(EventLog(events=[{**e, "where": plain} if e["type"] == "start" else e for e in events]))
    assert without.attempts[0].usd_per_hour is None  # what such a run came to before: no price at all


# ------------------------------------------------------------------ a metadata address that misbehaves (issue 31.8)


class _Raw:
    """A loopback server answering every request with `reply(request_line)`: raw bytes, sent `drip` seconds apart
    byte by byte when `drip` is set. Stands for something odd at the metadata address, not for a cloud."""

    def __init__(self, reply, drip: float = 0.0):
        import socket
        import threading

        self.reply, self.drip = reply, drip
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        import threading

        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        import time

        try:
            request = conn.recv(65536).split(b"\r\n", 1)[0].decode()
            data = self.reply(request)
            if self.drip:
                for i in range(len(data)):
                    conn.sendall(data[i : i + 1])
                    time.sleep(self.drip)
            else:
                conn.sendall(data)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.closed = True
        self.sock.close()


def _http(status: str, body: bytes, extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def _env(cloud, port):
    key = {
        "aws": "AWS_EC2_METADATA_SERVICE_ENDPOINT",
        "gcp": "GCE_METADATA_HOST",
        "azure": "SKYSPOT_AZURE_METADATA_ENDPOINT",
    }[cloud]
    value = f"127.0.0.1:{port}" if cloud == "gcp" else f"http://127.0.0.1:{port}"
    return {key: value, "SKYPILOT_CLUSTER_INFO": json.dumps(CLUSTER[cloud])}


_AZURE_OK = {"vmSize": "Standard_ND96amsr_A100_v4", "priority": "Spot", "zone": "", "location": "eastus"}


@pytest.mark.parametrize(
    "cloud, reply, drip",
    [
        ("aws", lambda r: _http("500 Internal Server Error", b"no"), 0.0),  # the token PUT answered 500
        ("aws", lambda r: _http("429 Too Many Requests", b""), 0.0),
        ("aws", lambda r: b"GARBAGE\r\n\r\n", 0.0),  # http.client.BadStatusLine
        ("azure", lambda r: _http("200 OK", json.dumps([1, 2]).encode()), 0.0),  # a list for the document
        ("azure", lambda r: _http("200 OK", json.dumps({**_AZURE_OK, "vmSize": {"nested": [1]}}).encode()), 0.0),
        ("azure", lambda r: _http("200 OK", b'{"vmSize": NaN, "priority": "Spot"}'), 0.0),
        (
            "azure",
            lambda r: _http("200 OK", json.dumps({**_AZURE_OK, "vmSize": "x" * (3 << 20)}).encode()),
            0.0,
        ),  # 3 MB: past the cap, never read whole
        (
            "gcp",
            lambda r: _http("200 OK", b"projects/0/machineTypes/a2-ultragpu-8g", "Metadata-Flavor: Google\r\n"),
            0.5,
        ),
    ],
)
def test_an_odd_metadata_answer_leaves_the_start_as_it_was_within_the_budget(cloud, reply, drip):
    """Each of these failed the trainer's start, or held it 21.6 s against its 4 s budget (a byte every 0.5 s)."""
    import time

    server = _Raw(reply, drip)
    try:
        began = time.monotonic()
        assert instance.read(_env(cloud, server.port)) is None
        assert time.monotonic() - began < instance.BUDGET_S + 1.0
    finally:
        server.close()


def test_values_that_are_not_short_printable_strings_are_dropped_and_the_rest_kept():
    server = _Raw(
        lambda r: _http(
            "200 OK",
            json.dumps({**_AZURE_OK, "zone": {"a": 1}, "location": "east\x1bus", "storageProfile": [1]}).encode(),
        )
    )
    try:
        found = instance.read(_env("azure", server.port))
    finally:
        server.close()
    assert found["instance_type"] == "Standard_ND96amsr_A100_v4" and found["spot"] is True
    assert found["zone"] is None and found["region"] is None and found["image"] is None
