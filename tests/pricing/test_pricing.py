"""Prices come from SkyPilot's cached catalog when present, else the dated snapshot, and never from the network."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from skyspot.pricing import prices as pricing
from skyspot.errors import UsageError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_catalog_cache(tmp_path, monkeypatch):
    """Point SkyPilot's runtime dir at an empty folder so the snapshot answers, whatever this machine caches."""
    monkeypatch.setenv("SKY_RUNTIME_DIR", str(tmp_path / "sky-runtime"))
    yield


def test_aws_p4de_spot_and_on_demand_match_the_snapshot_row():
    # Snapshot row: aws,p4de.24xlarge,...,27.44705,8.650500,us-east-1,use1-az6
    spot = pricing.hourly_price("aws", "p4de.24xlarge", region="us-east-1", zone="use1-az6", spot=True)
    on_demand = pricing.hourly_price("aws", "p4de.24xlarge", region="us-east-1", zone="use1-az6", spot=False)
    assert spot.usd_per_hour == 8.6505
    assert on_demand.usd_per_hour == 27.44705
    assert (spot.source, spot.source_date) == ("snapshot", "2026-11-29")
    assert (spot.region, spot.zone, spot.spot) == ("us-east-1", "use1-az6", True)


def test_gcp_price_is_vm_row_plus_gpu_row_in_the_same_zone():
    # us-central1-a: g2-standard-96 VM 3.52301 (spot 1.40966) + L4 x8 4.48032 (spot 1.7848).
    on_demand = pricing.hourly_price("gcp", "g2-standard-96", region="us-central1", zone="us-central1-a", spot=False)
    spot = pricing.hourly_price("gcp", "g2-standard-96", region="us-central1", zone="us-central1-a", spot=True)
    assert on_demand.usd_per_hour == pytest.approx(3.52301 + 4.48032) == 8.00333
    assert spot.usd_per_hour == pytest.approx(1.40966 + 1.7848)


def test_gcp_accelerator_alone_prices_the_whole_instance():
    # us-east5-a: a2-ultragpu-8g 8.79698 + A100-80GB x8 35.39358 on demand.
    price = pricing.hourly_price(
        "gcp", accelerator="A100-80GB", accelerator_count=8, region="us-east5", zone="us-east5-a", spot=False
    )
    assert price.instance_type == "a2-ultragpu-8g"
    assert price.usd_per_hour == pytest.approx(8.79698 + 35.39358)


def test_without_a_region_the_cheapest_region_wins():
    # p4de spot by zone: euc1-az2 8.0274 is the lowest of the 11 rows (next: use1-az6 8.6505).
    spot = pricing.hourly_price("aws", "p4de.24xlarge", spot=True)
    assert (spot.usd_per_hour, spot.region, spot.zone) == (8.0274, "eu-central-1", "euc1-az2")
    # On demand, us-east-1 and us-west-2 tie at 27.44705; the tie goes to the first name.
    on_demand = pricing.hourly_price("aws", "p4de.24xlarge", spot=False)
    assert (on_demand.usd_per_hour, on_demand.region) == (27.44705, "us-east-1")
    assert "cheapest region" in on_demand.detail


def test_within_a_region_the_cheapest_zone_wins_and_unknown_zone_names_fall_back():
    # us-east-1 p4de spot: use1-az4 9.9734, use1-az6 8.6505. AWS VMs report zone names, the data has IDs.
    price = pricing.hourly_price("aws", "p4de.24xlarge", region="us-east-1", zone="us-east-1a", spot=True)
    assert (price.usd_per_hour, price.zone) == (8.6505, "use1-az6")
    assert "zone 'us-east-1a' not in the price data" in price.detail


@pytest.mark.parametrize(
    "cloud, accelerator, count, instance_type",
    [
        ("aws", "H100", 8, "p5.48xlarge"),
        ("aws", "A100-80GB", 8, "p4de.24xlarge"),
        ("aws", "A100", 8, "p4d.24xlarge"),
        ("aws", "L40S", 8, "g6e.48xlarge"),
        ("aws", "H200", 8, "p5en.48xlarge"),  # p5e has no on-demand price at all, so p5en ranks first
        ("gcp", "A100-80GB", 8, "a2-ultragpu-8g"),
        ("gcp", "A100", 8, "a2-highgpu-8g"),
        ("gcp", "H100", 8, "a3-highgpu-8g"),
        ("gcp", "H100-MEGA", 8, "a3-megagpu-8g"),
        ("gcp", "L4", 8, "g2-standard-96"),
        ("azure", "A100-80GB", 8, "Standard_ND96amsr_A100_v4"),
        ("azure", "A100", 8, "Standard_ND96asr_v4"),
        ("azure", "H100", 8, "Standard_ND96isr_H100_v5"),  # the catalog says 12 GPUs; corrected to 8
    ],
)
def test_instance_for_maps_accelerators_to_instance_types(cloud, accelerator, count, instance_type):
    assert pricing.instance_for(cloud, accelerator, count) == instance_type


