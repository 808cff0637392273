"""The candidate order: spot before on-demand, each group by expected $/h for all nodes, including the
internet egress a candidate on another cloud than the store pays (docs/planning.md, "Egress").

Figures for llama70b (4 nodes; one checkpoint = 70,553,706,496 parameters x 12 B = 846,644,477,952 B;
checkpoint.every_seconds 1800, so 2 uploads an hour; spot priors per node: aws 6 h, gcp and azure 4 h,
so one preemption of the 4-node job every 1.5 h on aws and every hour on gcp and azure).
"""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.planning.candidates import candidates, egress
from skyspot.recipe import load_recipe
from skyspot.trainer.interval import initial_plan

CKPT_70B = 846_644_477_952
# Azure A100-80GB:8 spot, store on S3: 2 uploads/h leave Azure at $0.087/GB, 1 resume/h leaves AWS at $0.09/GB.
AZURE_SPOT_EGRESS = 2 * CKPT_70B / 1e9 * 0.087 + CKPT_70B / 1e9 * 0.09  # 147.316139 + 76.198003 = 223.514142
AZURE_ON_DEMAND_EGRESS = 2 * CKPT_70B / 1e9 * 0.087  # no preemptions, no resumes


@pytest.fixture(autouse=True)
def no_catalog_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SKY_RUNTIME_DIR", str(tmp_path / "sky-runtime"))


def plan(store=None, *overrides):
    return candidates(load_recipe("llama70b", list(overrides), flags={"storage.store": store}, environ={}), environ={})


def key(c):
    return (c.cloud, c.accelerators, "spot" if c.spot else "on-demand")


def test_aws_h100_spot_is_priced_where_every_account_can_run_not_in_a_local_zone():
    by_key = {key(c): c for c in plan()}
    h100 = by_key[("aws", "H100:8", "spot")]
    # Not the Atlanta Local Zone's 10.2397 (40.96 for 4 nodes): us-east-2's 11.2543, SkyPilot's 45.02.
    assert h100.usd_per_hour == 11.2543 and round(4 * h100.usd_per_hour, 2) == 45.02


def test_a_candidate_without_a_spot_price_shows_none_and_comes_after_the_priced_spot_ones():
    ordered = plan()
    azure_h100 = next(c for c in ordered if key(c) == ("azure", "H100:8", "spot"))
    assert azure_h100.usd_per_hour is None and azure_h100.expected_usd_per_hour is None
    assert azure_h100.price_note == "no spot price in snapshot"
    spot = [c for c in ordered if c.spot]
    assert spot[-1] is azure_h100 and all(c.usd_per_hour is not None for c in spot[:-1])
    # ... and still before every on-demand candidate, even the ones cheaper than its on-demand price.
    assert [c.spot for c in ordered] == [True] * 6 + [False] * 6
    on_demand = next(c for c in ordered if key(c) == ("azure", "H100:8", "on-demand"))
    assert on_demand.usd_per_hour == 98.32


def test_without_a_cloud_store_the_order_is_by_node_price_alone():
    ordered = plan()
    assert [key(c) for c in ordered[:5]] == [
        ("azure", "A100-80GB:8", "spot"),
        ("aws", "A100-80GB:8", "spot"),
        ("aws", "H100:8", "spot"),
        ("gcp", "H100:8", "spot"),
        ("gcp", "A100-80GB:8", "spot"),
    ]
    assert all(c.egress_usd_per_hour == 0 for c in ordered)
    assert [c.expected_usd_per_hour for c in ordered] == [
        None if c.usd_per_hour is None else 4 * c.usd_per_hour for c in ordered
    ]
    assert [key(c) for c in plan("/tmp/local-store")] == [key(c) for c in ordered]


def test_a_cross_cloud_candidate_pays_egress_and_moves_behind_a_same_cloud_one():
    ordered = plan("s3://my-bucket/x")
    by_key = {key(c): c for c in ordered}
    azure = by_key[("azure", "A100-80GB:8", "spot")]
    # The cheapest nodes (14.42/h for 4) but 223.51/h of egress: behind both AWS spot candidates.
    assert azure.egress_usd_per_hour == pytest.approx(AZURE_SPOT_EGRESS) == pytest.approx(223.514142, abs=1e-6)
    assert azure.expected_usd_per_hour == pytest.approx(4 * 3.6047 + AZURE_SPOT_EGRESS)
    assert by_key[("azure", "A100-80GB:8", "on-demand")].egress_usd_per_hour == pytest.approx(AZURE_ON_DEMAND_EGRESS)
    assert [key(c) for c in ordered[:3]] == [
        ("aws", "A100-80GB:8", "spot"),
        ("aws", "H100:8", "spot"),
        ("azure", "A100-80GB:8", "spot"),
    ]
    assert by_key[("aws", "A100-80GB:8", "spot")].egress_usd_per_hour == 0
    # The rule of docs/architecture.md holds: every spot candidate before any on-demand one.
    assert [c.spot for c in ordered] == [True] * 6 + [False] * 6
    # Within each group, cheapest expected cost first, unpriced last.
    for group in ([c for c in ordered if c.spot], [c for c in ordered if not c.spot]):
        totals = [c.expected_usd_per_hour for c in group if c.expected_usd_per_hour is not None]
        assert totals == sorted(totals)
    # A GCS store turns it round: the GCP candidates lead.
    assert {key(c)[0] for c in plan("gs://my-bucket/x")[:2]} == {"gcp"}


