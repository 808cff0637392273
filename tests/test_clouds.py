"""Cloud facts (skyspot/clouds.py): notice windows, assumed bandwidths and their precedence, priors."""

from __future__ import annotations

import pytest

from skyspot.clouds import NOTICE_WINDOWS_S, bandwidth_for, mtbp_prior
from skyspot.errors import UsageError

MIB = 1024 * 1024


def test_notice_windows_come_from_the_watcher_module():
    assert NOTICE_WINDOWS_S == {"aws": 120.0, "gcp": 30.0, "azure": 30.0}


def test_bandwidth_precedence_argument_then_cloud_env_then_env_then_default():
    assert bandwidth_for("aws", environ={}).write_gbps == pytest.approx(218 * MIB / 1e9)
    env = {"SKYSPOT_WRITE_GBPS": "2", "SKYSPOT_WRITE_GBPS_AWS": "3", "SKYSPOT_UPLOAD_GBPS": "0.5"}
    assert bandwidth_for("gcp", environ=env).write_gbps == 2.0
    assert bandwidth_for("aws", environ=env).write_gbps == 3.0
    assert bandwidth_for("aws", environ=env).upload_gbps == 0.5
    given = {"*": {"write_gbps": 4}, "aws": {"write_gbps": 5}}
    assert bandwidth_for("aws", environ=env, overrides=given).write_gbps == 5.0
    assert bandwidth_for("azure", environ=env, overrides=given).write_gbps == 4.0


@pytest.mark.parametrize("env, overrides, message", [
    ({"SKYSPOT_UPLOAD_GBPS": "fast"}, None, "SKYSPOT_UPLOAD_GBPS"),
    ({"SKYSPOT_WRITE_GBPS": "-1"}, None, "positive"),
    ({}, {"aws": {"write_gbs": 1}}, "unknown keys"),
    ({}, {"awz": {"write_gbps": 1}}, "unknown cloud 'awz'"),
])
def test_bad_bandwidth_settings_are_usage_errors(env, overrides, message):
    with pytest.raises(UsageError, match=message):
        bandwidth_for("aws", environ=env, overrides=overrides)


def test_priors_are_per_node_and_shrink_with_the_job():
    prior = mtbp_prior("aws", "H100:8", num_nodes=4)
    assert prior.per_node_s == 6 * 3600 and prior.job_s == 5400
    assert mtbp_prior("gcp", "L4").per_node_s == 12 * 3600
    assert mtbp_prior("azure", None).accelerator_class == "cpu"
    with pytest.raises(UsageError):
        mtbp_prior("oracle", "H100")
