"""The tests' one event builder refuses what the readers would skip (tests/builders.py)."""

import pytest

from skyspot.events import valid_event
from tests.builders import event


def test_the_builder_builds_what_the_readers_read_and_refuses_what_they_skip():
    built = event(12, "step", 1, step=3, loss=1.0)
    assert valid_event(built) and built["ts"] == 12.0 and (built["rank"], built["node_rank"]) == (0, 0)
    with pytest.raises(AssertionError, match="valid_event"):
        event(12, "step", 1)  # a step event without its step
    with pytest.raises(AssertionError, match="valid_event"):
        event(12, "attempt_start", -1)  # no negative attempt