def test_unknown_instance_or_cloud_is_a_usage_error_that_points_at_skyspot_prices():
    for call in (
        lambda: pricing.hourly_price("aws", "p9.96xlarge", spot=True),
        lambda: pricing.hourly_price("oracle", "BM.GPU.H100.8", spot=True),
        lambda: pricing.instance_for("aws", "H100", 3),
        lambda: pricing.hourly_price("aws", "p4d.24xlarge", region="mars-1", spot=False),
    ):
        with pytest.raises(UsageError) as error:
            call()
        message = str(error.value)
        assert "`skyspot prices`" in message and "\n" not in message


def test_missing_on_demand_price_is_reported_not_guessed():
    # Every p5e.48xlarge row has an empty on-demand price in the catalog.
    with pytest.raises(UsageError, match="no on-demand price"):
        pricing.hourly_price("aws", "p5e.48xlarge", spot=False)


def test_snapshot_rows_are_whole_instance_prices():
    rows = pricing.snapshot_rows()
    with open(pricing.SNAPSHOT_PATH, newline="") as f:
        raw = list(csv.DictReader(f))
    # AWS and Azure rows pass through; GCP VM rows are joined with their GPU row per zone.
    assert sum(r["cloud"] != "gcp" for r in rows) == sum(r["cloud"] != "gcp" for r in raw)
    g2 = [r for r in rows if r["instance_type"] == "g2-standard-96" and r["zone"] == "us-central1-a"]
    assert len(g2) == 1 and g2[0]["usd_per_hour"] == 8.00333 and g2[0]["accelerator"] == "L4"
    assert {r["source_date"] for r in rows} == {"2026-11-29"}
    assert all(r["source"].startswith("skypilot-org/skypilot-catalog") for r in rows)


def _run_isolated(code: str, env_extra: dict) -> dict:
    """Run `code` in a fresh interpreter whose sockets refuse to connect; it prints one JSON line."""
    guard = textwrap.dedent("""
        import socket
        def _refuse(*args, **kwargs):
            raise AssertionError("network access attempted")
        socket.socket.connect = _refuse
        socket.create_connection = _refuse
    """)
    env = {k: v for k, v in os.environ.items() if k != "SKY_RUNTIME_DIR"}
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, "-c", guard + textwrap.dedent(code)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_without_a_catalog_cache_nothing_imports_sky_or_touches_the_network(tmp_path):
    result = _run_isolated(
        """
        import json, sys
        from skyspot.pricing import prices as pricing
        price = pricing.hourly_price("aws", accelerator="H100", accelerator_count=8, spot=True)
        print(json.dumps({"sky": "sky" in sys.modules, "source": price.source}))
    """,
        {"HOME": str(tmp_path), "SKY_RUNTIME_DIR": str(tmp_path / "runtime")},
    )
    assert result == {"sky": False, "source": "snapshot"}


def test_a_cached_catalog_is_used_without_importing_sky_and_falls_back_per_instance(tmp_path):
    catalog = tmp_path / ".sky" / "catalogs" / "v8" / "aws" / "vms.csv"
    catalog.parent.mkdir(parents=True)
    catalog.write_text(
        "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,AvailabilityZone,Arch\n"
        "p4de.24xlarge,A100-80GB,8.0,96.0,1152.0,,30.0,9.5,us-east-1,use1-az1,x86_64\n"
        "p4de.24xlarge,A100-80GB,8.0,96.0,1152.0,,30.0,7.25,us-east-1,use1-az2,x86_64\n"
    )
    result = _run_isolated(
        """
        import json, sys
        from skyspot.pricing import prices as pricing
        cached = pricing.hourly_price("aws", "p4de.24xlarge", region="us-east-1", spot=True)
        other = pricing.hourly_price("aws", "p5.48xlarge", region="us-east-1", spot=False)
        print(json.dumps({"sky": "sky" in sys.modules, "cached": [cached.usd_per_hour, cached.source],
                          "other": other.source}))
    """,
        {"HOME": str(tmp_path / "home"), "SKY_RUNTIME_DIR": str(tmp_path)},
    )
    assert result == {"sky": False, "cached": [7.25, "skypilot-catalog"], "other": "snapshot"}


