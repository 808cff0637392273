"""Shared by the reliability tests: one uninterrupted `tiny` run that every faulted run must equal bitwise.

Checkpoint frequency does not change the arithmetic, and 2 nodes x 1 rank train exactly as 1 node x
2 ranks (the same world size over gloo), so the one reference serves the random kills
(checkpoint.every_steps=1), the full disk (every 2) and the node loss (2 nodes, every 2) alike.
"""

from __future__ import annotations

import os

import pytest

# Not yet verified in a full CI run on 2 cores (written at the end of the first session): opt in
# with RELIABILITY_TESTS=1 (the test fixtures clear SKYSPOT_* variables) until a session has seen them pass together with the rest of the suite.
collect_ignore_glob = [] if os.environ.get("RELIABILITY_TESTS") else ["test_*.py"]

from tests.trainer.launch import finish, log_text, start

STEPS = 24


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The run dir of `tiny` trained for STEPS steps without interruption."""
    run_dir = tmp_path_factory.mktemp("reliability") / "reference"
    code = finish(start(run_dir, [f"train.steps={STEPS}", "checkpoint.every_steps=8", "train.log_every=8"]))
    assert code == 0, log_text(run_dir)
    return run_dir


def same_params(ours, theirs) -> list[str]:
    """Names of the tensors of final/model.safetensors that differ between two run dirs (empty: bitwise equal)."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(ours / "final" / "model.safetensors"), load_file(theirs / "final" / "model.safetensors")
    return sorted(set(a) ^ set(b)) + [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]
