"""`skyspot spot-risk`: each spot placement's preemption rate, from our prior, the published signal and this
machine's history, through the real CLI."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from tests.planning.test_spot_risk import plant_run, preempted_attempts

runner = CliRunner()


def _rows(*args: str) -> list[dict]:
    result = runner.invoke(app, ["spot-risk", *args, "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_the_table_shows_each_region_its_published_bucket_and_rate():
    result = runner.invoke(app, ["spot-risk", "--instance", "p5.48xlarge"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "AWS Spot Advisor feed of 2025-06-28" in lines[0]
    header = next(i for i, line in enumerate(lines) if line.startswith("CLOUD"))
    assert lines[header].split() == ["CLOUD", "REGION", "INSTANCE", "PUBLISHED", "OBSERVED", "PREEMPT/NODE-H", "SOURCE"]
    first = lines[header + 1].split()
    assert first[:8] == ["aws", "any", "p5.48xlarge", "median", "of", "11", "(x1)", "none"]
    assert first[8] == "0.167"
    east = next(line for line in lines if line.startswith("aws    us-east-1 "))
    assert "'>20%' (x1.8)" in east and " 0.304  prior 1 in 6 node-h (ours) x 1.8 (AWS Spot Advisor '>20%'" in east
    north = next(line for line in lines if line.startswith("aws    eu-north-1 "))
    assert "'<5%' (x0.58)" in north and " 0.096 " in north


def test_json_has_one_row_per_placement_with_prior_signal_history_and_rate():
    rows = _rows("--cloud", "aws", "--instance", "p5.48xlarge")
    assert rows[0]["region"] is None  # any region first
    assert all(r["spot"] is True and r["instance_type"] == "p5.48xlarge" for r in rows)
    assert len({r["region"] for r in rows}) == len(rows)
    east = next(r for r in rows if r["region"] == "us-east-1")
    assert east["published_label"] == ">20%" and east["published_date"] == "2025-06-28"
    assert "spot-advisor-data.json" in east["published_source"] and "@5eedf20a" in east["published_source"]
    assert east["prior_per_node_hour"] == pytest.approx(1 / 6)
    assert east["per_node_hour"] == pytest.approx((25 / 7.5) ** 0.5 / 6)
    assert east["observed_preemptions"] == 0 and east["observed"] == "none"
    missing = next(r for r in rows if r["region"] == "ap-northeast-2")  # priced, not in the feed
    assert missing["published_label"] is None and missing["per_node_hour"] == pytest.approx(1 / 6)
    assert (
        "no published signal: the AWS Spot Advisor feed of 2025-06-28 has no p5.48xlarge in ap-northeast-2"
        in (missing["source"])
    )


def test_a_region_filter_and_a_cloud_without_published_signals():
    rows = _rows("--cloud", "azure", "--instance", "Standard_ND96amsr_A100_v4", "--region", "eastus")
    assert [(r["cloud"], r["region"]) for r in rows] == [("azure", "eastus")]
    assert rows[0]["published"] == "none published" and rows[0]["published_label"] is None
    assert "Azure publishes eviction rates only to an authenticated Azure Resource Graph query" in rows[0]["source"]
    assert rows[0]["per_node_hour"] == pytest.approx(1 / 4)


def test_this_machines_preemptions_show_in_observed_and_the_rate():
    where = {
        "cloud": "aws",
        "region": "us-west-2",
        "zone": "usw2-az1",
        "instance_type": "p5.48xlarge",
        "spot": True,
        "accelerators": "H100:8",
    }
    plant_run("west", preempted_attempts(where, count=3, uptime_s=1200, start=time.time() - 7200, run_id="west"))
    rows = _rows("--instance", "p5.48xlarge", "--region", "us-west-2")
    assert len(rows) == 1
    assert rows[0]["observed_preemptions"] == 3 and rows[0]["observed"] == "3 in 1.0 node-h"
    assert rows[0]["per_node_hour"] > 1 / 6 * 1.5  # '5-10%' (x1) and 3 preemptions in an hour
    assert "+ 3 preemptions in 1.0 node-h observed" in rows[0]["source"]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--cloud", "oracle"], "no prices for cloud 'oracle'"),
        (["--instance", "p5.48xlage"], "no instance type 'p5.48xlage'"),
        (["--cloud", "gcp", "--instance", "p5.48xlarge"], "no instance type 'p5.48xlarge'"),
        (["--instance", "p5.48xlarge", "--region", "mars-1"], "no p5.48xlarge placement in region 'mars-1'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, words):
    result = runner.invoke(app, ["spot-risk", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.stderr
    assert "Traceback" not in result.output and result.stdout == ""