def test_catalog_path_is_where_skypilot_keeps_its_catalog(tmp_path):
    # Pins our copy of SkyPilot's layout (schema version and runtime dir) to the installed SkyPilot.
    result = _run_isolated(
        """
        import json
        from sky.catalog import common
        from skyspot.pricing import prices as pricing
        print(json.dumps({"sky": common.get_catalog_path("gcp/vms.csv"), "ours": str(pricing.catalog_path("gcp"))}))
    """,
        {"HOME": str(tmp_path), "SKY_RUNTIME_DIR": str(tmp_path / "runtime")},
    )
    assert result["sky"] == result["ours"]


# --- prices SkyPilot would actually pay -------------------------------------------------------


@pytest.mark.parametrize(
    "zone, opt_in",
    [
        ("use1-atl2-az1", True),  # Local Zone ID (Atlanta), as the catalog spells it
        ("us-east-1-atl-2a", True),  # the same zone by name, as a VM reports it
        ("use1-wl1-bos-wlz1", True),  # Wavelength zone ID
        ("us-east-1-wl1-bos-wlz-1", True),  # Wavelength zone name
        ("use1-az4", False),
        ("us-east-1a", False),
        ("us-gov-west-1a", False),
        ("apse2-az3", False),
    ],
)
def test_opt_in_zones_are_recognised_by_id_and_by_name(zone, opt_in):
    assert pricing.opt_in_zone("aws", zone) is opt_in
    assert pricing.opt_in_zone("gcp", zone) is False  # GCP and Azure have no opt-in zones


def test_a_local_zone_row_never_prices_a_plan():
    # p5.48xlarge spot: use1-atl2-az1 (Atlanta Local Zone) 10.2397 is the lowest row in the snapshot, but an
    # account must opt into it; SkyPilot prices the candidate at us-east-2's use2-az1 11.2543 (x4 = 45.02).
    anywhere = pricing.hourly_price("aws", accelerator="H100", accelerator_count=8, spot=True)
    assert (anywhere.usd_per_hour, anywhere.region, anywhere.zone) == (11.2543, "us-east-2", "use2-az1")
    assert round(4 * anywhere.usd_per_hour, 2) == 45.02
    # Pinned to us-east-1: the cheapest zone every account has, use1-az6 17.6289 (x4 = 70.52, SkyPilot's figure).
    in_region = pricing.hourly_price("aws", "p5.48xlarge", region="us-east-1", spot=True)
    assert (in_region.usd_per_hour, in_region.zone) == (17.6289, "use1-az6")
    # An attempt that really ran there (the account opted in) is still priced where it ran.
    ran_there = pricing.hourly_price("aws", "p5.48xlarge", region="us-east-1", zone="use1-atl2-az1", spot=True)
    assert (ran_there.usd_per_hour, ran_there.zone) == (10.2397, "use1-atl2-az1")
    # `skyspot prices` does not list it either.
    rows = pricing.snapshot_rows("aws")
    assert [r["zone"] for r in rows if r["opt_in_zone"]] == ["use1-atl2-az1", "use1-atl2-az1"]  # p5, p5en


def test_a_cached_catalog_local_zone_row_never_prices_either(tmp_path, monkeypatch):
    # p6-b200.48xlarge is not in the snapshot, so only the cached catalog can answer.
    catalog = tmp_path / ".sky" / "catalogs" / "v8" / "aws" / "vms.csv"
    catalog.parent.mkdir(parents=True)
    header = (
        "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,"
        "AvailabilityZone,Arch\n"
    )
    local_zone = "p6-b200.48xlarge,B200,8.0,192.0,2048.0,,113.9,1.0,us-west-2,usw2-lax1-az1,x86_64\n"
    regular = "p6-b200.48xlarge,B200,8.0,192.0,2048.0,,113.9,20.0,us-west-2,usw2-az3,x86_64\n"
    catalog.write_text(header + local_zone + regular)
    monkeypatch.setenv("SKY_RUNTIME_DIR", str(tmp_path))
    price = pricing.hourly_price("aws", accelerator="B200", accelerator_count=8, spot=True)
    assert (price.usd_per_hour, price.zone, price.source) == (20.0, "usw2-az3", "skypilot-catalog")
    other = tmp_path / "other"
    (other / ".sky" / "catalogs" / "v8" / "aws").mkdir(parents=True)
    (other / ".sky" / "catalogs" / "v8" / "aws" / "vms.csv").write_text(header + local_zone)
    monkeypatch.setenv("SKY_RUNTIME_DIR", str(other))
    with pytest.raises(UsageError):  # priced only in a zone an account must opt into: no price at all
        pricing.hourly_price("aws", "p6-b200.48xlarge", region="us-west-2", spot=True)


