"""What each instance type's fabric should carry, and the one judgment of a probe against it
(clouds/fabric_rates.py): the figures from the clouds' own pages, the fraction, one node, sockets, gloo."""

from __future__ import annotations

import pytest

from skyspot.clouds import fabric_rates
from skyspot.clouds.fabric_rates import MIN_FRACTION, expected_for, judge, summarize


@pytest.mark.parametrize(
    ("instance_type", "gbytes", "fabric"),
    [
        ("p4d.24xlarge", 50, "EFA"),
        ("p4de.24xlarge", 50, "EFA"),
        ("p5.48xlarge", 400, "EFA"),
        ("a3-highgpu-8g", 100, "GPUDirect-TCPX"),
        ("a3-megagpu-8g", 200, "GPUDirect-TCPXO"),
        ("Standard_ND96asr_v4", 200, "InfiniBand HDR"),
        ("Standard_ND96isr_H100_v5", 400, "InfiniBand NDR"),
    ],
)
def test_each_fabric_is_its_links_times_their_rate_in_gbytes(instance_type, gbytes, fabric):
    rate = expected_for(instance_type)
    assert rate is not None and rate.busbw_gbytes == gbytes and rate.fabric == fabric
    assert rate.source.startswith("https://")


def test_every_rate_names_its_source_and_sits_under_its_cloud():
    for cloud, table in fabric_rates.RATES.items():
        for name, rate in table.items():
            assert rate.cloud == cloud and rate.instance_type == name and rate.total_gbps > 0
            assert "https://" in rate.source
    assert expected_for("p4d.24xlarge", "gcp") is None  # keyed per cloud
    assert expected_for(None) is None and expected_for("g5.48xlarge") is None


def test_one_efa_interface_of_four_is_below_half_and_four_are_not():
    p4d = expected_for("p4d.24xlarge")
    one = judge(busbw_gbps=20.0, transport="ofi", num_nodes=2, expected=p4d)  # SkyPilot's EFA example, 1 interface
    four = judge(busbw_gbps=78.0, transport="ofi", num_nodes=2, expected=p4d)  # ... and all four
    assert one.below_expected and one.short and one.warns and one.expected_gbps == 50
    assert "measured 20.00 GB/s bus bandwidth on ofi, expected 50 GB/s (p4d.24xlarge 4 x 100 Gb/s EFA)" in one.line
    assert not four.short and not four.warns and four.line is None
    edge = judge(busbw_gbps=MIN_FRACTION * 50, transport="ofi", num_nodes=2, expected=p4d)
    assert not edge.below_expected  # at the fraction is not below it


def test_sockets_warn_gloo_is_only_refused_and_one_node_is_not_judged():
    socket = judge(busbw_gbps=3.0, transport="socket", num_nodes=4, expected=expected_for("p5.48xlarge"))
    assert socket.on_sockets and socket.short and socket.warns and "plain TCP (socket)" in socket.line
    gloo = judge(busbw_gbps=0.9, transport="gloo", num_nodes=2, expected=None)
    assert gloo.short and not gloo.warns and gloo.expected_gbps is None
    assert "no expected figure for this instance type" in gloo.line
    alone = judge(busbw_gbps=0.1, transport="socket", num_nodes=1, expected=expected_for("p5.48xlarge"))
    assert not alone.short and not alone.warns and alone.line is None
    unprobed = judge(busbw_gbps=None, transport="ofi", num_nodes=2, expected=expected_for("p5.48xlarge"))
    assert not unprobed.short  # nothing measured is nothing below


def test_an_attempts_fabric_is_its_slowest_node_and_any_warning():
    events = [
        {"transport": "ofi", "busbw_gbps": 70.0, "expected_gbps": 50.0, "below_expected": False},
        {"transport": "ofi", "busbw_gbps": 20.0, "expected_gbps": 50.0, "below_expected": True, "warning": "below"},
    ]
    assert summarize(events) == {
        "transport": "ofi",
        "busbw_gbps": 20.0,
        "expected_gbps": 50.0,
        "below_expected": True,
        "on_sockets": False,
        "warning": "below",
    }
    assert summarize([]) is None
    old = summarize([{"transport": "socket"}])  # an event from before the probe: transport only
    assert old["busbw_gbps"] is None and old["warning"] is None