def test_gcp_egress_is_priced_per_gib_and_resumes_leave_the_store_cloud():
    recipe = load_recipe("llama70b", [], flags={"storage.store": "s3://my-bucket/x"}, environ={})
    traffic = egress(recipe, "gcp", spot=True, accelerator="H100:8", environ={})
    assert (traffic.upload_bytes_per_hour, traffic.download_bytes_per_hour) == (2 * CKPT_70B, CKPT_70B)
    assert traffic.usd_per_hour == pytest.approx(2 * CKPT_70B / 2**30 * 0.12 + CKPT_70B / 1e9 * 0.09)


def test_egress_follows_the_recipe_checkpoint_interval_and_preemption_prior():
    def azure_egress(*overrides):
        recipe = load_recipe("llama70b", list(overrides), flags={"storage.store": "s3://my-bucket/x"}, environ={})
        return egress(recipe, "azure", spot=True, accelerator="A100-80GB:8", environ={}), recipe

    faster, _ = azure_egress("checkpoint.every_seconds=900")
    assert faster.upload_bytes_per_hour == 4 * CKPT_70B
    calmer, _ = azure_egress("checkpoint.mtbp_prior_seconds=7200")
    assert calmer.download_bytes_per_hour == CKPT_70B / 2
    auto, recipe = azure_egress("checkpoint.every_seconds=auto")
    every = initial_plan(recipe, "azure", environ={}).every_seconds
    assert auto.upload_bytes_per_hour == pytest.approx(CKPT_70B * 3600 / every)
    # An interval in steps only: the step time is unknown before the run, so uploads are not counted
    # (and the plan says so) rather than guessed.
    steps_only, _ = azure_egress("checkpoint.every_seconds=null")
    assert steps_only.upload_bytes_per_hour is None and "not counted" in steps_only.note
    assert steps_only.usd_per_hour == pytest.approx(CKPT_70B / 1e9 * 0.09)


def test_launch_dry_run_with_an_s3_store_shows_egress_per_candidate_and_orders_by_it():
    result = CliRunner().invoke(app, ["launch", "llama70b", "--dry-run", "--store", "s3://my-bucket/x"])
    assert result.exit_code == 0, result.stderr
    rows = [
        [cell.strip() for cell in line.split("│")[1:-1]]
        for line in result.stderr.splitlines()
        if re.match(r"│ \d+ ", line)
    ][:12]
    header = next(line for line in result.stderr.splitlines() if "EGRESS $/H" in line)
    assert [h.strip() for h in header.split("┃")[1:-1]] == [
        "#",
        "CLOUD",
        "REGION",
        "ACCELERATORS",
        "INSTANCE",
        "CAPACITY",
        "NODES $/H",
        "EGRESS $/H",
        "TOTAL $/H",
        "PREEMPT/NODE-H",
        "EXPECTED $/H",
        "NOTE",
    ]
    table = [(r[1], r[3], r[5], r[6], r[7], r[8]) for r in rows]
    assert table[:3] == [
        ("aws", "A100-80GB:8", "spot", "32.11", "0.00", "32.11"),
        ("aws", "H100:8", "spot", "45.02", "0.00", "45.02"),
        ("azure", "A100-80GB:8", "spot", "14.42", "223.51", "237.93"),
    ]
    assert ("azure", "H100:8", "spot", "-", "223.51", "-") == table[5] and "no spot price in snapshot" in rows[5][11]
    assert "egress: the store is on aws" in result.stderr
    # The rendered task on stdout lists the candidates in the same order.
    ordered = re.findall(r"- cloud: (\w+)\n    accelerators: (\S+)\n    use_spot: (\w+)", result.stdout)
    assert [(c, a, "spot" if s == "true" else "on-demand") for c, a, s in ordered] == [r[:3] for r in table]
