"""moto's EC2 on loopback, seeded with Amazon's EFA image (SkyPilot's EFA image name, owner alias "amazon"):
what an AWS launch with the fabric resolves at launch (skyspot/clouds/aws_images.py). Only the cloud's
control plane is stood in for; boto3, botocore and the lookup are the real ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from skyspot.clouds import aws_images
from skyspot.ports import free_port

AMAZON_AMI = "ami-0a1b2c3d4e5f60718"


@pytest.fixture(scope="session")
def ec2_server(tmp_path_factory):
    """moto's server in a process of its own, seeded (MOTO_AMIS_PATH, read when moto is imported) with one
    AMI of SkyPilot's EFA name; moto gives the images of that file the owner alias "amazon"."""
    seed = tmp_path_factory.mktemp("amis") / "amis.json"
    seed.write_text(
        json.dumps(
            [
                {
                    "ami_id": AMAZON_AMI,
                    "state": "available",
                    "public": True,
                    "owner_id": "898082745236",
                    "name": aws_images.EFA_IMAGE_NAME,
                    "description": "Amazon's",
                    "image_type": "machine",
                    "architecture": "x86_64",
                    "virtualization_type": "hvm",
                    "root_device_type": "ebs",
                    "root_device_name": "/dev/sda1",
                    "hypervisor": "xen",
                    "creation_date": "2025-08-08T00:00:00.000Z",
                }
            ]
        )
    )
    port = free_port()
    env = {**os.environ, "MOTO_AMIS_PATH": str(seed)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    for _ in range(100):
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def aws_env(ec2_server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_EC2", ec2_server)  # EC2 only: a test's S3 server keeps its own endpoint
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(ec2_server + "/moto-api/reset", method="POST"), timeout=10)
    import boto3

    return lambda region: boto3.session.Session().client("ec2", region_name=region)
