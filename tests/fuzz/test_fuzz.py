"""A fixed fuzzing budget in CI: atheris over the recipe loader and the override parser
(tests/fuzz/recipe_targets.py says what must hold for every input).

Fixed by the number of inputs and the seed (`-runs`, `-seed`), not by seconds, so a slow machine runs
the same inputs, only slower. Each input is bounded by libFuzzer itself: more than 2 s
(`-timeout`) or 500 MB resident (`-rss_limit_mb`) is a failure, like a crash. The seed corpus is the
shipped recipes and a few overrides; what libFuzzer finds on the way is kept in a temporary corpus.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from skyspot.recipe import RECIPES_DIR
from tests.conftest import REPO

pytest.importorskip("atheris")

RUNS = 3000
_FRESH_PEAK = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"
SEED_OVERRIDES = [
    "train.steps=40",
    "resources.clouds=[aws, gcp]",
    "storage.store=s3://b/p",
    "model.config.x=1",
    "deepspeed.extra={a: 1}",
    "train.lr=3e-4",
    "resources.deadline=36h",
]


@pytest.mark.parametrize("target", ["recipe", "overrides"])
def test_fuzzing_finds_no_crash_hang_or_blow_up(tmp_path, target):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    seeds = (
        [p.read_bytes() for p in sorted(RECIPES_DIR.glob("*.yaml"))]
        if target == "recipe"
        else [s.encode() for s in SEED_OVERRIDES]
    )
    for i, seed in enumerate(seeds):
        (corpus / f"seed-{i}").write_bytes(seed)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # libFuzzer's -rss_limit_mb reads the process's peak RSS, and Linux carries a process's peak across
    # fork and exec: started straight from this pytest process (gigabytes after the suite's earlier
    # tests), the fuzzer would begin above its own limit. A small Python in between forks it afresh.
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _FRESH_PEAK,
            sys.executable,
            "-m",
            "tests.fuzz.recipe_targets",
            target,
            str(corpus),
            f"-runs={RUNS}",
            "-seed=1",
            "-timeout=2",
            "-rss_limit_mb=500",
            "-max_len=4096",
            f"-artifact_prefix={tmp_path}/",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"Done {RUNS} runs" in done.stderr, done.stderr[-2000:]
