"""Zoned spot traces: each spot attempt is placed in a zone by `resources.placement` (executors/local/zones.py).

The placement itself is checked on its own; the run through `launch tiny --local` uses the stand-in nodes of
test_local_controller.py (a few lines of bash in place of the trainer), so the whole cycle of placements,
preemptions and recoveries takes seconds; the cost report then prices each attempt where it ran.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.errors import UsageError
from skyspot.executors.local.executor import LocalOptions, make_spec
from skyspot.executors.local.spot_trace import SpotTrace, Zone
from skyspot.executors.local.zones import Placer, snapshot_prices
from skyspot.app.launch import build
from skyspot.ledger import Ledger

from tests.executors.local.test_local_controller import executor_attempts, nodes  # noqa: F401 (a fixture)
from tests.executors.local.test_spot_trace import _trace

runner = CliRunner()

BURSTS = """\
notice: 0
zones:
  aws/us-east-1/us-east-1a: {preemptions: [PREEMPTIONS]}
  aws/us-east-2/us-east-2a: {}
"""


def test_a_zoned_trace_is_read_zone_by_zone(tmp_path):
    trace = SpotTrace.load(
        _trace(
            tmp_path,
            "zones:\n  aws/us-east-1/us-east-1a: {preemptions: [9, 3], unavailable: [[20, 30]]}\n"
            "  aws/us-west-2/us-west-2b:\n",
        )
    )
    a, b = trace.zones
    assert (a.key, a.preemptions, a.unavailable, a.losses()) == (
        "aws/us-east-1/us-east-1a",
        (3.0, 9.0),
        ((20.0, 30.0),),
        [3.0, 9.0, 20.0],
    )
    assert (b.key, b.losses()) == ("aws/us-west-2/us-west-2b", [])
    assert not a.available(25) and trace.available(25)  # another zone has capacity
    assert SpotTrace.from_spec({"zones": [z.as_dict() for z in trace.zones]}).zones == trace.zones


@pytest.mark.parametrize(
    "text, message",
    [
        ("zones: []\n", "'zones' must map 'cloud/region/zone'"),
        ("zones:\n  aws/us-east-1: {}\n", "must be cloud/region/zone"),
        ("zones:\n  ibm/us-east-1/a: {}\n", "'ibm' is not one of aws, gcp, azure"),
        ("zones:\n  aws/eastus/eastus-1: {}\n", "'eastus' is not a AWS region name"),
        ("zones:\n  aws/us-east-1/us-east-1a: {when: [1]}\n", "takes 'preemptions' and 'unavailable' only"),
        ("zones:\n  aws/us-east-1/us-east-1a: {preemptions: [.inf]}\n", "finite seconds"),
        ("zones:\n  aws/us-east-1/us-east-1a: {unavailable: [[5, 1]]}\n", "'unavailable' must be a list"),
        ("preemptions: [1]\nzones:\n  aws/us-east-1/us-east-1a: {}\n", "move preemptions into the zones"),
        ("zones:\n" + "".join(f"  aws/us-east-1/z{i}: {{}}\n" for i in range(65)), "at most 64"),
    ],
)
def test_a_bad_zone_is_one_clear_line(tmp_path, text, message):
    with pytest.raises(UsageError, match=message) as err:
        SpotTrace.load(_trace(tmp_path, text))
    assert "\n" not in str(err.value)


def _zones(*keys: str) -> list[Zone]:
    return [Zone(*key.split("/")) for key in keys]


def test_price_order_returns_to_the_cheapest_zone_and_expected_cost_leaves_it_while_the_burst_lasts():
    zones = _zones("aws/us-east-1/us-east-1a", "aws/us-east-1/us-east-1b", "aws/us-east-2/us-east-2a")
    prices = snapshot_prices(zones, "g5.48xlarge")  # the snapshot's spot prices, per region
    assert prices["aws/us-east-1/us-east-1a"] == prices["aws/us-east-1/us-east-1b"] < prices["aws/us-east-2/us-east-2a"]
    by_price = Placer(zones, "price", prices)
    by_cost = Placer(zones, "expected_cost", prices, burst_s=600, restart_s=60)
    for placer in (by_price, by_cost):
        zone, _ = placer.choose(0)
        assert zone.key == "aws/us-east-1/us-east-1a"  # nothing lost yet: the price order
        placer.lost(zone, 10)
    assert by_price.choose(20)[0].key == "aws/us-east-1/us-east-1a"  # SkyPilot 0.14.1's relaunch, #10021
    # us-east-1a: 4.54 x (1 + 2 x 60/600) = 5.45; us-east-1b: 4.54 x 1.1 = 4.99; us-east-2a: 4.82, no loss.
    zone, why = by_cost.choose(20)
    assert zone.key == "aws/us-east-2/us-east-2a"
    assert by_cost.expected(zones[0], 20) == pytest.approx(prices["aws/us-east-1/us-east-1a"] * 1.2)
    assert (
        "passed over aws/us-east-1/us-east-1a: expected $5.45/h (spot $4.54/h; 1 preemption(s) in its region "
        "and 1 in the zone in the last 600s, 60s per restart)" in why
    )
    assert by_cost.choose(611)[0].key == "aws/us-east-1/us-east-1a"  # the burst is over: the price order again


def test_a_dearer_zone_is_not_worth_a_short_restart_and_outages_are_skipped():
    a, b = Zone("aws", "us-east-1", "us-east-1a"), Zone("aws", "us-west-2", "us-west-2a", unavailable=((0, 50),))
    prices = snapshot_prices([a, b], "g5.48xlarge")  # us-west-2: 70 % dearer
    placer = Placer([a, b], "expected_cost", prices, burst_s=600, restart_s=60)
    assert placer.choose(10)[0] == a
    placer.lost(a, 10)
    assert placer.choose(20)[0] == a  # b has no capacity until 50 s
    assert placer.choose(60)[0] == a  # 5.45 expected here against 7.74 there: staying pays
    placer.restart_s = 600  # a cloud's restart: 4.54 x 3 against 7.74
    assert placer.choose(60)[0] == b
    assert Placer([b], "price").choose(10) == (None, "no zone has spot capacity")
    assert Placer([a, b], "expected_cost", prices, burst_s=0, restart_s=600, losses=[(a, 10)]).choose(60)[0] == a


def _built(*overrides: str):
    return build("tiny", list(overrides), local=True)


def test_zones_reach_the_spec_with_the_recipes_placement_and_are_refused_where_they_cannot_apply(tmp_path):
    trace = _trace(tmp_path, BURSTS.replace("PREEMPTIONS", "5"))
    spec = make_spec(
        _built("resources.placement=price", "resources.burst_minutes=2"), "r", LocalOptions(spot_trace=trace)
    )
    assert [z["region"] for z in spec.zones] == ["us-east-1", "us-east-2"]
    assert (spec.placement, spec.burst_s) == ("price", 120.0)
    prices = {(row["region"], row["spot"]) for row in json.loads(spec.task_envs.get("SKYSPOT_PRICES", "[]"))}
    assert not prices or ("us-east-2", True) in prices  # the dashboards' cost curve prices each zone's region
    with pytest.raises(UsageError, match="zones on aws, but the simulated cloud is gcp: pass --simulate aws"):
        make_spec(_built(), "r", LocalOptions(spot_trace=trace, cloud="gcp"))
    with pytest.raises(UsageError, match="a deadline's policy does not read zones"):
        make_spec(_built(), "r", LocalOptions(spot_trace=trace, deadline={"at": 1}))


def _run(name: str, trace: str, placement: str):
    result = runner.invoke(
        app,
        [
            "launch",
            "tiny",
            "--local",
            "-n",
            name,
            "--provision-delay",
            "1",
            "--spot-trace",
            trace,
            f"resources.placement={placement}",
            "resources.burst_minutes=0.2",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.stderr
    return [e["where"]["zone"] for e in executor_attempts(name) if e["type"] == "attempt_start"]


@pytest.mark.slow  # two runs through the controller: about 20 s
def test_recoveries_leave_the_zone_that_failed_and_the_price_order_goes_back_there(nodes, tmp_path):  # noqa: F811
    """Issue 32: one zone preempted three times within seconds, another calm. Each attempt's node runs 6 s; a
    restart here is about 2 s (1 s provisioning), so a preemption counts for 12 s (resources.burst_minutes=0.2):
    the time scale of the trace, as a cloud's 15 min restarts are to its 30 min default."""
    nodes["run"] = ["sleep 6; exit 0"]
    trace = _trace(tmp_path, BURSTS.replace("PREEMPTIONS", "1, 5, 9"))
    assert _run("by-cost", trace, "expected_cost") == ["us-east-1a", "us-east-2a"]
    placed = _run("by-price", trace, "price")
    assert placed[:3] == ["us-east-1a"] * 3 and len(placed) >= 3  # preempted there again, and again
    log = Path(Ledger().get("by-cost").run_dir, "logs", "run.log").read_text()
    assert (
        "spot attempt placed in aws/us-east-2/us-east-2a (expected_cost): expected $4.82/h (spot $4.82/h); "
        "passed over aws/us-east-1/us-east-1a: expected $" in log
    )
    for name, regions in (("by-cost", {"us-east-1", "us-east-2"}), ("by-price", {"us-east-1"})):
        report = runner.invoke(app, ["cost-report", name, "--json"], catch_exceptions=False)
        assert report.exit_code == 0, report.stderr
        attempts = json.loads(report.stdout)[0]["attempts"]
        assert {a["region"] for a in attempts} == regions
        rates = {a["region"]: a["usd_per_hour"] for a in attempts}
        assert rates["us-east-1"] == pytest.approx(4.5408)
        if "us-east-2" in rates:
            assert rates["us-east-2"] == pytest.approx(4.8231)
