"""Shared test setup: an isolated SKYSPOT_HOME, no stray SKYSPOT_* overrides, and no cloud traffic."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["tests.storage_servers"]


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith("SKYSPOT_") or name.startswith("SKYPILOT_"):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SKYSPOT_HOME", str(tmp_path / "skyspot-home"))
    # Code with no cloud configured stays quiet; these make sure SDKs never reach metadata addresses.
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
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
    env.update(HOME=str(home), AWS_EC2_METADATA_DISABLED="true", NO_COLOR="1",
               SKYSPOT_HOME=str(home / ".skyspot"), COLUMNS="200")
    yield env
    if (home / ".sky").exists():
        subprocess.run([sys.executable, "-c", "from sky.client import sdk; sdk.api_stop()"],
                       env=env, capture_output=True, timeout=120)
