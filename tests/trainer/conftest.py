"""Shared by the end-to-end trainer tests: one uninterrupted reference run for the whole session."""

from __future__ import annotations

import pytest

from tests.trainer.launch import TINY, finish, log_text, start


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """`tiny` trained for TINY's 16 steps without interruption: what every resumed run must equal bitwise."""
    run_dir = tmp_path_factory.mktemp("e2e") / "reference"
    code = finish(start(run_dir, TINY))
    assert code == 0, log_text(run_dir)
    return run_dir
