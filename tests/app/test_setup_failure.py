"""A setup that cannot mend its node: its one line, the record it keeps through the bucket mount, and
what `status` makes of it (node_env.record_failure, app/status.py setup_failure)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

from skyspot.app.status import setup_failure
from skyspot.task import package as packaging


def test_a_setup_that_cannot_mend_the_node_says_so_in_one_line_keeps_a_record_and_status_reads_it(tmp_path):
    wheel = packaging.build(tmp_path / "packages", declared=[]).wheel
    store = tmp_path / "store"  # stands for the bucket, as SkyPilot mounts it at SKYSPOT_STORE_MOUNT
    store.mkdir()
    home = tmp_path / "home"  # no ~/.local/bin/uv, and no uv on PATH: nothing setup can mend
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "SKYSPOT_RUN_NAME": "r1",
        "SKYPILOT_SETUP_NODE_RANK": "3",
        "SKYSPOT_STORE_MOUNT": str(store),
        "PYTHONPATH": str(wheel),
        "SKYSPOT_IMAGE": "ami-0123456789",
    }
    done = subprocess.run(
        [sys.executable, "-m", "skyspot.node_env", "setup", "--wheel", str(wheel)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr  # configuration, never 75
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("skyspot node env: uv is not on this node") and "[node: driver none, python " in last
    assert "image ami-0123456789, instance unknown]" in last
    record = json.loads((store / "r1" / "setup" / "node-3.json").read_text())
    assert record["type"] == "setup_failed" and record["image"] == "ami-0123456789"

    run = SimpleNamespace(name="r1", store=str(store))
    said = setup_failure(run)
    assert said.startswith("setup failed on node-3: uv is not on this node") and "image ami-0123456789" in said
    assert setup_failure(SimpleNamespace(name="other", store=str(store))) is None
    (store / "r1" / "setup" / "node-4.json").write_bytes(b"\xff not json")  # a damaged record is skipped
    assert setup_failure(run) == said
