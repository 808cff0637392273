"""Placement by expected cost (issue 32): the preemption history every placement reads, its blend with the
clouds' priors, its decay, the order it gives the candidates, and the dry run that shows it."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.events import EVENTS_DIR, event_file_name
from skyspot.ledger import Ledger, skyspot_home
from skyspot.planning.candidates import candidates
from skyspot.planning.spot_risk import HALF_LIFE_S, History, add_attempts, rate_for, read_history, weight
from skyspot.recipe import load_recipe
from tests.builders import event

AZURE_A100 = {
    "cloud": "azure",
    "region": "eastus",
    "zone": "1",
    "instance_type": "Standard_ND96amsr_A100_v4",
    "spot": True,
    "accelerators": "A100-80GB:8",
}


def preempted_attempts(where: dict, *, count: int, uptime_s: float, start: float, run_id: str) -> list[dict]:
    """`count` attempts at `where`, each up `uptime_s` and then preempted, as the executor writes them."""
    events = []
    ts = start
    for n in range(count):
        events.append(event(ts, "attempt_start", n, rank=None, run_id=run_id, where=where))
        events.append(event(ts + uptime_s, "attempt_end", n, rank=None, run_id=run_id, code=75, reason="preempted"))
        ts += uptime_s + 60
    return events


def plant_run(name: str, events: list[dict], *, num_nodes: int = 1) -> Path:
    """A run in the ledger with its events in its run directory, the way a local run leaves them."""
    run_dir = skyspot_home() / "runs" / name
    (run_dir / EVENTS_DIR).mkdir(parents=True)
    (run_dir / EVENTS_DIR / event_file_name(0, 0, None)).write_text("".join(json.dumps(e) + "\n" for e in events))
    with Ledger() as ledger:
        ledger.add(name, "llama70b", "sky", run_dir=str(run_dir), total_steps=10, num_nodes=num_nodes)
        ledger.set_status(name, "SUCCEEDED")
    return run_dir


def test_no_history_gives_the_clouds_prior():
    risk = rate_for(
        read_history(),
        "azure",
        region=None,
        instance_type="Standard_ND96amsr_A100_v4",
        spot=True,
        accelerator="A100-80GB:8",
    )
    assert risk.per_node_hour == pytest.approx(1 / 4)  # Azure's prior for large GPUs: 4 node-hours (ours)
    assert risk.source == (
        "prior 1 in 4 node-h (ours; no published signal: Azure publishes eviction rates only to an "
        "authenticated Azure Resource Graph query)"
    )
    assert rate_for(None, "aws", region=None, instance_type=None, spot=False, accelerator="H100:8").per_node_hour == 0


def test_planted_preemptions_raise_that_places_rate_and_only_its():
    now = time.time()
    plant_run(
        "bursty", preempted_attempts(AZURE_A100, count=6, uptime_s=600, start=now - 7200, run_id="bursty"), num_nodes=4
    )
    history = read_history(now=now)
    risk = rate_for(
        history, "azure", region=None, instance_type="Standard_ND96amsr_A100_v4", spot=True, accelerator="A100-80GB:8"
    )
    # 6 preemptions in 6 x 600 s x 4 nodes = 4 node-hours, on a prior of 1 in 4: (1 + ~6) / (4 + ~4).
    assert risk.per_node_hour == pytest.approx(7 / 8, rel=0.01)
    assert risk.source.startswith("prior 1 in 4 node-h (ours; no published signal: ")
    assert ") + 6 preemptions in 4.0 node-h observed" in risk.source
    elsewhere = rate_for(
        history,
        "azure",
        region="westus2",
        instance_type="Standard_ND96amsr_A100_v4",
        spot=True,
        accelerator="A100-80GB:8",
    )
    assert elsewhere.per_node_hour == pytest.approx(1 / 4) and "observed" not in elsewhere.source


def test_a_simulated_place_is_no_history():
    plant_run(
        "local",
        preempted_attempts(
            {**AZURE_A100, "simulated": True}, count=6, uptime_s=600, start=time.time() - 7200, run_id="local"
        ),
    )
    assert read_history().places == {}


def test_old_preemptions_weigh_less_by_the_half_life():
    assert weight(1000.0, 1000.0 + HALF_LIFE_S) == pytest.approx(0.5)
    assert weight(1000.0, 1000.0 + 4 * HALF_LIFE_S) == pytest.approx(1 / 16)
    now = 10 * HALF_LIFE_S
    fresh, old = History(now), History(now)
    add_attempts(fresh, preempted_attempts(AZURE_A100, count=6, uptime_s=600, start=now - 7200, run_id="a"))
    add_attempts(old, preempted_attempts(AZURE_A100, count=6, uptime_s=600, start=now - 4 * HALF_LIFE_S, run_id="a"))
    args = dict(region=None, instance_type=None, spot=True, accelerator="A100-80GB:8")
    fresh_rate, old_rate = rate_for(fresh, "azure", **args), rate_for(old, "azure", **args)
    assert fresh_rate.per_node_hour > old_rate.per_node_hour > 1 / 4
    assert old_rate.observed.preemptions == pytest.approx(6 / 16, rel=0.01)


def _order(recipe) -> list[tuple[str, str, bool]]:
    return [(c.cloud, c.accelerators or "", c.spot) for c in candidates(recipe, history=read_history())]


def test_a_bursty_zone_moves_its_candidates_down_and_price_placement_keeps_the_price_order():
    by_price = _order(load_recipe("llama70b", ["resources.placement=price"], environ={}))
    assert by_price[0] == ("azure", "A100-80GB:8", True)  # the cheapest spot price
    assert _order(load_recipe("llama70b", environ={}))[0] == by_price[0]  # the prior alone does not move it
    plant_run(
        "bursty",
        preempted_attempts(AZURE_A100, count=20, uptime_s=300, start=time.time() - 9000, run_id="bursty"),
        num_nodes=4,
    )
    by_cost = _order(load_recipe("llama70b", environ={}))
    spot = [c for c in by_cost if c[2]]
    assert spot.index(("azure", "A100-80GB:8", True)) > 0
    assert by_cost[0] == ("aws", "A100-80GB:8", True)
    assert _order(load_recipe("llama70b", ["resources.placement=price"], environ={})) == by_price


def _dry_run(*args: str):
    result = CliRunner().invoke(app, ["launch", "llama70b", "--dry-run", *args], env={"COLUMNS": "250"})
    return result


def test_the_dry_run_shows_each_risk_its_source_and_why_the_order_differs():
    plant_run(
        "bursty",
        preempted_attempts(AZURE_A100, count=20, uptime_s=300, start=time.time() - 9000, run_id="bursty"),
        num_nodes=4,
    )
    result = _dry_run()
    assert result.exit_code == 0, result.stderr
    assert "PREEMPT/NODE-H" in result.stderr and "EXPECTED $/H" in result.stderr
    assert "placement: by expected cost per hour of training" in result.stderr
    assert re.search(
        r"risk azure any A100-80GB:8 Standard_ND96amsr_A100_v4 spot: \d\.\d{3} preemptions/node-h: "
        r"prior 1 in 4 node-h \(ours; no published signal: [^)]*\) \+ 20 preemptions in 6\.7 node-h observed",
        result.stderr,
    )
    # With no region, AWS's published signal is the type's median over its regions: x 1, with the ends named.
    assert (
        "risk aws any H100:8 p5.48xlarge spot: 0.167 preemptions/node-h: prior 1 in 6 node-h (ours) x 1 "
        "(AWS Spot Advisor, any region: p5.48xlarge's median of 11 regions; lowest '<5%' in ca-central-1, "
        "eu-north-1, highest '>20%' in us-east-1; feed of 2025-06-28)"
    ) in result.stderr
    moved = re.search(
        r"#(\d+) azure any A100-80GB:8 Standard_ND96amsr_A100_v4 spot is #1 by price: \$14\.42/h "
        r"\+ expected preemptions \$([\d.,]+)/h",
        result.stderr,
    )
    assert moved and int(moved.group(1)) > 1
    # The rendered task tries them in the same order: aws first now.
    first = re.search(r"- cloud: (\w+)\n    accelerators: (\S+)", result.stdout)
    assert first and first.groups() == ("aws", "A100-80GB:8")


def test_a_published_bucket_moves_a_region_down_in_the_dry_run():
    """AWS Spot Advisor's '>20%' for p5.48xlarge in us-east-1 (feed of 2025-06-28) against '5-10%' in ap-south-1
    and us-west-1: the cheapest spot price comes third by expected cost, and the risk lines say why."""
    result = _dry_run(
        "resources.clouds=[aws]",
        "resources.accelerators=[H100:8]",
        "resources.regions=[us-east-1,ap-south-1,us-west-1]",
    )
    assert result.exit_code == 0, result.stderr
    assert (
        "risk aws us-east-1 H100:8 p5.48xlarge spot: 0.304 preemptions/node-h: prior 1 in 6 node-h (ours) x 1.8 "
        "(AWS Spot Advisor '>20%' for p5.48xlarge in us-east-1 vs a median 7.5% over its 11 regions; feed of 2025-06-28)"
    ) in result.stderr
    assert "risk aws ap-south-1 H100:8 p5.48xlarge spot: 0.167 preemptions/node-h: prior 1 in 6 node-h (ours) x 1 " in (
        result.stderr
    )
    assert re.search(r"#3 aws us-east-1 H100:8 p5\.48xlarge spot is #1 by price", result.stderr)
    regions = re.findall(r"- cloud: aws\n(?:    .*\n)*?    region: (\S+)", result.stdout)
    assert regions[:3] == ["ap-south-1", "us-west-1", "us-east-1"], result.stdout


def test_the_dry_run_says_when_the_orders_agree_and_under_price_placement():
    result = _dry_run()
    assert result.exit_code == 0, result.stderr
    assert "the expected-cost order is the price order here" in result.stderr
    priced = _dry_run("resources.placement=price")
    assert priced.exit_code == 0, priced.stderr
    assert "placement: by price (resources.placement=price)" in priced.stderr
    assert "is #1 by price" not in priced.stderr


def test_an_unknown_placement_is_one_line_and_exit_2():
    result = _dry_run("resources.placement=cheapest")
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "resources.placement" in lines[0] and "Traceback" not in result.stderr


def test_a_cached_render_follows_new_history():
    def first_candidate() -> tuple[str, ...]:
        result = CliRunner().invoke(app, ["render", "llama70b"])
        assert result.exit_code == 0, result.stderr
        found = re.search(r"- cloud: (\w+)\n    accelerators: (\S+)", result.stdout)
        assert found
        return found.groups()

    assert first_candidate() == ("azure", "A100-80GB:8")
    assert first_candidate() == ("azure", "A100-80GB:8")  # from the cache
    plant_run(
        "bursty",
        preempted_attempts(AZURE_A100, count=20, uptime_s=300, start=time.time() - 9000, run_id="bursty"),
        num_nodes=4,
    )
    assert first_candidate() == ("aws", "A100-80GB:8")
    cached = sorted((skyspot_home() / "cache").iterdir())
    assert first_candidate() == ("aws", "A100-80GB:8")  # reading the history leaves the key as it was: a hit
    assert sorted((skyspot_home() / "cache").iterdir()) == cached and len(cached) == 2
