"""Shared test setup: an isolated SKYSPOT_HOME, no stray SKYSPOT_* overrides, and no cloud traffic."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ec2_server import aws_env, ec2_server  # noqa: F401 - shared fixtures

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["tests.storage_servers", "tests.hub_server", "tests.node_stack"]


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith("SKYSPOT_") or name.startswith("SKYPILOT_"):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SKYSPOT_HOME", str(tmp_path / "skyspot-home"))
    # An in-process W&B run (tests/trainer/test_metrics.py) leaves its service's address in WANDB_SERVICE;
    # restored at teardown, so no later test's trainers inherit that service.
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    # Code with no cloud configured stays quiet; these make sure SDKs never reach metadata addresses.
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # A launch with AWS EFA candidates asks EC2 for Amazon's EFA image (clouds/aws_images.py): in a test
    # that does not start moto's EC2 for it (the aws_env fixture), the ask goes to a closed loopback
    # port and fails at once, never to a real EC2 endpoint.
    monkeypatch.setenv("AWS_ENDPOINT_URL_EC2", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")
    yield


def sky_home(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "sky-home"


@pytest.fixture(scope="session")
def sky_env(tmp_path_factory):
    """An environment whose HOME is a throwaway dir, for tests that start SkyPilot's local API server.

    The server is stopped when the session ends (`sky api stop`)."""
    home = sky_home(tmp_path_factory)
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKYSPOT_", "SKYPILOT_", "AWS_", "GOOGLE_"))}
    env.update(
        HOME=str(home),
        AWS_EC2_METADATA_DISABLED="true",
        NO_COLOR="1",
        SKYSPOT_HOME=str(home / ".skyspot"),
        COLUMNS="200",
    )
    yield env
    if (home / ".sky").exists():
        subprocess.run(
            [sys.executable, "-c", "from sky.client import sdk; sdk.api_stop()"],
            env=env,
            capture_output=True,
            timeout=120,
        )


# One uninterrupted `tiny` run every faulted run outside tests/trainer must equal bitwise (the
# reliability tests, the local executor's end-to-end tests). Checkpoint frequency does not change
# the arithmetic, and 2 nodes x 1 rank train exactly as 1 node x 2 ranks (the same world size over
# gloo), so one reference serves runs with any checkpoint interval and node layout. tests/trainer
# has its own, shorter one (tests/trainer/conftest.py).
REFERENCE_STEPS = 24


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The run dir of `tiny` trained for REFERENCE_STEPS steps on 2 ranks without interruption."""
    from tests.trainer.launch import finish, log_text, start

    run_dir = tmp_path_factory.mktemp("reference") / "run"
    code = finish(start(run_dir, [f"train.steps={REFERENCE_STEPS}", "checkpoint.every_steps=8", "train.log_every=8"]))
    assert code == 0, log_text(run_dir)
    return run_dir
