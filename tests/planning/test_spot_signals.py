"""Published spot signals (issue 32): the shipped AWS Spot Advisor snapshot, the multiplier it puts on the
prior, and what the plan's rate does with it."""

from __future__ import annotations

import csv
import time

import pytest

from skyspot.planning.spot_risk import History, add_attempts, rate_for
from skyspot.planning.spot_signals import (
    FEED_DATE,
    MIDPOINTS,
    SIGNALS_PATH,
    WEIGHT,
    NoSignal,
    Signal,
    ratio_of,
    regions,
    signal_for,
)
from skyspot.pricing.prices import SNAPSHOT_PATH
from tests.builders import event

H100 = dict(spot=True, accelerator="H100:8")


def test_the_shipped_snapshot_holds_the_feeds_buckets():
    # From the raw feed (spot-advisor-data.json, github:alexei-led/spotinfo @5eedf20a, vendored 2025-06-28),
    # spot_advisor[region]["Linux"][type]: us-east-1 p5.48xlarge {"s": 52, "r": 4}, eu-north-1 p5.48xlarge
    # {"s": 55, "r": 0}, us-east-2 p4d.24xlarge {"s": 66, "r": 1}, us-west-2 p4de.24xlarge {"s": 67, "r": 3}.
    with SIGNALS_PATH.open(newline="") as handle:
        rows = {(r["region"], r["instance_type"]): r for r in csv.DictReader(handle)}
    expected = {
        ("us-east-1", "p5.48xlarge"): ("4", ">20%", "52"),
        ("eu-north-1", "p5.48xlarge"): ("0", "<5%", "55"),
        ("us-east-2", "p4d.24xlarge"): ("1", "5-10%", "66"),
        ("us-west-2", "p4de.24xlarge"): ("3", "15-20%", "67"),
    }
    for key, (bucket, label, savings) in expected.items():
        row = rows[key]
        assert (row["cloud"], row["bucket"], row["label"], row["savings_pct"]) == ("aws", bucket, label, savings)
    assert regions("p5.48xlarge")["us-east-1"] == 4 and len(regions("p5.48xlarge")) == 11  # 11 regions in the feed


def test_only_aws_types_the_price_snapshot_knows_are_shipped():
    with SNAPSHOT_PATH.open(newline="") as handle:
        priced = {r["instance_type"] for r in csv.DictReader(handle) if r["cloud"] == "aws"}
    with SIGNALS_PATH.open(newline="") as handle:
        shipped = list(csv.DictReader(handle))
    assert {r["cloud"] for r in shipped} == {"aws"}
    assert {r["instance_type"] for r in shipped} <= priced
    assert len(shipped) == len({(r["region"], r["instance_type"]) for r in shipped}) == 140
    assert regions("p5e.48xlarge") == {}  # priced, but not in the feed


def test_the_multiplier_is_the_midpoint_over_the_types_median_clamped_then_weighted():
    assert MIDPOINTS == (2.5, 7.5, 12.5, 17.5, 25.0)
    assert ratio_of(0, 7.5) == pytest.approx(1 / 3)
    assert ratio_of(4, 2.5) == 4.0  # 25 / 2.5 = 10, clamped
    assert ratio_of(0, 25.0) == 0.25  # 2.5 / 25 = 0.1, clamped
    # p5.48xlarge over its 11 regions: 2 x '<5%', 5 x '5-10%', 2 x '10-15%', 1 x '15-20%', 1 x '>20%'.
    high = signal_for("aws", "us-east-1", "p5.48xlarge")
    assert isinstance(high, Signal) and high.median_pct == 7.5 and high.label == ">20%"
    assert high.multiplier == pytest.approx((25 / 7.5) ** WEIGHT) == pytest.approx(1.8257, abs=1e-4)
    low = signal_for("aws", "eu-north-1", "p5.48xlarge")
    assert isinstance(low, Signal) and low.multiplier == pytest.approx((2.5 / 7.5) ** 0.5)
    g5 = signal_for("aws", "us-east-1", "g5.48xlarge")  # median '<5%': '>20%' is 10x, clamped to 4, so x2
    assert isinstance(g5, Signal) and g5.ratio == 4.0 and g5.multiplier == pytest.approx(2.0)


