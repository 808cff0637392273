"""The fabric per cloud: Amazon's EFA image by owner (moto's EC2 on loopback), the EFA interfaces SkyPilot
attaches (its own function over moto's DescribeInstanceTypes), and the NCCL environment each cloud's fabric
candidate gets in the rendered task."""

from __future__ import annotations

import json
import subprocess

import pytest

from skyspot.app.launch import add_efa_images, build, efa_regions
from skyspot import clouds
from skyspot.clouds import aws_images
from skyspot.clouds.aws import MAX_EFA_INTERFACES, efa_interfaces, is_efa_instance_type
from skyspot.clouds.azure import AZURE_HPC_IMAGE
from skyspot.errors import UsageError
from skyspot.trainer import nccl_env
from tests.ec2_server import AMAZON_AMI


def _squat(ec2) -> str:
    """A newer public AMI of the same name from another account (moto's own, 123456789012)."""
    return ec2.register_image(
        Name=aws_images.EFA_IMAGE_NAME,
        RootDeviceName="/dev/sda1",
        BlockDeviceMappings=[{"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 8}}],
    )["ImageId"]


def test_amazons_efa_image_is_chosen_and_a_newer_look_alike_never(aws_env):
    ec2 = aws_env("eu-west-2")
    assert aws_images.resolve(["eu-west-2"]) == {"eu-west-2": AMAZON_AMI}
    squatter = _squat(ec2)
    found = aws_images.efa_image("eu-west-2")
    assert found.amazon == AMAZON_AMI and found.skypilot_pick == squatter  # newer, so SkyPilot's rule takes it
    with pytest.raises(UsageError, match=rf"refused: in eu-west-2 .* is {squatter} .*not Amazon's {AMAZON_AMI}") as e:
        aws_images.resolve(["eu-west-2"])
    assert "\n" not in str(e.value)


def test_skypilots_own_lookup_boots_the_look_alike(aws_env):
    """Why skyspot refuses rather than trusts: SkyPilot 0.14.1's `_get_efa_image_id` over the same server."""
    from sky.clouds import aws as sky_aws

    squatter = _squat(aws_env("ap-south-1"))
    sky_aws._get_efa_image_id.cache_clear()
    assert sky_aws._get_efa_image_id("ap-south-1") == squatter


def test_without_amazons_image_the_fabric_is_refused_in_one_line(aws_env):
    ec2 = aws_env("ca-central-1")
    ec2.deregister_image(ImageId=AMAZON_AMI)
    with pytest.raises(UsageError, match="no EFA image .* owned by Amazon in ca-central-1") as e:
        aws_images.resolve(["ca-central-1"])
    assert "\n" not in str(e.value)


def test_without_credentials_the_fabric_is_refused_in_one_line(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(UsageError, match="AWS credentials are missing"):
        aws_images.resolve(["us-east-1"])


def test_launch_renders_amazons_image_per_region_for_the_efa_candidates(aws_env):
    built = add_efa_images(build("llama70b"))
    images = json.loads(built.task["envs"][aws_images.IMAGES_ENV])
    assert set(images) == set(efa_regions(built.candidates)) and "us-east-1" in images
    assert set(images.values()) == {AMAZON_AMI}


def test_no_aws_lookup_without_an_efa_candidate():
    built = add_efa_images(build("tiny"))  # no credentials here: a lookup would raise
    assert aws_images.IMAGES_ENV not in built.task["envs"]


def test_launch_refuses_the_fabric_when_a_look_alike_is_newest(aws_env):
    _squat(aws_env("us-east-1"))
    with pytest.raises(UsageError, match="the fabric on AWS refused: in us-east-1"):
        add_efa_images(build("llama70b"))


# ------------------------------------------------------------------ EFA interfaces


@pytest.mark.parametrize("instance_type", sorted(MAX_EFA_INTERFACES))
def test_max_efa_interfaces_match_skypilots_own_function(aws_env, instance_type):
    from sky.clouds import aws as sky_aws

    sky_aws._get_max_efa_interfaces.cache_clear()
    assert sky_aws._get_max_efa_interfaces(instance_type, "us-east-1") == MAX_EFA_INTERFACES[instance_type]
    assert sky_aws._is_efa_instance_type(instance_type) is is_efa_instance_type(instance_type) is True


def test_the_efa_rule_is_skypilots():
    from sky.clouds import aws as sky_aws

    for t in ("p4d.24xlarge", "p5.48xlarge", "g5.2xlarge", "m5.large", "p3.16xlarge", "trn1.32xlarge"):
        assert sky_aws._is_efa_instance_type(t) is is_efa_instance_type(t)


def test_one_efa_interface_without_internal_ips_all_with_them():
    assert efa_interfaces("p4de.24xlarge", use_internal_ips=False) == (1, 4)
    assert efa_interfaces("p4de.24xlarge", use_internal_ips=True) == (4, 4)
    assert efa_interfaces("p5.48xlarge", use_internal_ips=False) == (1, 32)
    assert efa_interfaces("p5.48xlarge", use_internal_ips=True) == (32, 32)
    assert efa_interfaces("m5.large", use_internal_ips=True) == (0, 0)


# ------------------------------------------------------------------ NCCL environment per cloud


def test_each_clouds_fabric_candidate_gets_its_nccl_env_and_others_none():
    built = build("llama70b")
    table = json.loads(built.task["envs"][nccl_env.FABRIC_ENV])
    assert table["p4de.24xlarge"]["FI_PROVIDER"] == "efa" and table["p5.48xlarge"]["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert "/opt/amazon/ofi-nccl/lib" in table["p5.48xlarge"]["SKYSPOT_LIBPATH_PREPEND"]
    tcpx = table["a3-highgpu-8g"]
    assert (tcpx["NCCL_ALGO"], tcpx["NCCL_PROTO"], tcpx["NCCL_NSOCKS_PERTHREAD"], tcpx["NCCL_BUFFSIZE"]) == (
        "Ring",
        "Simple",
        "4",
        "8388608",
    )
    assert table["Standard_ND96isr_H100_v5"]["NCCL_TOPO_FILE"] == "/opt/microsoft/ndv5-topo.xml"
    assert table["Standard_ND96amsr_A100_v4"]["NCCL_IB_PCI_RELAXED_ORDERING"] == "1"
    assert "a2-ultragpu-8g" not in table  # GCP A100: no fabric, no env
    # Microsoft's HPC image (SkyPilot's tag for it) on every Azure ND candidate, no image on any other.
    images = {
        (e["cloud"], e["accelerators"], e["use_spot"]): e.get("image_id") for e in built.task["resources"]["ordered"]
    }
    assert {k: v for k, v in images.items() if v} == {
        ("azure", a, s): AZURE_HPC_IMAGE for a in ("A100-80GB:8", "H100:8") for s in (True, False)
    }


def test_azure_nd_candidates_note_infiniband_from_the_image_without_network_tier():
    built = build("llama70b")
    azure = [c for c in built.candidates if c.cloud == "azure"]
    assert {c.instance_type for c in azure} == {"Standard_ND96amsr_A100_v4", "Standard_ND96isr_H100_v5"}
    for c in azure:
        assert c.network_tier is None  # SkyPilot 0.14.1 drops an Azure candidate that asks (CUSTOM_NETWORK_TIER)
        assert c.fabric.startswith("InfiniBand via Microsoft's HPC image (skypilot:gpu-ubuntu-2204)"), c.fabric
    azure_cloud = clouds.get("azure")
    assert azure_cloud.fabric_image("Standard_NC24ads_A100_v4") is None  # one A100, no InfiniBand
    assert azure_cloud.image_fabric("Standard_NC24ads_A100_v4") is None
    assert all(clouds.get(n).image_fabric("p5.48xlarge") is None for n in ("aws", "gcp"))


def test_a_recipe_without_the_fabric_renders_no_fabric_env():
    built = build("llama70b", ["resources.network_tier=standard"])
    assert nccl_env.FABRIC_ENV not in built.task["envs"]
    assert not any("image_id" in e for e in built.task["resources"]["ordered"])


def test_the_node_exports_only_its_own_instance_types_env():
    built = build("llama70b")
    envs = built.task["envs"]
    lines = nccl_env.exports(envs, {"cloud": "gcp", "instance_type": "a3-highgpu-8g"})
    assert "export NCCL_ALGO=Ring" in lines and not any("FI_PROVIDER" in x for x in lines)
    aws = nccl_env.exports(envs, {"cloud": "aws", "instance_type": "p5.48xlarge"})
    assert "export FI_PROVIDER=efa" in aws and any(x.startswith("export LD_LIBRARY_PATH=") for x in aws)
    assert nccl_env.exports(envs, {"cloud": "gcp", "instance_type": "a2-ultragpu-8g"}) == []
    assert nccl_env.exports(envs, None) == []
    out = subprocess.run(
        ["bash", "-c", 'eval "$1"; echo "$FI_PROVIDER|$SKYSPOT_LIBPATH_KEEP"', "-", "\n".join(aws)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == "efa|/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib"


def test_a_node_on_another_ami_than_amazons_stops_in_setup():
    envs = {aws_images.IMAGES_ENV: json.dumps({"us-east-1": AMAZON_AMI})}
    node = {"cloud": "aws", "instance_type": "p5.48xlarge", "region": "us-east-1"}
    assert nccl_env.image_problem(envs, {**node, "image": AMAZON_AMI}) is None
    problem = nccl_env.image_problem(envs, {**node, "image": "ami-00000000000000bad"})
    assert problem and "ami-00000000000000bad" in problem and "\n" not in problem
    assert nccl_env.image_problem(envs, {**node, "instance_type": "m5.large", "image": "x"}) is None


def test_off_a_cloud_node_nothing_is_read_or_printed(capsys, monkeypatch):
    monkeypatch.setenv(nccl_env.FABRIC_ENV, json.dumps({"p5.48xlarge": {"FI_PROVIDER": "efa"}}))
    assert nccl_env.main([]) == 0
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------ the dry run


def test_dry_run_says_how_many_efa_interfaces_and_what_gives_all(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from skyspot.cli.main import app

    monkeypatch.setenv("SKYPILOT_GLOBAL_CONFIG", str(tmp_path / "config.yaml"))
    result = CliRunner().invoke(app, ["launch", "llama70b", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "EFA on p4de.24xlarge: SkyPilot will attach 1 of 4 EFA interfaces" in result.output
    assert "EFA on p5.48xlarge: SkyPilot will attach 1 of 32 EFA interfaces" in result.output
    assert "use_internal_ips: true" in result.output
    (tmp_path / "config.yaml").write_text("aws:\n  use_internal_ips: true\n  use_ssm: true\n")
    result = CliRunner().invoke(app, ["launch", "llama70b", "--dry-run"])
    assert "EFA on p5.48xlarge: SkyPilot will attach all 32 EFA interface(s)" in result.output