def test_a_missing_spot_price_is_never_the_on_demand_price(tmp_path, monkeypatch):
    # Every Standard_ND96isr_H100_v5 row lists SpotPrice == Price (98.32 in eastus): not a spot price.
    with pytest.raises(pricing.MissingPrice, match="no spot price for azure 'Standard_ND96isr_H100_v5'"):
        pricing.hourly_price("azure", accelerator="H100", accelerator_count=8, spot=True)
    assert pricing.hourly_price("azure", accelerator="H100", accelerator_count=8, spot=False).usd_per_hour == 98.32
    assert {
        r["spot_usd_per_hour"]
        for r in pricing.snapshot_rows("azure")
        if r["instance_type"] == "Standard_ND96isr_H100_v5"
    } == {None}
    # AWS caps spot at on-demand and does reach it: such a row stays a spot price (p5 use1-az4 55.04).
    assert (
        pricing.hourly_price("aws", "p5.48xlarge", region="us-east-1", zone="use1-az4", spot=True).usd_per_hour == 55.04
    )
    # SkyPilot's Azure fetcher writes 0 where Azure's API has no H100 price: missing, not free.
    catalog = tmp_path / ".sky" / "catalogs" / "v8" / "azure" / "vms.csv"
    catalog.parent.mkdir(parents=True)
    catalog.write_text(
        "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,"
        "Generation\nStandard_ND96isr_H100_v5,H100,8,96,1900,,0.0,0.0,eastus,V2\n"
    )
    monkeypatch.setenv("SKY_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(pricing.MissingPrice):
        pricing.hourly_price("azure", "Standard_ND96isr_H100_v5", region="eastus", spot=True)


# --- egress ---------------------------------------------------------------------------------


def test_egress_prices_are_dated_sourced_and_in_the_source_notes():
    notes = (pricing.SNAPSHOT_PATH.parent / "SOURCE.md").read_text()
    expected = {"aws": (0.09, "GB"), "gcp": (0.12, "GiB"), "azure": (0.087, "GB")}
    for cloud, (usd, unit) in expected.items():
        price = pricing.egress_price(cloud)
        assert (price.usd_per_unit, price.unit) == (usd, unit)
        assert price.page.startswith("https://") and price.as_of == "2026-11-30"
        assert f"{usd:g}" in notes and price.page.split()[0] in notes
    assert pricing.egress_price("gcp").cost(2**30) == pytest.approx(0.12)
    assert pricing.egress_price("aws").cost(10**9) == pytest.approx(0.09)


@pytest.mark.parametrize(
    "store, cloud",
    [("s3://my-bucket/x", "aws"), ("gs://my-bucket/x", "gcp"), ("/tmp/runs", None), (None, None), ("", None)],
)
def test_a_store_uri_names_its_cloud(store, cloud):
    assert pricing.store_cloud(store) == cloud


def test_an_accelerator_alone_is_priced_at_the_cheapest_type_that_carries_it_as_skypilot_picks():
    # AWS L40S:1 is on g6e.xlarge and g6e.2xlarge; spot, the bigger one is cheaper in eu-south-2 (eus2-az3).
    assert pricing.hourly_price("aws", instance_type="g6e.xlarge", spot=True, snapshot_only=True).usd_per_hour == 0.4796
    spot = pricing.hourly_price("aws", accelerator="L40S", accelerator_count=1, spot=True, snapshot_only=True)
    assert (spot.instance_type, spot.usd_per_hour, spot.zone) == ("g6e.2xlarge", 0.2944, "eus2-az3")
    on_demand = pricing.hourly_price("aws", accelerator="L40S:1", spot=False, snapshot_only=True)
    assert (on_demand.instance_type, on_demand.usd_per_hour) == ("g6e.xlarge", 1.861)


@pytest.mark.parametrize(
    ("cloud", "accelerator", "count", "lacks"),
    [
        ("gcp", "A10G", 1, "gcp offers no A10G:1 instance (the price snapshot lists it on aws only)"),
        ("aws", "A100-80GB", 1, "aws offers no A100-80GB:1 instance (the price snapshot lists it on azure, gcp only)"),
        ("azure", "L4", 1, "azure offers no L4:1 instance (the price snapshot lists it on aws, gcp only)"),
        ("aws", "A10G", 1, None),
        ("aws", "H100", 4, None),  # listed nowhere: not the snapshot's to say; SkyPilot's catalog decides
    ],
)
def test_a_pair_listed_on_another_cloud_only_is_one_this_cloud_lacks(cloud, accelerator, count, lacks):
    assert pricing.offered(cloud, accelerator, count) == lacks