def test_any_region_is_the_types_median_and_names_its_ends():
    found = signal_for("aws", None, "p5.48xlarge")
    assert isinstance(found, Signal) and found.multiplier == 1.0 and found.regions == 11
    assert found.lowest == ("ca-central-1", "eu-north-1") and found.low_label == "<5%"
    assert found.highest == ("us-east-1",) and found.high_label == ">20%"
    assert found.text() == (
        "x 1 (AWS Spot Advisor, any region: p5.48xlarge's median of 11 regions; lowest '<5%' in ca-central-1, "
        "eu-north-1, highest '>20%' in us-east-1; feed of 2025-06-28)"
    )


def test_a_low_bucket_region_ranks_below_a_high_one_for_the_same_type():
    low = rate_for(None, "aws", region="eu-north-1", instance_type="p5.48xlarge", **H100)
    anywhere = rate_for(None, "aws", region=None, instance_type="p5.48xlarge", **H100)
    high = rate_for(None, "aws", region="us-east-1", instance_type="p5.48xlarge", **H100)
    assert low.per_node_hour < anywhere.per_node_hour < high.per_node_hour
    assert anywhere.per_node_hour == pytest.approx(1 / 6)  # the prior alone (AWS large GPUs: 6 node-h, ours)
    assert high.per_node_hour == pytest.approx((25 / 7.5) ** 0.5 / 6)
    assert high.prior_per_node_hour == pytest.approx(1 / 6)
    assert high.source == (
        "prior 1 in 6 node-h (ours) x 1.8 (AWS Spot Advisor '>20%' for p5.48xlarge in us-east-1 vs a median 7.5% "
        "over its 11 regions; feed of 2025-06-28)"
    )


def test_the_history_still_outweighs_the_published_signal():
    now = time.time()
    history = History(now)
    where = {"cloud": "aws", "region": "eu-north-1", "instance_type": "p5.48xlarge", "spot": True}
    events = []
    for n in range(10):  # ten preemptions, each after 10 minutes, in the '<5%' region
        start = now - 7200 + n * 660
        events.append(event(start, "attempt_start", n, rank=None, run_id="r", where=where))
        events.append(event(start + 600, "attempt_end", n, rank=None, run_id="r", code=75, reason="preempted"))
    add_attempts(history, events)
    seen = rate_for(history, "aws", region="eu-north-1", instance_type="p5.48xlarge", **H100)
    quiet = rate_for(history, "aws", region="us-east-1", instance_type="p5.48xlarge", **H100)
    assert seen.per_node_hour > quiet.per_node_hour  # '<5%' published, but ten preemptions seen here
    prior_hours = 6 / (2.5 / 7.5) ** 0.5
    assert seen.per_node_hour == pytest.approx(
        (1 + seen.observed.preemptions) / (prior_hours + seen.observed.node_hours)
    )
    assert "x 0.58 (AWS Spot Advisor '<5%'" in seen.source and "+ 10 preemptions in 1.7 node-h observed" in seen.source


@pytest.mark.parametrize(
    "cloud, region, instance_type, why",
    [
        ("azure", "eastus", "Standard_ND96amsr_A100_v4", "authenticated Azure Resource Graph query"),
        ("gcp", "us-central1", "a3-highgpu-8g", "GCP publishes no per-type preemption rate"),
        ("aws", "us-east-1", "p5e.48xlarge", f"p5e.48xlarge is not in the AWS Spot Advisor feed of {FEED_DATE}"),
        ("aws", "ap-east-1", "p5.48xlarge", "has no p5.48xlarge in ap-east-1"),
        ("aws", "us-east-1", None, "no instance type"),
        ("oracle", None, "x", "none known for cloud 'oracle'"),
    ],
)
def test_no_published_signal_says_why_and_leaves_the_prior(cloud, region, instance_type, why):
    found = signal_for(cloud, region, instance_type)
    assert isinstance(found, NoSignal) and why in found.why and found.multiplier == 1.0
    if cloud in ("aws", "azure", "gcp"):
        risk = rate_for(None, cloud, region=region, instance_type=instance_type, **H100)
        assert risk.per_node_hour == pytest.approx(risk.prior_per_node_hour)
        assert f"(ours; no published signal: {found.why})" in risk.source


def test_the_source_notes_name_the_feed_its_date_and_what_is_missing():
    notes = (SIGNALS_PATH.parent / "SOURCE.md").read_text()
    section = notes[notes.index("## Published spot signals") :]
    for needed in (FEED_DATE, "5eedf20a99614443af215f4aaf09bd10805cac72", "spot-advisor-data.json", "Azure", "GCP"):
        assert needed in section, needed
