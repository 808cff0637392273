"""The store under test: one per backend, each on its real protocol server (tests/storage_servers.py)."""

from __future__ import annotations

import pytest

from skyspot.storage import open_store

SERVERS = {"s3": "s3_server", "gs": "gcs_server", "az": "azure_server"}


@pytest.fixture(params=["local", "s3", "gs", "az"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(tmp_path / "store")
    server = request.getfixturevalue(SERVERS[request.param])
    return open_store(server.bucket() + "/runs")
