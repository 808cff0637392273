"""Cloud facts (skyspot/clouds/): one registered class per cloud that provides every part a cloud must,
the registry's refusals, notice windows, assumed bandwidths and their precedence, priors."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

from skyspot import clouds
from skyspot.clouds import NOTICE_WINDOWS_S, bandwidth_for, mtbp_prior
from skyspot.clouds.base import REQUIRED, Cloud, CloudDefinitionError, SimulatedPlace, missing_parts, register
from skyspot.errors import UsageError
from skyspot.storage import parse_store_uri

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


@pytest.mark.parametrize(
    "env, overrides, message",
    [
        ({"SKYSPOT_UPLOAD_GBPS": "fast"}, None, "SKYSPOT_UPLOAD_GBPS"),
        ({"SKYSPOT_WRITE_GBPS": "-1"}, None, "positive"),
        ({}, {"aws": {"write_gbs": 1}}, "unknown keys"),
        ({}, {"awz": {"write_gbps": 1}}, "unknown cloud 'awz'"),
    ],
)
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


# --------------------------------------------------------------------------- the registry (issue 33)


def test_the_three_clouds_are_registered_in_order():
    assert clouds.names() == ("aws", "gcp", "azure") == clouds.CLOUDS
    assert [c.name for c in clouds.all()] == list(clouds.names())
    assert clouds.get("AWS") is clouds.get(" aws ") is clouds.all()[0]


@pytest.mark.parametrize("cloud", clouds.all(), ids=lambda c: c.name)
def test_every_registered_cloud_provides_every_part(cloud):
    assert not missing_parts(type(cloud))
    for part in REQUIRED:
        assert hasattr(cloud, part), part
    assert cloud.notice_window_s > 0 and cloud.notice_poll_s > 0 and cloud.notice_detect_s >= 0
    assert cloud.sigterm in ("at_deadline", "with_notice", None)
    assert set(cloud.prior_node_hours) == {"large", "small", "cpu"}
    write, why = cloud.root_disk_write(256)
    assert write > 0 and why
    # the bound notice protocol exists and has the one entry point the watcher calls
    node_module = importlib.import_module(cloud.notice_watcher)
    assert callable(node_module.bind) and callable(node_module.read_instance)
    # a redirect to a local metadata server sets the watcher's own variable first, at that server, and
    # nothing points at a real metadata address
    redirect = cloud.metadata_redirect_env("http://127.0.0.1:8123")
    assert next(iter(redirect)) == cloud.metadata_endpoint_var
    assert "127.0.0.1:8123" in redirect[cloud.metadata_endpoint_var]
    assert not any("169.254" in v or "metadata.google" in v for v in redirect.values())
    # its simulated node is in one of the cloud's own regions
    assert cloud.region_pattern.match(cloud.simulated.region) and cloud.simulated.min_poll_s > 0
    # its store scheme is one skyspot.storage parses, and names this cloud back
    assert (
        parse_store_uri(
            f"{cloud.store_scheme}://acct/bucket/run"
            if cloud.store_scheme == "az"
            else f"{cloud.store_scheme}://bucket/run"
        ).scheme
        == cloud.store_scheme
    )
    assert clouds.STORE_CLOUDS[cloud.store_scheme] == cloud.name


def _complete_parts() -> dict:
    """Every part of REQUIRED, with values a cloud could have (a planted fourth cloud)."""
    return {
        "name": "oracle",
        "label": "OCI",
        "notice_window_s": 30.0,
        "notice_poll_s": 5.0,
        "notice_detect_s": 5.0,
        "notice_watcher": "skyspot.trainer.notice.oracle",
        "sigterm": None,
        "planned_actions": frozenset(),
        "metadata_endpoint_var": "SKYSPOT_OCI_METADATA_ENDPOINT",
        "metadata_default_endpoint": "http://169.254.169.254",
        "store_scheme": "oci",
        "spot_signal": None,
        "spot_signal_missing": "Oracle publishes no preemption rate",
        "region_pattern": re.compile(r"^[a-z]+-[a-z]+-\d+$"),
        "fabric": None,
        "fabric_accelerators": (),
        "no_fabric": "none",
        "upload_gbps": 1.0,
        "prior_node_hours": {"large": 1.0, "small": 1.0, "cpu": 1.0},
        "attached_gpus": (),
        "spot_at_on_demand_is_spot": True,
        "count_fixes": {},
        "root_disk_write": lambda self, disk_size_gb: (1.0, "planted"),
        "native_action": lambda self, action: action,
        "simulated": SimulatedPlace(region="us-ashburn-1", zone=None, stand_in="BM.GPU.H100.8", min_poll_s=0.05),
        "metadata_redirect_env": lambda self, url: {"SKYSPOT_OCI_METADATA_ENDPOINT": url},
        "fabric_env": lambda self, instance_type: {},
        "fabric_image": lambda self, instance_type: None,
    }


def test_a_planted_cloud_with_every_part_passes_the_check():
    planted = type("Oracle", (Cloud,), _complete_parts())
    assert missing_parts(planted) == []


@pytest.mark.parametrize("part", REQUIRED)
def test_a_new_cloud_missing_one_part_fails_the_registrys_check(part):
    parts = _complete_parts()
    del parts[part]
    planted = type("Oracle", (Cloud,), parts)
    with pytest.raises(CloudDefinitionError, match=f"cloud class Oracle lacks {part} "):
        register(planted)
    assert "oracle" not in clouds.names()


def test_register_refuses_what_is_not_a_cloud_and_a_second_class_of_one_name():
    with pytest.raises(CloudDefinitionError, match="not a subclass"):
        register(object)  # type: ignore[arg-type]
    twin = type("OtherAWS", (Cloud,), {**_complete_parts(), "name": "aws"})
    with pytest.raises(CloudDefinitionError, match="registered twice"):
        register(twin)
    assert type(clouds.get("aws")).__name__ == "AWS"


@pytest.mark.parametrize(
    "lookup",
    [
        clouds.get,
        lambda name: bandwidth_for(name, environ={}),
        lambda name: mtbp_prior(name),
        lambda name: clouds.fast_fabric(name, "H100:8"),
    ],
)
def test_an_unknown_cloud_is_a_one_line_usage_error(lookup):
    with pytest.raises(UsageError) as raised:
        lookup("oracle")
    message = str(raised.value)
    assert message == "unknown cloud 'oracle'; expected aws, gcp or azure"
    assert "\n" not in message
    assert clouds.find("oracle") is None and clouds.find(None) is None


def test_an_unknown_cloud_on_the_command_line_is_one_line_and_exit_2():
    code = (
        "import sys\nfrom skyspot import clouds\nfrom skyspot.errors import UsageError\n"
        "try:\n    clouds.get('oracle')\nexcept UsageError as e:\n    print(e); sys.exit(e.exit_code)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout.count("\n") == 1 and "Traceback" not in done.stderr


def test_facts_derived_from_the_classes_keep_their_published_values():
    assert clouds.fast_fabric("aws", "A100:8") == ("EFA", "")
    assert clouds.fast_fabric("gcp", "A100:8") == (None, "GPUDirect-TCPX is for H100:8 (a3-highgpu-8g) only")
    assert clouds.fast_fabric("azure", "H100:8")[0] is None
    assert clouds.get("aws").opt_in_zone("use1-atl2-az1") and not clouds.get("aws").opt_in_zone("use1-az4")
    assert not clouds.get("gcp").opt_in_zone("us-central1-a")
    assert clouds.get("gcp").native_action("maintenance") == "TERMINATE_ON_HOST_MAINTENANCE"
    assert clouds.get("azure").native_action("preempt") == "Preempt"
    assert "system-reboot" in clouds.get("aws").planned_actions
    assert clouds.get("azure").count_fixes == {"standard_nd96isr_h100_v5": 8}


def test_the_node_side_rules_come_from_the_cloud(monkeypatch):
    from skyspot.trainer.notice import fallback_target, watch_target

    info = '{"cloud": "%s"}'
    assert watch_target({"SKYPILOT_CLUSTER_INFO": info % "AWS", "AWS_EC2_METADATA_DISABLED": "true"}) is None
    assert watch_target({"SKYPILOT_CLUSTER_INFO": info % "GCP"}) == ("gcp", "http://metadata.google.internal")
    assert fallback_target({"SKYPILOT_CLUSTER_INFO": info % "GCP"}) == "http://169.254.169.254"
    assert fallback_target({"SKYPILOT_CLUSTER_INFO": info % "Azure"}) is None
    assert watch_target({"SKYPILOT_CLUSTER_INFO": info % "Oracle"}) is None  # a cloud we do not know: no watcher


def test_no_module_outside_clouds_branches_on_a_clouds_name():
    """One cloud, one module: a comparison with a cloud's name literal belongs in skyspot/clouds/ (the
    class's `name` is what others compare with, when they must)."""
    import pathlib

    pattern = re.compile(r"""[!=]=\s*["'](aws|gcp|azure)["']|["'](aws|gcp|azure)["']\s*[!=]=|\bcloud\s*==""")
    root = pathlib.Path(clouds.__file__).resolve().parents[1]
    found = [
        f"{path.relative_to(root)}:{number}"
        for path in sorted(root.rglob("*.py"))
        if "clouds" not in path.relative_to(root).parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
